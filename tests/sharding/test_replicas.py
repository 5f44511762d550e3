"""sharding/replicas.py: per-replica maps, gossip mixing, DiLoCo's outer step and stale parameters against float64
NumPy simulations of the same algorithms (and torch's Nesterov SGD for the outer optimizer)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from sharding import replicas as rep

RNG = np.random.default_rng(0)


def problem(r: int, n: int = 6, d: int = 8):
  """Least squares with its own data per replica: A (R, n, d), b (R, n); f_i(x) = ||A_i x - b_i||² / (2n)."""
  return RNG.normal(size=(r, n, d)), RNG.normal(size=(r, n))


def grad_np(a, b, x):
  return np.einsum("rnd,rn->rd", a, np.einsum("rnd,rd->rn", a, x) - b) / a.shape[1]


def replicated_step(a, b, lr):
  """jitted: every replica's SGD step on its own data (map_replicas), its rows of A and b arriving as a batch."""
  def local(x, a, b):
    g = jax.grad(lambda x: 0.5 * jnp.mean(jnp.square(a[0] @ x - b[0])))(x)
    return x - lr * g
  return lambda x: rep.map_replicas(local, (x, a, b), ("stacked", "rows", "rows"))


@pytest.mark.parametrize("mesh_spec", ["data=8", "data=4,fsdp=2", "data=2,fsdp=2,tensor=2"])
@pytest.mark.parametrize("mixing", ["ring", "matrix"])
def test_gossip_sgd_equals_a_numpy_simulation_and_keeps_the_mean(mesh_spec, mixing):
  """D-PSGD, x_i <- sum_j W_ij (x_j - lr grad f_j(x_j)), 5 steps: replicas and their mean as float64 NumPy; the mean
  moves exactly as the mean of the local steps (W doubly stochastic), and the replicas contract toward it."""
  mesh = sharding.make_mesh(mesh_spec)
  r = mesh.shape["data"]
  a, b = problem(r)
  w = rep.ring_matrix(r) if mixing == "ring" else rep.check_mixing(_random_doubly_stochastic(r), r)
  x_np = RNG.normal(size=(r, a.shape[2]))
  put = lambda v, *spec: jax.device_put(jnp.asarray(v, jnp.float32), NamedSharding(mesh, P(*spec)))
  x = put(x_np, "data")
  with jax.set_mesh(mesh):
    local = replicated_step(put(a[:, None], "data"), put(b[:, None], "data"), 0.1)
    mix = rep.ring_mix if mixing == "ring" else (lambda s: rep.mix(s, w))
    step = jax.jit(lambda x: mix(local(x)))
    for _ in range(5):
      stepped = x_np - 0.1 * grad_np(a, b, x_np)
      x_new_np = w @ stepped
      np.testing.assert_allclose(x_new_np.mean(0), stepped.mean(0), atol=1e-12)  # mixing keeps the mean
      x, x_np = step(x), x_new_np
      assert x.sharding.spec == P("data")
      np.testing.assert_allclose(np.asarray(x), x_np, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(rep.mean)(x)), x_np.mean(0), atol=2e-5)
    spread = np.sqrt(np.mean(np.sum((x_np - x_np.mean(0)) ** 2, axis=1)))
    np.testing.assert_allclose(float(jax.jit(rep.consensus_distance)(x)), spread, rtol=1e-4)


def _random_doubly_stochastic(r):
  """A convex combination of permutation matrices (Birkhoff): doubly stochastic, not symmetric."""
  perms = [np.eye(r)[RNG.permutation(r)] for _ in range(3)]
  weights = RNG.dirichlet(np.ones(3))
  return sum(c * p for c, p in zip(weights, perms))


def test_ring_matrix_and_ring_mix_agree_for_every_replica_count():
  for r in (1, 2, 4, 8):
    w = rep.ring_matrix(r)
    rep.check_mixing(w, r)
    mesh = sharding.make_mesh(f"data={r}", devices=jax.devices()[:r])
    x_np = RNG.normal(size=(r, 3, 2))
    with jax.set_mesh(mesh):
      x = jax.device_put(jnp.asarray(x_np, jnp.float32), NamedSharding(mesh, P("data")))
      np.testing.assert_allclose(np.asarray(jax.jit(rep.ring_mix)(x)), np.einsum("ij,jab->iab", w, x_np), atol=1e-6)
  np.testing.assert_allclose(rep.ring_matrix(2), [[1 / 3, 2 / 3], [2 / 3, 1 / 3]])


def test_ring_gossip_sends_only_neighbour_permutes_and_they_cross_replicas():
  """The compiled ring: collective-permutes only, 2 per leaf (1 when R = 2), each the leaf's bytes per device, all
  crossing replicas; an fsdp-only all-reduce inside a replica crosses none."""
  mesh = sharding.make_mesh("data=4,fsdp=2")
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.zeros((4, 16, 8)), NamedSharding(mesh, P("data", "fsdp")))
    audit = sharding.collectives(jax.jit(rep.ring_mix).lower(x).compile())
    assert set(audit.summary()) == {"collective-permute"} and len(audit.ops) == 2
    assert rep.cross_replica_bytes(audit, mesh) == 2 * 8 * 8 * 4  # two permutes of the (16/2, 8) fp32 slice
    inner = jax.jit(lambda x: rep.map_replicas(lambda v: jnp.sum(v), (x,), ("stacked",))).lower(x).compile()
    inner_audit = sharding.collectives(inner)
    assert inner_audit.ops and rep.cross_replica_bytes(inner_audit, mesh) == 0


