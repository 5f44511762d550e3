"""Dion against an independent float64 NumPy reference of the paper's Algorithm 1 (Ahn et al., arXiv 2504.05295),
its exact properties at full rank, sharded == unsharded on 8 devices (Householder and CholeskyQR2 paths), the
collectives of the distributed step, zero and rank-deficient gradients, and inject_hyperparams.

No installed oracle has Dion (pytorch_optimizer 4.1.0 has none; microsoft/dion, a torch.compile + DTensor
package, is not installed), so the reference is written here from the paper's equations, one matrix at a time, in
the reference code's orientation (`dion_reference.py` transposes torch's (out, in) weight when out < in, so P lies
on the longer side; our layout is (fan_in, fan_out)): B = M + G, P = QR(B Q) with R's diagonal positive,
R = Bᵀ P, M = B − (1−μ)·P Rᵀ, Q = R/(‖R_:,j‖ + eps), X ← X(1 − lr·wd) − lr·√(fan_out/fan_in)·P Qᵀ.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_steps import assert_no_hang_patterns, compile_update, run_steps

import optim
import sharding
from optim import DionError, DionState, dion, dion_rank, right_factor_spec, scale_by_dion
from optim.dion import _cholesky_qr2, _inverse_cholesky_factor
from research.bench.dion import dion_expected_bytes, state_shardings, step_bytes

RNG = np.random.default_rng(0)
SHAPES = {"tall": (12, 5), "wide": (5, 12), "square": (8, 8), "stack": (3, 6, 10)}
STEPS = 6
HP = dict(lr=0.02, beta=0.9, wd=0.1, eps=1e-8)
# float64: the largest difference from the reference over these trajectories measured 1.3e-15 (both methods, both
# ranks) on weights of size ~1, i.e. rounding; 1e-12 leaves room for other BLAS builds.
F64 = 1e-12


def tree(scale=1.0):
  return {k: scale * RNG.standard_normal(s) for k, s in SHAPES.items()}


P0, GRADS = tree(), [tree(s) for s in (1.0, 0.5, 2.0, 0.1, 1.0, 0.3)]


def dion_state(state) -> DionState:
  """The DionState inside a (partitioned, chained) optimizer state."""
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, DionState)) if isinstance(x, DionState)]
  assert len(found) == 1
  return found[0]


def np_dion(w0, grads, q0, *, lr, beta, wd, eps):
  """Algorithm 1 for one (fan_in, fan_out) matrix, float64; returns the weights after each step."""
  m, n = w0.shape
  tall = m > n  # P on the longer side; ties to fan_out, as the reference code
  x, mom, q = (w0 if tall else w0.T).copy(), np.zeros((max(m, n), min(m, n))), q0.copy()
  out = []
  for g in grads:
    b = mom + (g if tall else g.T)
    p, rq = np.linalg.qr(b @ q)
    p = p * np.where(np.diag(rq) < 0, -1.0, 1.0)
    r = b.T @ p
    mom = b - (1 - beta) * p @ r.T
    q = r / (np.linalg.norm(r, axis=0) + eps)
    x = x * (1 - lr * wd) - lr * np.sqrt(n / m) * p @ q.T
    out.append(x.copy() if tall else x.T.copy())
  return out


def np_reference(q0, hp=HP):
  """Every leaf of P0 (each matrix of the stack on its own) through `np_dion`."""
  out = [{} for _ in GRADS]
  for k, w in P0.items():
    mats = [(w, q0[k], [g[k] for g in GRADS])] if w.ndim == 2 else \
        [(w[i], q0[k][i], [g[k][i] for g in GRADS]) for i in range(w.shape[0])]
    runs = [np_dion(w_, gs, q_, **hp) for w_, q_, gs in mats]
    for t in range(len(GRADS)):
      out[t][k] = runs[0][t] if w.ndim == 2 else np.stack([r[t] for r in runs])
  return out


P0.update({f"stack{i}": P0["stack"][i] for i in range(3)})  # the stack's matrices, alone (Q set to its slices)
for g in GRADS:
  g.update({f"stack{i}": g["stack"][i] for i in range(3)})


@functools.cache
def run_ours(rank_fraction, distributed):
  """Our trajectory in float64 through `dion` under inject_hyperparams: (params, Dion's momentum) after each
  step, and Q's initial value."""
  with jax.enable_x64(True):
    tx = optax.inject_hyperparams(dion, static_args=("rank_fraction",))(
        learning_rate=HP["lr"], beta=HP["beta"], weight_decay=HP["wd"], eps=HP["eps"], rank_fraction=rank_fraction,
        distributed=distributed)
    step = jax.jit(tx.update)
    params = jax.tree.map(jnp.asarray, P0)
    state = tx.init(params)
    q = dion_state(state).q  # the state's own dict: Q of the lone matrices := the stack's slices
    q.update({f"stack{i}": q["stack"][i] for i in range(3)})
    q0 = jax.tree.map(np.asarray, q)
    out, moms = [], []
    for g in GRADS:
      u, state = step(jax.tree.map(jnp.asarray, g), state, params)
      params = optax.apply_updates(params, u)
      assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(params))
      out.append(jax.tree.map(np.asarray, params))
      moms.append(jax.tree.map(np.asarray, dion_state(state).mu))
  return out, moms, q0


