"""reshard moves a whole train state (params + any optax state) to another mesh bit for bit, with the layout
init_train_state would have built there; moved_bytes counts the boxes that change device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import sharding
from optim import get_optimizer
from sharding.reshard import ReshardError, abstract_state, moved_bytes, reshard, state_shardings

CFG = models.preset("tiny")
MOE = models.preset("tiny", moe=models.MoEConfig(num_experts=4, top_k=2, bias_rate=1e-3))


def model_fn(cfg=CFG):
  return models.Transformer(cfg, rngs=nnx.Rngs(0))


def noisy_state(tx, mesh, seed=0, fn=model_fn):
  """A train state on `mesh` (params split by their logical names, moments like their params, buffers such as
  the MoE router bias replicated) whose every leaf holds random bits; built from shapes, so nothing compiles."""
  _, abstract, names = sharding.logical_names(fn)
  p_sh = sharding.param_shardings(abstract, names, mesh)
  opt = jax.eval_shape(tx.init, abstract)
  state = {"step": jax.ShapeDtypeStruct((), np.int32), "params": abstract, "opt_state": opt}
  shardings = {"step": NamedSharding(mesh, P()), "params": p_sh,
               "opt_state": sharding.shardings_like_params(opt, abstract, p_sh, mesh)}
  buffers = nnx.to_pure_dict(nnx.state(nnx.eval_shape(fn), nnx.Not(nnx.Param)))
  if buffers:
    state["buffers"], shardings["buffers"] = buffers, jax.tree.map(lambda _: NamedSharding(mesh, P()), buffers)
  rng = np.random.default_rng(seed)

  def fill(x, s):
    v = rng.integers(1, 1000, x.shape) if np.issubdtype(x.dtype, np.integer) else rng.standard_normal(x.shape)
    return jax.device_put(np.asarray(v, x.dtype), s)

  return jax.tree.map(fill, state, shardings), shardings


def specs(shardings):
  return {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


# Hand-derived from sharding/rules.py (embed -> fsdp; heads, mlp, vocab -> tensor; blocks carry a leading `layers`
# axis): what a parameter and each of its moments must look like on the new mesh.
GOLDEN = {
    "data=2,tensor=4": {"wq_DQ": P(None, None, "tensor"), "w_down_FD": P(None, "tensor"), "embed_VD": P("tensor"),
                        "attn_norm": P()},
    "fsdp=4": {"wq_DQ": P(None, "fsdp"), "w_down_FD": P(None, None, "fsdp"), "embed_VD": P(None, "fsdp"),
               "attn_norm": P()},
}
SWITCHES = [("fsdp=8", 8, "data=2,tensor=4", 8), ("data=8", 8, "fsdp=4", 4)]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("src, n_src, dst, n_dst", SWITCHES)
def test_reshard_is_bit_exact_with_the_rules_layout(optimizer, src, n_src, dst, n_dst):
  tx = get_optimizer(optimizer, 1e-3)
  old_mesh = sharding.make_mesh(src, devices=jax.devices()[:n_src])
  new_mesh = sharding.make_mesh(dst, devices=jax.devices()[:n_dst])
  state, old_sh = noisy_state(tx, old_mesh)
  host = jax.tree.map(np.asarray, state)
  _, _, names = sharding.logical_names(model_fn)

  new = reshard(state, new_mesh, names)

  got = specs(jax.tree.map(lambda x: x.sharding, new))
  assert all(x.sharding.mesh == new_mesh for x in jax.tree.leaves(new))
  assert got == specs(state_shardings(state, names, new_mesh))
  assert got["['step']"] == P()
  n_moments = 0
  for key, spec in got.items():  # the param and every moment of it (Adam mu, nu; Muon mu) follow the rules table
    name = key.rsplit("['", 1)[-1][:-2]
    if name in GOLDEN[dst]:
      assert spec == GOLDEN[dst][name], (key, spec)
      n_moments += "opt_state" in key
  assert n_moments >= 4 if optimizer == "muon" else n_moments == 8
  # the values: every leaf equal bit for bit, and every device shard is the right slice on a new-mesh device
  assert jax.tree.structure(host) == jax.tree.structure(new)
  for want, x in zip(jax.tree.leaves(host), jax.tree.leaves(new)):
    assert x.dtype == want.dtype and np.array_equal(np.asarray(x), want)
    for shard in x.addressable_shards:
      assert shard.device in set(new_mesh.devices.flat)
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
  assert len(jax.tree.leaves(host["opt_state"])) > len(jax.tree.leaves(host["params"]))  # a moment per param + more
  assert {d for x in jax.tree.leaves(new) for d in x.sharding.device_set} == set(jax.devices()[:n_dst])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_moe_state_moves_from_expert4_data2_to_expert2_fsdp4(optimizer):
  tx = get_optimizer(optimizer, 1e-3)
  fn = lambda: model_fn(MOE)
  state, _ = noisy_state(tx, sharding.make_mesh("expert=4,data=2"), seed=2, fn=fn)
  host = jax.tree.map(np.asarray, state)
  _, _, names = sharding.logical_names(fn)
  new_mesh = sharding.make_mesh("expert=2,fsdp=4")
  assert state["params"]["blocks"]["moe"]["w_gate_EDF"].sharding.spec == P(None, "expert")
  new = reshard(state, new_mesh, names)
  for want, x in zip(jax.tree.leaves(host), jax.tree.leaves(new)):
    assert x.sharding.mesh == new_mesh and np.array_equal(np.asarray(x), want)
  got = specs(jax.tree.map(lambda x: x.sharding, new))
  golden = {"w_gate_EDF": P(None, "expert", "fsdp"), "w_down_EFD": P(None, "expert", None, "fsdp"),
            "router_DE": P(None, "fsdp"), "router_bias": P(), "wq_DQ": P(None, "fsdp")}
  seen = {name: 0 for name in golden}
  for key, spec in got.items():
    name = key.rsplit("['", 1)[-1][:-2]
    if name in golden:
      assert spec == golden[name], (key, spec)
      seen[name] += 1
  # each expert stack: the param and its moment(s); the router bias: one buffer, outside the optimizer
  assert seen["w_gate_EDF"] == (3 if optimizer == "adamw" else 2) and seen["router_bias"] == 1, seen


def test_layout_is_what_init_train_state_builds_on_the_new_mesh():
  """The one compiled init in this file (on the mesh and model the train tests use, so a test session compiles
  it once): Muon's partitioned state with ZeRO-1."""
  tx = get_optimizer("muon", 1e-3)
  new_mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
  state, _ = noisy_state(tx, sharding.make_mesh("fsdp=8"))
  host = jax.tree.map(np.asarray, state)
  _, _, names = sharding.logical_names(model_fn)
  _, _, init_sh = sharding.init_train_state(model_fn, tx, new_mesh, zero1=True)
  new = reshard(state, new_mesh, shardings=state_shardings(state, names, new_mesh, zero1=True))
  assert jax.tree.structure(new) == jax.tree.structure(init_sh)
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(new), jax.tree.leaves(init_sh)))
  assert all(np.array_equal(np.asarray(x), h) for x, h in zip(jax.tree.leaves(new), jax.tree.leaves(host)))
  # ZeRO-1 by hand: a moment is split over data on its first free dimension (the layer stack), its param is not
  mu = new["opt_state"].inner_states["muon"].inner_state[0].mu["blocks"]["wq_DQ"]
  assert mu.sharding.spec == P("data", "fsdp", "tensor") and new["params"]["blocks"]["wq_DQ"].sharding.spec == P(
      None, "fsdp", "tensor")