def test_map_replicas_gives_each_replica_its_copy_and_its_rows():
  mesh = sharding.make_mesh("data=4,tensor=2")
  with jax.set_mesh(mesh):
    stacked = jax.device_put(jnp.arange(4.0)[:, None] * jnp.ones((4, 2)), NamedSharding(mesh, P("data", "tensor")))
    rows = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    shared = jnp.float32(100)
    out = jax.jit(lambda s, r: rep.map_replicas(lambda a, b, c: (a.sum(), b, c), (s, r, shared),
                                                ("stacked", "rows", "shared")))(stacked, rows)
  np.testing.assert_array_equal(out[0], [0, 2, 4, 6])
  np.testing.assert_array_equal(out[1], np.arange(8.0).reshape(4, 2))
  np.testing.assert_array_equal(out[2], [100] * 4)
  with pytest.raises(rep.ReplicaError, match="argument kinds"):
    rep.map_replicas(lambda a: a, (stacked,), ("copied",))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_diloco_outer_steps_equal_torch_nesterov_sgd_on_the_mean_change(momentum):
  """3 rounds: replicas start from the outer parameters, move apart (here: given changes), the outer gradient is
  params - mean(replicas) and torch.optim.SGD (nesterov when momentum > 0) steps on it. lr 1, no momentum: the new
  parameters are the replicas' mean."""
  mesh = sharding.make_mesh("data=4,fsdp=2")
  p_sh = NamedSharding(mesh, P("fsdp"))
  lr = 1.0 if momentum == 0 else 0.7
  tx = optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum))
  p_np = RNG.normal(size=6)
  ref = torch.nn.Parameter(torch.tensor(p_np))
  opt = torch.optim.SGD([ref], lr=lr, momentum=momentum, nesterov=bool(momentum))
  params = jax.device_put(jnp.asarray(p_np, jnp.float32), p_sh)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)
    stacked, _ = rep.stack(params, p_sh)
    outer = jax.jit(lambda p, s, x: rep.outer_step(tx, p, s, x))
    for _ in range(3):
      moves = RNG.normal(size=(4, 6)) * 0.1
      start = ref.detach().numpy().copy()
      replicas_np = start + moves
      stacked = stacked + jnp.asarray(moves, jnp.float32)
      params, state, stacked = outer(params, state, stacked)
      opt.zero_grad()
      ref.grad = torch.tensor(start - replicas_np.mean(0))
      opt.step()
      np.testing.assert_allclose(np.asarray(params), ref.detach().numpy(), rtol=0, atol=1e-5)
      np.testing.assert_allclose(np.asarray(stacked), np.broadcast_to(np.asarray(params), (4, 6)))
      assert stacked.sharding.spec == P("data", "fsdp")
      if momentum == 0:
        np.testing.assert_allclose(np.asarray(params), replicas_np.mean(0), atol=1e-5)


def test_stale_history_returns_the_parameters_of_delay_steps_ago():
  """A history of tau + 1 versions against a Python list of every version: version step - d for d <= min(tau, step)."""
  tau = 3
  versions = [np.full(2, 0.0)]
  history = jnp.broadcast_to(jnp.asarray(versions[0], jnp.float32), (tau + 1, 2))
  for step in range(7):
    for d in range(min(tau, step) + 1):
      np.testing.assert_array_equal(rep.stale_params(history, jnp.int32(step), jnp.int32(d)), versions[step - d])
    versions.append(np.full(2, step + 1.0))
    history = rep.record(history, jnp.int32(step), jnp.asarray(versions[-1], jnp.float32))


def test_delays_fixed_random_and_never_before_the_first_step():
  key = jax.random.key(0)
  np.testing.assert_array_equal(rep.delays(key, jnp.int32(1), 4, 3, False), [1, 1, 1, 1])
  np.testing.assert_array_equal(rep.delays(key, jnp.int32(5), 4, 3, False), [3, 3, 3, 3])
  draws = np.stack([rep.delays(key, jnp.int32(s), 8, 3, True) for s in range(10, 60)])
  assert draws.min() == 0 and draws.max() == 3 and len({tuple(d) for d in draws}) > 1
  np.testing.assert_array_equal(draws[0], rep.delays(key, jnp.int32(10), 8, 3, True))  # a function of (key, step)
  assert (rep.delays(key, jnp.int32(1), 8, 3, True) <= 1).all()


def test_bad_mixing_matrices_and_a_data_sharded_array_are_refused():
  with pytest.raises(rep.ReplicaError, match=r"must be \(4, 4\)"):
    rep.check_mixing(np.eye(3), 4)
  with pytest.raises(rep.ReplicaError, match="doubly stochastic"):
    rep.check_mixing(np.full((2, 2), 0.6), 2)
  with pytest.raises(rep.ReplicaError, match="doubly stochastic"):
    rep.check_mixing([[1.5, -0.5], [-0.5, 1.5]], 2)
  mesh = sharding.make_mesh("data=8")
  with pytest.raises(rep.ReplicaError, match="--zero1"):
    rep.stacked_sharding(NamedSharding(mesh, P("data")))