@pytest.mark.parametrize("distributed", [False, True], ids=["householder", "cholesky_qr2"])
@pytest.mark.parametrize("rank_fraction", [1.0, 0.25])
def test_matches_float64_reference(rank_fraction, distributed):
  got, _, q0 = run_ours(rank_fraction, distributed)
  for k, w in P0.items():
    assert q0[k].shape == w.shape[:-2] + (min(w.shape[-2:]), dion_rank(w.shape, rank_fraction))
  want = np_reference(q0)
  for t in range(STEPS):
    for k in SHAPES:
      np.testing.assert_allclose(got[t][k], want[t][k], rtol=0, atol=F64, err_msg=f"step {t + 1} {k}")
  assert min(np.abs(want[-1][k] - P0[k]).max() for k in SHAPES) > 1e-2  # the weights did move


@pytest.mark.parametrize("distributed", [False, True], ids=["householder", "cholesky_qr2"])
def test_stack_equals_separate_matrices(distributed):
  """A (3, 6, 10) stack gives what its three matrices give alone (in the same run, Q set to the stack's slices);
  measured: bit-identical here."""
  got, moms, _ = run_ours(0.25, distributed)
  for t in range(STEPS):
    for i in range(3):
      np.testing.assert_allclose(got[t]["stack"][i], got[t][f"stack{i}"], rtol=0, atol=1e-14)
      np.testing.assert_allclose(moms[t]["stack"][i], moms[t][f"stack{i}"], rtol=0, atol=1e-14)


@pytest.mark.parametrize("distributed", [False, True], ids=["householder", "cholesky_qr2"])
def test_full_rank_error_feedback_leaves_muons_classic_momentum(distributed):
  """At r = min(m, n), P spans B's columns (B Q has B's column space for an invertible Q), so P Pᵀ B = B: the
  error feedback leaves M_t = μ·B_t with B_t = μ·B_{t−1} + G_t, the classic momentum that Muon orthogonalizes
  (optim.scale_by_muon(momentum="classic", nesterov=False) keeps B_t). At rank 0.25 the residual B − P Rᵀ is not
  zero (so the check can fail)."""
  mu = HP["beta"]
  for rank_fraction, full in ((1.0, True), (0.25, False)):
    _, moms, _ = run_ours(rank_fraction, distributed)
    b = {k: np.zeros_like(v) for k, v in P0.items()}
    for t, g in enumerate(GRADS):
      b = {k: mu * b[k] + g[k] for k in b}
      err = max(np.abs(moms[t][k] - mu * b[k]).max() for k in SHAPES)
      assert (err < 1e-12) if full else (t == 0 or err > 1e-2), (rank_fraction, t, err)


