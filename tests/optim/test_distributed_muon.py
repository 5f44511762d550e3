"""Distributed Muon (`optim.muon(..., distributed=True)`) against single-device Muon on 8-device meshes, and what
its compiled program does: one batched Newton–Schulz per shape group on ⌈K/8⌉ matrices per device, no collective
inside the loop, whole matrices never gathered onto every device."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optim
import sharding
from optim import DistributedError, orthogonalize, orthogonalize_distributed

# name: (shape, axes of each dimension). Groups by (short, long) side: (32, 64): w_up + w_down (tall) = 6
# matrices; (32, 32): 3; (32, 48): 2·4 experts in + 2·4 experts out (tall) + proj (tall) = 17, padded to 24.
LAYOUT = {
    "w_up": ((3, 32, 64), (None, "fsdp", "tensor")),
    "w_down": ((3, 64, 32), (None, "tensor", "fsdp")),
    "wq": ((3, 32, 32), (None, "fsdp", "tensor")),
    "experts": {"w_in": ((2, 4, 32, 48), (None, None, "fsdp", "tensor")),
                "w_out": ((2, 4, 48, 32), (None, None, "tensor", "fsdp"))},
    "proj": ((48, 32), ("tensor", "fsdp")),
    "norm": ((32,), (None,)),  # routed to AdamW by muon_labels
}
GROUPS = {(32, 64): 6, (32, 32): 3, (32, 48): 17}
COLLECTIVE = r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
is_layout = lambda x: isinstance(x, tuple) and isinstance(x[0], tuple)


def host_params(seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda l: rng.standard_normal(l[0]).astype(np.float32), LAYOUT, is_leaf=is_layout)


def grads(k):
  return jax.tree.map(lambda p: np.sin((k + 1) * p + k).astype(np.float32), host_params())


def param_shardings(mesh):
  keep = lambda a: a if a is not None and mesh.shape[a] > 1 else None
  return jax.tree.map(lambda l: NamedSharding(mesh, P(*map(keep, l[1]))), LAYOUT, is_leaf=is_layout)


@functools.cache
def reference(steps=3):
  """Single-device Muon (`distributed=False`) on unsharded arrays: params after each step."""
  tx = optim.muon(0.02)
  params, out = jax.tree.map(jnp.asarray, host_params()), []
  state = tx.init(params)
  step = jax.jit(tx.update)
  for k in range(steps):
    u, state = step(jax.tree.map(jnp.asarray, grads(k)), state, params)
    params = optax.apply_updates(params, u)
    out.append(jax.tree.map(np.asarray, params))
  return out


def loop_bodies(hlo):
  computations = dict(re.findall(r"\n(%?[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
  return [computations[b if b in computations else b.lstrip("%")] for b in re.findall(r"body=(%?[\w.\-]+)", hlo)]


def ns_batches(hlo):
  """(matrices, short, long) of every Newton–Schulz loop's carried f32 batch, per device."""
  carries = re.findall(r"= \(([^)]*)\) while\(", hlo)
  return sorted(tuple(map(int, s.split(","))) for c in carries for s in re.findall(r"f32\[(\d+,\d+,\d+)\]", c))


def collective_lines(hlo):
  return [l for l in hlo.splitlines() if re.search(rf"\s({COLLECTIVE})(-start)?\(", l)]


def result_bytes(line):
  """Bytes of an instruction's result (all arrays of a tuple)."""
  shape = line.split("=", 1)[1].split(f" {re.search(COLLECTIVE, line).group(0)}")[0]
  return sum(4 * math.prod(map(int, s.split(","))) for s in re.findall(r"f32\[([\d,]+)\]", shape))


@pytest.mark.parametrize("spec, explicit", [("fsdp=8", False), ("data=2,fsdp=4", False), ("fsdp=4,tensor=2", False),
                                            ("fsdp=4,tensor=2", True)])
def test_distributed_muon_equals_single_device_muon(spec, explicit):
  mesh = sharding.make_mesh(spec, explicit=explicit)
  tx = optim.muon(0.02, distributed=True)
  p_sh = param_shardings(mesh)
  params = jax.device_put(host_params(), p_sh)
  o_sh = sharding.shardings_like_params(jax.eval_shape(tx.init, params), params, p_sh, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init, out_shardings=o_sh)(params)
    g0 = jax.device_put(grads(0), p_sh)
    step = jax.jit(tx.update).lower(g0, state, params).compile()
  for k, want in enumerate(reference()):
    u, state = step(jax.device_put(grads(k), p_sh), state, params)
    params = optax.apply_updates(params, u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2e-6), params, want)
  for a, s in zip(jax.tree.leaves(u), jax.tree.leaves(p_sh)):  # the update has its parameter's sharding
    assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
  mu = state.inner_states["muon"].inner_state[0].mu
  assert mu["w_up"].sharding.is_equivalent_to(p_sh["w_up"], 3)

  hlo = step.as_text()
  # one batched NS per group, ⌈K/8⌉ whole matrices per device (not K), and nothing crosses devices in the loop
  assert ns_batches(hlo) == sorted((-(-k // 8),) + g for g, k in GROUPS.items())
  muon_leaves = [x for k, x in params.items() if k != "norm"]
  assert optim.distributed.shape_groups(muon_leaves) == {g + ("float32",): k for g, k in GROUPS.items()}
  assert optim.distributed.ns_flops_per_device(muon_leaves, 8) == sum(
      c * optim.ns_flops(s, l, 5) for c, s, l in ns_batches(hlo))
  for body in loop_bodies(hlo):
    assert not re.search(COLLECTIVE, body)
  lines = collective_lines(hlo)
  assert any("all-to-all" in l for l in lines)
  assert not any(re.search(r"all-reduce|reduce-scatter", l) for l in lines)
  # Only the data axis, over which the parameters are replicated, gathers results; per device at most its own
  # share of them (each padded group batch split over fsdp), never whole matrices onto every device.
  gathered = sum(result_bytes(l) for l in lines if "all-gather" in l)
  fsdp = mesh.shape["fsdp"]
  if mesh.shape["data"] == 1:
    assert gathered == 0
  else:
    assert 0 < gathered <= sum(4 * 8 * -(-k // 8) * s * l for (s, l), k in GROUPS.items()) / fsdp


def test_lowering_is_deterministic():
  """The same step lowers to the same program every time, so the persistent compilation cache hits."""
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  params = jax.device_put(host_params(), param_shardings(mesh))
  texts = set()
  for _ in range(2):
    tx = optim.muon(0.02, distributed=True)
    with jax.set_mesh(mesh):
      texts.add(jax.jit(tx.update).lower(params, jax.jit(tx.init)(params), params).as_text())
  assert len(texts) == 1


def test_without_a_mesh_it_is_per_leaf_orthogonalize():
  x = {"a": jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 8, 12)), jnp.float32),
       "b": jnp.asarray(np.random.default_rng(2).standard_normal((12, 8)), jnp.float32)}
  out = jax.jit(lambda t: orthogonalize_distributed(t, coeffs="polar_express", steps=5, eps=1e-7,
                                                    compute_dtype=None, method="standard"))(x)
  want = jax.jit(lambda t: jax.tree.map(lambda a: orthogonalize(a, coeffs="polar_express"), t))(x)
  for k in x:
    np.testing.assert_array_equal(out[k], want[k])
  with pytest.raises(DistributedError, match="route vectors to another optimizer"):
    orthogonalize_distributed({"v": jnp.ones(4)})