def test_donate_frees_the_source_and_precomputed_shardings_give_the_same_state():
  tx = get_optimizer("adamw", 1e-3)
  state, _ = noisy_state(tx, sharding.make_mesh("fsdp=8"), seed=1)
  host = jax.tree.map(np.asarray, state)
  _, _, names = sharding.logical_names(model_fn)
  new_mesh = sharding.make_mesh("fsdp=2,tensor=2", devices=jax.devices()[4:])  # other devices entirely
  target = state_shardings(state, names, new_mesh)
  abstract = abstract_state(state, target)
  assert all(a.sharding == s and a.shape == np.shape(h) for a, s, h in
             zip(jax.tree.leaves(abstract), jax.tree.leaves(target), jax.tree.leaves(host)))
  replicated = [x.sharding.is_fully_replicated for x in jax.tree.leaves(state)]
  new = reshard(state, new_mesh, shardings=target, donate=True)
  # every split source is freed; a replicated one stays, as its copy on devices 4-7 reuses the replicas there
  assert [x.is_deleted() for x in jax.tree.leaves(state)] == [not r for r in replicated]
  assert 0 < sum(replicated) < len(replicated)
  assert all(np.array_equal(np.asarray(x), h) and x.sharding == s
             for x, h, s in zip(jax.tree.leaves(new), jax.tree.leaves(host), jax.tree.leaves(target)))