@pytest.mark.parametrize("rank_fraction, distributed", [(1.0, False), (0.25, True)])
def test_update_at_the_power_iteration_fixed_point_is_the_polar_factor(rank_fraction, distributed):
  """With Q = V_r, B's top-r right singular vectors: B V_r = U_r Σ_r has orthogonal columns, so its QR factor is
  U_r, R = Bᵀ U_r = V_r Σ_r, Q ← V_r (eps = 0) and the update is U_r V_rᵀ: at full rank the polar factor of B, the
  orthogonalized momentum that Muon's Newton–Schulz iteration approximates; below it, its rank-r truncation."""
  with jax.enable_x64(True):
    tx = scale_by_dion(0.9, rank_fraction=rank_fraction, eps=0.0, scale="none", distributed=distributed)
    params = {k: jnp.asarray(P0[k]) for k in SHAPES}
    state, step = tx.init(params), jax.jit(tx.update)
    for g in GRADS[:2]:
      _, state = step({k: jnp.asarray(g[k]) for k in SHAPES}, state)
    g = {k: GRADS[2][k] for k in SHAPES}
    qs, want = {}, {}
    for k in SHAPES:
      w = P0[k]
      b = np.asarray(state.mu[k]) + g[k]
      tall = w.shape[-2] > w.shape[-1]
      u, _, vt = np.linalg.svd(b if tall else np.swapaxes(b, -1, -2), full_matrices=False)
      r = dion_rank(w.shape, rank_fraction)
      qs[k] = jnp.asarray(np.swapaxes(vt[..., :r, :], -1, -2))
      polar = u[..., :r] @ vt[..., :r, :]
      want[k] = polar if tall else np.swapaxes(polar, -1, -2)
    upd, new = step({k: jnp.asarray(v) for k, v in g.items()}, state._replace(q=qs))
    for k in SHAPES:
      np.testing.assert_allclose(upd[k], want[k], rtol=0, atol=1e-12, err_msg=k)
      np.testing.assert_allclose(new.q[k], qs[k], rtol=0, atol=1e-12, err_msg=k)  # a fixed point


SPECS = {"w_up": P("fsdp", "tensor"), "w_down": P("tensor", "fsdp"), "wq": P(None, "fsdp", "tensor"),
         "wo": P("tensor", "fsdp"), "ln": P(None)}
SHARDED = {"w_up": ((16, 64), jnp.float32), "w_down": ((64, 16), jnp.float32), "wq": ((2, 16, 16), jnp.float32),
           "wo": ((16, 16), jnp.bfloat16), "ln": ((16,), jnp.float32)}


def run_sharding_case(tx, params, grads, mesh=None, hlo=False):
  """3 jitted steps: (last update, params, Q's initial value, the compiled step if `hlo`); state kinds asserted
  stable."""
  if mesh is None:
    state = tx.init(params)
  else:  # drawn inside jit straight into its shards: Q by `right_factor_spec`, the rest like the parameters
    o_sh = state_shardings(tx, jax.eval_shape(lambda: params), jax.tree.map(lambda x: x.sharding, params), mesh)
    state = jax.jit(tx.init, out_shardings=o_sh)(params)
  q0 = dion_state(state).q
  u, params, state = run_steps(tx, params, grads, state)
  return u, params, q0, jax.jit(tx.update).lower(grads[0], state, params).compile() if hlo else None


SHARDED_PARAMS = {k: jnp.asarray(RNG.standard_normal(s), d) for k, (s, d) in SHARDED.items()}
SHARDED_GRADS = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)).astype(p.dtype), SHARDED_PARAMS) for k in range(3)]


@functools.cache
def unsharded_reference():
  return run_sharding_case(dion(1e-2, rank_fraction=1.0), SHARDED_PARAMS, SHARDED_GRADS)


@pytest.mark.parametrize("distributed", [False, True], ids=["householder", "cholesky_qr2"])
def test_sharded_updates_equal_unsharded_and_keep_shardings(distributed):
  """3 steps of `dion` on 8 devices (fsdp=4, tensor=2, Explicit axes; w_up, w_down wide/tall with both sides split,
  a stack, a bf16 matrix, a vector for AdamW) equal the 1-device Householder run; updates and state keep their
  shardings and dtypes; the distributed step's only collectives are all-reduces (no matrix is gathered), and Q,
  drawn inside jit straight into its shards, starts equal to the 1-device draw. fp32 differences measured
  ≤ 4.2e-7 (weights |w| < 4; a few ulps), 1e-6 allowed; the bf16 matrix measured equal, 2e-2 allowed (one bf16
  rounding of |w| < 4: spacing 2⁻⁶)."""
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=True)
  put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in t.items()}
  _, p_ref, q_ref, _ = unsharded_reference()
  with jax.set_mesh(mesh):
    u, p_sh, q_sh, compiled = run_sharding_case(dion(1e-2, rank_fraction=1.0, distributed=distributed),
                                                put(SHARDED_PARAMS), [put(g) for g in SHARDED_GRADS], mesh,
                                                hlo=distributed)
  for k, spec in SPECS.items():
    assert u[k].sharding.spec == spec and p_sh[k].sharding.spec == spec and u[k].dtype == SHARDED[k][1], k
  for k in q_ref:
    if not isinstance(q_ref[k], optax.MaskedNode):
      np.testing.assert_array_equal(q_sh[k], q_ref[k])
      assert q_sh[k].sharding.spec == right_factor_spec(SPECS[k], SHARDED[k][0])
  for k, (_, dtype) in SHARDED.items():
    atol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(p_sh[k], np.float32), np.asarray(p_ref[k], np.float32), atol=atol, err_msg=k)
  if distributed:
    assert set(sharding.collectives(compiled).summary()) == {"all-reduce"}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("distributed", [False, True], ids=["householder", "cholesky_qr2"])
