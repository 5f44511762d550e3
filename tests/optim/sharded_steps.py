"""The sharded == unsharded check the optimizer tests share: a few jitted steps on gradients sin((k+1)·W₀), on one
device and on an 8-device mesh (fsdp=4, tensor=2, Explicit axes), the state keeping its dtypes and shardings; and the
compiled step's check for two patterns that hang a step on 8 simulated devices (`assert_no_hang_patterns`)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sharding


def sine_grads(params, steps: int) -> list:
  return [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), params) for k in range(steps)]


def run_steps(tx, params, grads, state=None):
  """(last update, parameters, state) after one jitted step per gradient tree from `state` (default `tx.init`);
  asserts the state's dtypes and shardings never change."""
  state = tx.init(params) if state is None else state
  kinds = jax.tree.map(lambda a: (a.dtype, a.sharding), state)
  step = jax.jit(tx.update)
  for g in grads:
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
  assert jax.tree.map(lambda a: (a.dtype, a.sharding), state) == kinds
  return u, params, state


def assert_stack_is_separate(run, steps: int = 4):
  """`run(params, grads) -> [params after each step]` on an (E, m, n) stack equals E runs on its matrices, exactly:
  each expert has its own state (the repo's convention for stacked experts and layers)."""
  rng = np.random.default_rng(2)
  stack = {"w": rng.standard_normal((3, 6, 10))}
  grads = [{"w": rng.standard_normal((3, 6, 10))} for _ in range(steps)]
  got = run(stack, grads)
  for e in range(3):
    want = run({"w": stack["w"][e]}, [{"w": g["w"][e]} for g in grads])
    for k in range(steps):
      np.testing.assert_allclose(got[k]["w"][e], want[k]["w"], rtol=0, atol=1e-14, err_msg=f"expert {e} step {k}")


def sharded_and_single(tx, params: dict, specs: dict, steps: int = 3, mesh: str = "fsdp=4,tensor=2"):
  """((update, params, state) on the mesh with each leaf placed by `specs`, params after the same steps on one
  device). The caller compares them and checks the shardings it cares about."""
  grads = sine_grads(params, steps)
  _, single, _ = run_steps(tx, params, grads)
  m = sharding.make_mesh(mesh, explicit=True)
  put = lambda t: {k: jax.device_put(v, jax.sharding.NamedSharding(m, specs[k])) for k, v in t.items()}
  with jax.set_mesh(m):
    return run_steps(tx, put(params), [put(g) for g in grads]), single


def lapack_calls(compiled) -> list[tuple[str, int]]:
  """(kernel, matrices per call) of every LAPACK custom call of a compiled program (its HLO text): the product of the
  leading axes of the call's (first) result."""
  calls = []
  for line in compiled.as_text().splitlines():
    target = re.search(r'custom_call_target="(lapack_\w+)"', line)
    if target:
      dims = re.search(r"= \(?\w+\[([\d,]*)\]", line).group(1)
      calls.append((target.group(1), math.prod(int(d) for d in dims.split(",")[:-2] if d)))
  return calls


def compile_update(tx, params: dict, specs: dict, mesh: str = "data=2,fsdp=4", explicit: bool = False):
  """tx.update compiled (not run) on a mesh of the 8 devices, each leaf placed by `specs`, the state from a jitted
  init; Auto axes by default, as the train CLI builds its mesh."""
  m = sharding.make_mesh(mesh, explicit=explicit)
  put = lambda t: {k: jax.device_put(v, jax.sharding.NamedSharding(m, specs[k])) for k, v in t.items()}
  with jax.set_mesh(m):
    params = put(params)
    state = jax.jit(tx.init)(params)
    return jax.jit(tx.update).lower(params, state, params).compile()


def assert_no_hang_patterns(compiled):
  """Two patterns that hang a step on XLA:CPU's simulated devices for good are absent from a compiled program that
  has LAPACK calls and collectives (else the check would be void): a LAPACK call on a batch of matrices (jaxlib 0.10
  splits it over the thread pool and blocks: `optim.linalg`) and a collective inside a loop (`sharding.audit`)."""
  calls = lapack_calls(compiled)
  assert calls and all(n == 1 for _, n in calls), calls
  ops = sharding.collectives(compiled).ops
  assert ops and not any(op.in_loop for op in ops), [(op.kind, op.computation) for op in ops if op.in_loop]


def flat(tree):
  """{"a/b": array} of a tree's leaves by path (the NumPy references' parameter dicts)."""
  return {jax.tree_util.keystr(k, simple=True, separator="/"): np.asarray(x)
          for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflat(like, d):
  """The tree shaped like `like` whose leaves are `d`'s entries by path (`flat`'s inverse)."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree_util.tree_unflatten(treedef, [d[jax.tree_util.keystr(k, simple=True, separator="/")]
                                                for k, _ in paths])