def test_moved_bytes_counts_only_what_changes_device():
  # parallelism.md §6: (data=2, tensor=4) P(None, 'tensor') -> (data=4, tensor=2) P('data', 'tensor') moves 3/4 of
  # the array. By hand: each of the 8 new (row-quarter, column-half) boxes is 1/8 of the array; device k held column
  # quarter k % 4, which lies in its new column half k % 2 for k in {0, 3, 4, 7}: those keep a 1/16 overlap.
  x = jax.ShapeDtypeStruct((8, 16), np.float32)
  a = NamedSharding(sharding.make_mesh("data=2,tensor=4"), P(None, "tensor"))
  b = NamedSharding(sharding.make_mesh("data=4,tensor=2"), P("data", "tensor"))
  assert moved_bytes(x, a, b) == 8 * 16 * 4 * 3 // 4
  assert moved_bytes(x, b, b) == 0
  full = NamedSharding(a.mesh, P())
  assert moved_bytes(x, full, b) == 0  # every device already holds everything
  assert moved_bytes(x, b, full) == 8 * (8 * 16 * 4 - 8 * 16 * 4 // 8)  # each fetches the 7/8 it lacks
  low = NamedSharding(sharding.make_mesh("fsdp=4", devices=jax.devices()[:4]), P("fsdp"))
  high = NamedSharding(sharding.make_mesh("fsdp=4", devices=jax.devices()[4:]), P("fsdp"))
  assert moved_bytes(x, low, high) == 8 * 16 * 4  # disjoint devices: all of it
  # devices 4+i held (all rows, column quarter i) on `a` and need (row quarter i, all columns): 1/16 is already there
  assert moved_bytes(x, a, high) == 4 * (8 * 16 * 4 // 4 - 8 * 16 * 4 // 16)
  assert moved_bytes({"w": x, "v": x}, {"w": a, "v": b}, {"w": b, "v": b}) == 8 * 16 * 4 * 3 // 4


def test_bad_input_is_a_clear_error():
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  state = {"step": jax.ShapeDtypeStruct((), np.int32), "params": {"w": jax.ShapeDtypeStruct((6, 4), np.float32)}}
  with pytest.raises(sharding.ShardingError, match=r"size 6.*does not divide by mesh axes \('fsdp',\)"):
    state_shardings(state, {"w": ("embed", "mlp")}, mesh)
  with pytest.raises(ReshardError, match="does not match state\\['params'\\]"):
    state_shardings(state, {"v": ("embed", "mlp")}, mesh)
  with pytest.raises(ReshardError, match="dict with a 'params' entry"):
    state_shardings([state], {}, mesh)
  with pytest.raises(ReshardError, match="needs new_mesh and names"):
    reshard(state, mesh)
  other = state_shardings(state, {"w": ("mlp", None)}, mesh)
  with pytest.raises(ReshardError, match="another mesh than new_mesh"):
    reshard(state, sharding.make_mesh("data=8"), shardings=other)
  with pytest.raises(ReshardError, match="do not match the state's tree"):
    reshard({"params": state["params"]}, shardings=other)