def test_no_batched_lapack_call_or_collective_in_a_loop(distributed, explicit):
  """The train CLI hung at its first step with Dion on data=2,fsdp=4 (tiny preset): every device ran the batched QR
  of a layer stack, and jaxlib 0.10's LAPACK kernel split it over XLA:CPU's thread pool and blocked on it, on every
  pool thread at once (optim/linalg.py). Compiled only (a hang cannot fail a test, it stops the suite): on the CLI's
  mesh, stacks with either side split over fsdp, each QR / Cholesky / triangular solve takes one matrix, and no
  collective sits in a loop (the map over the stack gathers before it)."""
  params = {"w_up": jnp.ones((2, 16, 8)), "w_down": jnp.ones((3, 8, 16)), "wo": jnp.ones((16, 8)), "ln": jnp.ones(8)}
  specs = {"w_up": P(None, "fsdp", None), "w_down": P(None, None, "fsdp"), "wo": P("fsdp", None), "ln": P(None)}
  compiled = compile_update(dion(1e-2, rank_fraction=0.5, distributed=distributed), params, specs, explicit=explicit)
  assert_no_hang_patterns(compiled)


@pytest.mark.parametrize("distributed", [False, True], ids=["householder", "cholesky_qr2"])
def test_zero_and_rank_deficient_gradients(distributed):
  """Zero gradients: PᵀP = 0 is replaced by I before Cholesky, P = 0, the update is 0 and Q is kept (so the next
  nonzero gradient acts as on a fresh state). A rank-1 gradient at full rank: the first, small Cholesky shift
  fails on its singular Gram (asserted below) and the √u shift takes over; everything stays finite."""
  tx = scale_by_dion(0.95, rank_fraction=1.0, distributed=distributed)
  params = {"b": jnp.ones((2, 5, 9))}
  state = fresh = tx.init(params)
  step = jax.jit(tx.update)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for _ in range(3):
    u, state = step(zeros, state)
    assert all(bool((x == 0).all()) for x in jax.tree.leaves(u))
  jax.tree.map(np.testing.assert_array_equal, state.q, fresh.q)
  g = {k: jnp.asarray(RNG.standard_normal(x.shape), jnp.float32) for k, x in params.items()}
  jax.tree.map(np.testing.assert_array_equal, step(g, state)[0], step(g, fresh)[0])
  rank1 = {k: jnp.asarray(RNG.standard_normal(x.shape[:-1] + (1,)) * RNG.standard_normal(x.shape[-1:]), jnp.float32)
           for k, x in params.items()}
  for _ in range(2):
    u, state = step(rank1, state)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves((u, state)))


def test_cholesky_qr2_survives_a_singular_gram():
  """A rank-1 P (its Gram singular, and indefinite after rounding on some CPUs) still gives a finite orthonormal Q."""
  v, c = RNG.standard_normal((40, 1)), RNG.standard_normal((1, 8))
  p = jnp.asarray(v @ c, jnp.float32)  # rank 1
  q, zero = _cholesky_qr2(p, None)
  assert bool(jnp.isfinite(q).all()) and not bool(zero.any())
  np.testing.assert_allclose(q[:, 0], np.sign(c[0, 0]) * v[:, 0] / np.linalg.norm(v), atol=1e-6)


def test_an_indefinite_gram_falls_back_to_the_larger_shift():
  """A Gram whose rounding left an eigenvalue below -u·t/r (here -1e-6 against u·t/r ≈ 3e-8) fails the small shift
  for certain; the factor is then L⁻¹ of g + √u·t·I, finite (whether a rank-1 Gram rounds that way depends on the
  CPU, so the fallback is tested on a Gram built indefinite)."""
  r = 4
  g = jnp.diag(jnp.asarray([1.0, 0.5, 0.25, -1e-6], jnp.float32))
  t = jnp.trace(g)[None, None]
  u = float(jnp.finfo(jnp.float32).eps)
  assert not bool(jnp.isfinite(jnp.linalg.cholesky(g + u * t / r * jnp.eye(r))).all())  # certain: -1e-6 + 3e-8 < 0
  got = np.asarray(_inverse_cholesky_factor(g, t), np.float64)
  want = np.linalg.inv(np.linalg.cholesky(np.asarray(g, np.float64) + np.sqrt(u) * float(t[0, 0]) * np.eye(r)))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_inject_hyperparams():
  """beta, eps, weight_decay, the lr and seed are injectable: two steps with beta changed in the state equal the
  direct factory at that beta (and differ from the default beta), the seed draws Q; rank_fraction is static
  (registry.STATIC_ARGS) and a traced one is refused with the fix."""
  params = {"w": jnp.asarray(P0["wide"], jnp.float32), "ln": jnp.ones(5)}
  grads = [{"w": jnp.asarray(g["wide"], jnp.float32), "ln": jnp.ones(5)} for g in GRADS[:2]]

  def two_steps(tx, step, beta=None):
    state, p = tx.init(params), params
    if beta is not None:
      state.hyperparams["beta"] = jnp.asarray(beta)
    for g in grads:
      u, state = step(g, state, p)
      p = optax.apply_updates(p, u)
    return p["w"]

  tx = optax.inject_hyperparams(dion, static_args=("rank_fraction",))(learning_rate=1e-2, rank_fraction=0.5, seed=3)
  step = jax.jit(tx.update)
  got = two_steps(tx, step, beta=0.5)
  direct = dion(1e-2, rank_fraction=0.5, beta=0.5, seed=3)
  np.testing.assert_allclose(got, two_steps(direct, jax.jit(direct.update)), rtol=0, atol=1e-7)
  assert float(jnp.abs(got - two_steps(tx, step)).max()) > 1e-5  # the default beta 0.95: another trajectory
  q = lambda tx: dion_state(tx.init(params)).q["w"]
  np.testing.assert_array_equal(q(tx), q(direct))
  assert not np.array_equal(q(tx), q(dion(1e-2, rank_fraction=0.5)))  # seed 0
  with pytest.raises(TypeError, match="rank_fraction fixes the shape of Q"):
    lazy = optax.inject_hyperparams(dion)(learning_rate=1e-2, rank_fraction=0.5)
    jax.jit(lazy.init)(params)
  for bad in (0.0, 1.5):
    with pytest.raises(DionError, match="rank_fraction must lie in"):
      dion(1e-2, rank_fraction=bad)
    with pytest.raises(optim.UnknownOptimizerError, match=r"rank_fraction=.* must lie in \(0, 1\]"):
      optim.get_optimizer("dion", 1e-2, rank_fraction=bad)  # the registry's schema, before the factory


def test_fewer_bytes_than_distributed_muon_at_rank_quarter():
  """One compiled step on fsdp=4,tensor=2 (research/bench/dion.py's tree at D=32, F=128, 4 layers): Dion
  distributed at rank 0.25 sends fewer bytes per device than distributed Muon (measured 0.46x), and exactly the
  all-reduces its model predicts (P, PᵀP twice, R, R's column norms: `dion_expected_bytes`). The margin is Muon's
  resharding on this mesh (all-gathers, permutes beside its all-to-alls): against the all-to-alls alone Dion sends
  1.02x; on fsdp=8 it sends 1.73x Muon (ratio ≈ 8r/S; research/results/bench_dion_comm.md)."""
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  size = dict(d=32, f=128, layers=4)
  muon = step_bytes(optim.muon(1e-3, distributed=True, weight_decay=0.0), mesh, **size).wire_bytes(True)
  dion_audit = step_bytes(dion(1e-3, rank_fraction=0.25, distributed=True, weight_decay=0.0), mesh, **size)
  assert set(dion_audit.summary()) == {"all-reduce"}
  got = dion_audit.wire_bytes(True)
  assert got == pytest.approx(dion_expected_bytes(mesh, rank_fraction=0.25, **size), rel=1e-6)
  assert got / muon < 1, (got, muon)
