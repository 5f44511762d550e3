"""PSGD-Kron against pytorch_optimizer 4.1.0 `Kron` (pytorch_optimizer/optimizer/psgd.py, with
optimizer/utils/psgd.py's norm_lower_bound), float64, 8 steps, and the optax contract.

Matching the oracle's randomness: it draws V with `torch.randn_like` (one per parameter, in order, on update steps)
and the balance coin with `np.random.random()` (once per step). The tests replace both, for the oracle only, by
the numbers our step draws (`kron_draws(key, t, ...)`: the coin's uniform u_t and V per leaf, torch getting Vᵀ for
our transposed layout), so both sides use the same numbers; balance_prob 0 or 1 makes the coin moot, 0.5 uses it.
The oracle's triangular solve always runs in float32 (`solve_triangular_right`); it is replaced by the same
torch solve in the input's dtype, so that float64 compares the algorithm, not that rounding (~1e-7).

Layouts: torch weights are (out, in), ours (in, out): torch gets our transposes. A stack (E, m, n) is E separate
(m, n) parameters for torch (our per-matrix factors; the oracle would give a 3-D tensor one factor per axis).
"""

import functools
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from pytorch_optimizer.optimizer import psgd as po_psgd
from sharded_steps import assert_no_hang_patterns, compile_update, sharded_and_single

from optim import KronError, kron, kron_draws, precond_update_prob_schedule, scale_by_kron
from optim.registry import STATIC_ARGS

STATIC = tuple(a for a in STATIC_ARGS if a in inspect.signature(kron).parameters)  # max_size_triangular

RNG = np.random.default_rng(0)
# max_size_triangular = 10: "wide" (4, 12) gets a diagonal factor for its 12; "bias" a diagonal one (a vector);
# "stack" is two square (5, 5) matrices (memory_save_mode's tie).
SHAPES = {"bias": (7,), "stack": (2, 5, 5), "tall": (8, 5), "wide": (4, 12)}
MAX_TRI, SEED, STEPS = 10, 3, 8
P0 = {k: RNG.standard_normal(s) for k, s in SHAPES.items()}
GRADS = [{k: c * RNG.standard_normal(s) for k, s in SHAPES.items()} for c in (1.0, 0.3, 2.0, 0.5, 1.0, 0.1, 0.7, 1.5)]


def to_torch(t):
  """Torch's parameter list: matrices transposed to (out, in), each matrix of a stack on its own."""
  out = []
  for k in SHAPES:
    a = np.asarray(t[k])
    out += [m.T for m in a] if a.ndim == 3 else [a.T if a.ndim == 2 else a]
  return [torch.tensor(np.ascontiguousarray(x)) for x in out]


def from_torch(ts):
  a, out = [x.detach().numpy().copy() for x in ts], {}
  for k, s in SHAPES.items():
    n = s[0] if len(s) == 3 else 1
    out[k] = np.stack([m.T for m in a[:n]]) if len(s) == 3 else (a[0].T if len(s) == 2 else a[0])
    a = a[n:]
  return out


def solve_in_input_dtype(x, a):  # X·A⁻¹ for upper-triangular A, as the oracle's helper but without its float32 cast
  return torch.linalg.solve_triangular(a, x.reshape(-1, x.size(-1)), upper=True, left=False).reshape_as(x)


@functools.cache
def draws(step):
  with jax.enable_x64(True):
    like = [jnp.zeros(SHAPES[k], jnp.float64) for k in sorted(SHAPES)]
    u, vs = jax.jit(kron_draws)(jax.random.PRNGKey(SEED), step, like)
    return float(u), dict(zip(sorted(SHAPES), map(np.asarray, vs)))


def run_oracle(monkeypatch, *, lr, b1, wd, prob, balance_prob, precond_lr, init_scale=1.0, mode=None, fit_on_mu=True):
  step = {"t": 0}
  queue = []

  def randn_like(x, dtype=None, **_):
    v = queue.pop(0)
    assert v.shape == x.shape and dtype == torch.float64
    return v

  monkeypatch.setattr(po_psgd.torch, "randn_like", randn_like)
  monkeypatch.setattr(po_psgd.np.random, "random", lambda: draws(step["t"])[0])
  monkeypatch.setattr(po_psgd, "solve_triangular_right", solve_in_input_dtype)
  params = to_torch(P0)
  opt = po_psgd.Kron(params, lr=lr, momentum=b1, weight_decay=wd, pre_conditioner_update_probability=prob,
                     max_size_triangular=MAX_TRI, memory_save_mode=mode, momentum_into_precondition_update=fit_on_mu,
                     precondition_dtype=torch.float64, balance_prob=balance_prob)
  opt.param_groups[0].update(precondition_lr=precond_lr, precondition_init_scale=init_scale)
  out, updated = [], []
  for t, g in enumerate(GRADS):
    step["t"] = t
    queue[:] = to_torch(draws(t)[1])
    for p, gi in zip(params, to_torch(g)):
      p.grad = gi
    opt.step()
    updated.append(not queue)  # the oracle took every V: it updated its preconditioner
    out.append(from_torch(params))
  return out, updated


STRUCTURE = dict(max_size_triangular=MAX_TRI, precond_dtype="float64", preconditioner_update_probability=1.0)


@functools.cache
def injected(mode, fit_on_mu):
  """One compiled program per structure: every numeric hyperparameter is injected (state), as in test_mars."""
  tx = optax.inject_hyperparams(kron, static_args=STATIC)(
      learning_rate=0.0, memory_save_mode=mode, momentum_into_precond_update=fit_on_mu, **STRUCTURE)
  return jax.jit(tx.update)


def run_ours(*, mode=None, fit_on_mu=True, prob=1.0, grads=GRADS, **hp):
  """8 steps in float64 of the compiled `injected` update; the state from `hp` (the init-time ones too: seed,
  precond_init_scale); `prob` a number or a function of the step count, set into the state each step."""
  step = injected(mode, fit_on_mu)
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, P0)
    tx = optax.inject_hyperparams(kron, static_args=STATIC)(
        **{"seed": SEED, **hp}, memory_save_mode=mode, momentum_into_precond_update=fit_on_mu, **STRUCTURE)
    state = tx.init(params)
    kinds = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    out, counters = [], []
    for t, g in enumerate(grads):
      p = prob(t) if callable(prob) else prob
      state.hyperparams["preconditioner_update_probability"] = jnp.asarray(p, jnp.float64)
      u, state = step(jax.tree.map(jnp.asarray, g), state, params)
      params = optax.apply_updates(params, u)
      assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == kinds
      out.append(jax.tree.map(np.asarray, params))
      counters.append(int(state.inner_state[0].update_counter))
  return out, [c == 0 for c in counters], state


CASES = {  # name: (oracle's probability, ours, other settings)
    "every_step_always_balanced": (1.0, 1.0, dict(lr=0.05, b1=0.9, wd=0.1, balance_prob=1.0, precond_lr=0.1)),
    "counter_p0.4_never_balanced": (0.4, 0.4, dict(lr=0.02, b1=0.8, wd=0.0, balance_prob=0.0, precond_lr=0.3,
                                                   init_scale=2.0)),
    "default_schedule_coin": (None, precond_update_prob_schedule(), dict(lr=0.05, b1=0.9, wd=0.1, balance_prob=0.5,
                                                                         precond_lr=0.1)),
    "one_diag_fit_on_gradient": (1.0, 1.0, dict(lr=0.05, b1=0.9, wd=0.1, balance_prob=1.0, precond_lr=0.1,
                                                mode="one_diag", fit_on_mu=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_pytorch_optimizer_kron(monkeypatch, case):
  """8 steps, tolerance 1e-13 absolute on O(1) weights (measured ≤ 5.6e-16: the same operations up to the order of
  a few sums). The default schedule (None) is 1 for these steps; p = 0.4 updates at steps 3 and 6 (c ≥ 2.5)."""
  torch_prob, our_prob, hp = CASES[case]
  want, oracle_updated = run_oracle(monkeypatch, prob=torch_prob, **hp)
  ours = dict(learning_rate=hp["lr"], b1=hp["b1"], weight_decay=hp["wd"], balance_prob=hp["balance_prob"],
              precond_lr=hp["precond_lr"], precond_init_scale=hp.get("init_scale", 1.0))
  got, updated, _ = run_ours(mode=hp.get("mode"), fit_on_mu=hp.get("fit_on_mu", True), prob=our_prob, **ours)
  assert updated == oracle_updated
  assert sum(updated) == (2 if torch_prob == 0.4 else STEPS)
  if case == "default_schedule_coin":  # the coin came up both ways
    assert {draws(t)[0] < 0.5 for t in range(STEPS)} == {True, False}
  for t in range(STEPS):
    for k in SHAPES:
      np.testing.assert_allclose(got[t][k], want[t][k], rtol=0, atol=1e-13, err_msg=f"step {t + 1} {k}")
  assert max(float(np.abs(got[-1][k] - P0[k]).max()) for k in SHAPES) > 0.05  # the weights did move


def test_a_stack_is_its_matrices_as_separate_leaves(monkeypatch):
  """A (2, 6, 4) stack equals two (6, 4) leaves: per-matrix factors, RMS cap and balance. One run holds both forms
  ("a" the stack, "b0", "b1" its matrices, fed the same gradients) and gives "b0", "b1" the stack's V; that V is
  what they would draw in the stack's place is checked on `kron_draws` itself. Float64: measured bitwise equal
  (1e-14 allows a batched and an unbatched matmul to round differently)."""
  key = jax.random.PRNGKey(SEED)
  _, (v_stack,) = kron_draws(key, 5, [jnp.zeros((2, 6, 4))])
  _, v_split = kron_draws(key, 5, [jnp.zeros((6, 4)), jnp.zeros((6, 4))])
  np.testing.assert_array_equal(v_stack, np.stack(v_split))
  draw = kron_draws

  def stack_noise_for_the_matrices(key, count, like):
    u, vs = draw(key, count, like)
    return u, [vs[0], vs[0][0], vs[0][1]]

  monkeypatch.setattr(sys.modules["optim.kron"], "kron_draws", stack_noise_for_the_matrices)
  stack = RNG.standard_normal((2, 6, 4))
  grads = [RNG.standard_normal((2, 6, 4)) for _ in range(4)]
  both = lambda x: {"a": x, "b0": x[0], "b1": x[1]}
  tx = kron(0.05, preconditioner_update_probability=1.0, balance_prob=1.0, weight_decay=0.1, precond_dtype="float64")
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, both(stack))
    state, step = tx.init(params), jax.jit(tx.update)
    for g in grads:
      u, state = step(jax.tree.map(jnp.asarray, both(g)), state, params)
      params = optax.apply_updates(params, u)
    params, q_l, q_r = jax.tree.map(np.asarray, (params, state[0].q_l, state[0].q_r))
  np.testing.assert_allclose(params["a"], np.stack([params["b0"], params["b1"]]), rtol=0, atol=1e-14)
  assert float(np.abs(params["a"] - stack).max()) > 0.05
  assert q_l["a"].shape == (2, 6, 6) and q_l["b0"].shape == (6, 6)
  np.testing.assert_allclose(q_r["a"][1], q_r["b1"], rtol=0, atol=1e-14)
  assert float(np.abs(q_r["b1"] - np.eye(4)).max()) > 1e-3  # fitted


def test_factor_shapes():
  params = {"big": jnp.ones((3, 16)), "bias": jnp.ones((7,)), "scalar": jnp.ones(()), "stack": jnp.ones((2, 5, 6, 4)),
            "sq": jnp.ones((5, 5)), "row": jnp.ones((1, 5))}
  def shapes(**kw):
    state = jax.eval_shape(scale_by_kron(max_size_triangular=10, **kw).init, params)
    return [(l.shape, r.shape) if r.shape != (0,) else (l.shape,) for l, r in zip(jax.tree.leaves(state.q_l),
                                                                                jax.tree.leaves(state.q_r))]
  # tree order: bias, big, row, scalar, sq, stack
  assert shapes() == [((7,),), ((3, 3), (16,)), ((1,), (5, 5)), ((1,),), ((5, 5), (5, 5)), ((2, 5, 6, 6), (2, 5, 4, 4))]
  assert shapes(memory_save_mode="one_diag")[4:] == [((5,), (5, 5)), ((2, 5, 6), (2, 5, 4, 4))]
  assert shapes(memory_save_mode="smart_one_diag")[4:] == [((5, 5), (5, 5)), ((2, 5, 6), (2, 5, 4, 4))]
  assert shapes(memory_save_mode="all_diag")[1] == ((3,), (16,))
  with pytest.raises(KronError, match="memory_save_mode must be one of"):
    kron(1e-3, memory_save_mode="some_diag")


# --- the update-probability schedule and the balance coin


def test_schedule_is_the_oracles_formula():
  n = np.arange(6000)
  ours = np.asarray(jax.jit(precond_update_prob_schedule())(n))
  theirs = np.asarray([float(po_psgd.precondition_update_prob_schedule()(int(i))) for i in n])
  np.testing.assert_allclose(ours, theirs, rtol=2e-7, atol=0)  # both float32 exp: ≤ 1 ulp
  np.testing.assert_allclose(ours, np.clip(np.exp(-0.001 * (n - 500.0)), 0.03, 1.0), rtol=1e-6)
  assert (ours[:501] == 1).all() and (ours[4008:] == np.float32(0.03)).all() and ours[4006] > 0.03


def test_update_counter_matches_the_oracle_over_4200_steps():
  """Which steps update the preconditioner: the oracle's counter (c ← c + 1; update and c ← 0 when c ≥ 1/p(step)),
  ours from `update_counter` in a 4200-step scan, equal step for step through the flat start, the anneal and
  the 0.03 floor. The oracle runs with no gradient, which runs exactly this logic and skips the parameters."""
  p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
  opt = po_psgd.Kron([p], lr=0.0)
  theirs = []
  for _ in range(4200):
    opt.step()
    theirs.append(opt.param_groups[0]["update_counter"] == 0)
  ours = counter_flags(None, 4200)
  assert ours.tolist() == theirs
  assert ours[:501].all() and not ours[501] and ours[502]  # p < 1 from step 501 (1/p = 1.001): 2 steps
  assert set(np.diff(np.flatnonzero(ours[4008:]))) == {34}  # the floor p = 0.03: every ⌈1/0.03⌉ = 34 steps


@functools.partial(jax.jit, static_argnums=(1,))
def _scan_flags(prob, steps):
  """Whether each step updated the preconditioner (its counter reset), on a (1,) parameter; `prob` None: the
  default schedule, else a traced number (one program for every constant)."""
  tx = scale_by_kron(preconditioner_update_probability=prob)

  def body(state, _):
    _, state = tx.update(jnp.ones((1,)), state)
    return state, state.update_counter == 0
  return jax.lax.scan(body, tx.init(jnp.zeros((1,))), length=steps)[1]


def counter_flags(prob, steps):
  return np.asarray(_scan_flags(None if prob is None else jnp.float32(prob), steps))


@pytest.mark.parametrize("prob", [1.0, 0.5, 0.3, 0.1, 0.03, 0.0])
def test_constant_probability_updates_every_ceil_1_over_p_steps(prob):
  """The oracle's counter is deterministic: with a constant p it updates exactly every ⌈1/p⌉ steps, a rate
  1/⌈1/p⌉ ∈ (p/(1+p), p] (0.25 for p = 0.3): over N steps exactly ⌊N/⌈1/p⌉⌋ updates, at those steps."""
  flags = counter_flags(prob, 3000)
  if prob == 0.0:
    assert not flags.any()
    return
  period = int(np.ceil(1 / np.float32(prob)))
  assert np.flatnonzero(flags).tolist() == list(range(period - 1, 3000, period))
  assert prob / (1 + prob) < flags.mean() <= prob


@pytest.mark.parametrize("balance_prob", [0.01, 0.3])
def test_balance_coin_frequency(balance_prob):
  """The balance coin u_t < balance_prob over 20,000 steps: the count is Binomial(N, p) if u_t are independent
  uniforms; asserted within 5 standard deviations (a false alarm has probability < 6e-7), and the coins of
  consecutive steps uncorrelated within 5/√N."""
  n = 20_000
  u = np.asarray(jax.jit(jax.vmap(lambda t: kron_draws(jax.random.PRNGKey(SEED), t, [])[0]))(jnp.arange(n)))
  hits = u < balance_prob
  sd = np.sqrt(n * balance_prob * (1 - balance_prob))
  assert abs(hits.sum() - n * balance_prob) < 5 * sd
  assert abs(np.corrcoef(hits[:-1], hits[1:])[0, 1]) < 5 / np.sqrt(n)


# --- the optax contract


def test_deterministic_for_a_seed_and_different_for_another():
  a, _, sa = run_ours(learning_rate=0.05, balance_prob=0.5)
  b, _, sb = run_ours(learning_rate=0.05, balance_prob=0.5)
  c, _, _ = run_ours(learning_rate=0.05, balance_prob=0.5, seed=SEED + 1)
  jax.tree.map(np.testing.assert_array_equal, (a, jax.tree.map(np.asarray, sa)), (b, jax.tree.map(np.asarray, sb)))
  assert float(np.abs(a[-1]["tall"] - c[-1]["tall"]).max()) > 1e-6  # V differs, so do the factors and the steps


def test_finite_on_zero_gradients():
  zeros = [jax.tree.map(np.zeros_like, P0)] * 3
  out, updated, state = run_ours(grads=zeros, learning_rate=0.05, weight_decay=0.0, balance_prob=1.0)
  jax.tree.map(np.testing.assert_array_equal, out[-1], P0)  # zero direction, no decay: unchanged
  assert all(updated) and all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state))


def test_injected_hyperparameters_take_effect():
  """Every numeric hyperparameter is state under optax.inject_hyperparams (the registry-wide suite checks that the
  injected optimizer equals the plain one): the oracle cases run so; here precond_lr = 0 keeps the factors at
  their initial values and p = 0 never updates them, while precond_lr 0.1 moves them."""
  with jax.enable_x64(True):
    initial = kron(0.0, **STRUCTURE).init(jax.tree.map(jnp.asarray, P0))[0]._asdict()
  for hp in (dict(precond_lr=0.0), dict(prob=0.0)):
    _, updated, state = run_ours(grads=GRADS[:2], learning_rate=0.05, **hp)
    assert updated == ([True, True] if "precond_lr" in hp else [False, False])
    for side in ("q_l", "q_r"):
      jax.tree.map(np.testing.assert_array_equal, getattr(state.inner_state[0], side), initial[side])
  _, _, state = run_ours(grads=GRADS[:2], learning_rate=0.05)
  assert float(np.abs(np.asarray(state.inner_state[0].q_l["tall"]) - np.eye(8)).max()) > 1e-3


def test_an_injected_max_size_triangular_is_refused_naming_static_args():
  """It fixes the factors' shapes: injected (an array, traced in update) it is refused in one line that names the
  fix, as Dion's rank_fraction and SOAP's max_precondition_dim are; listed in static_args it works."""
  params = jax.tree.map(jnp.asarray, P0)
  with pytest.raises(KronError, match=r"static_args=\('max_size_triangular',\)") as e:
    optax.inject_hyperparams(kron)(learning_rate=0.1, max_size_triangular=4).init(params)
  assert "\n" not in str(e.value)
  tx = optax.inject_hyperparams(kron, static_args=("max_size_triangular",))(learning_rate=0.1, max_size_triangular=4)
  jax.jit(tx.update)(params, tx.init(params), params)  # traced hyperparameters elsewhere, a static size: fine


SPECS = {"w": P(None, "fsdp", "tensor"), "bias": P("tensor")}
SHARDED_SHAPES = {"w": (2, 8, 16), "bias": (8,)}


def test_sharded_updates_equal_unsharded_and_keep_shardings():
  """3 steps on 8 devices (fsdp=4, tensor=2, Explicit axes) equal 1 device: every device fits and applies whole
  preconditioners (replicated factors); updates and momentum keep the parameters' shardings, the state its
  shardings and dtypes. max_size_triangular 12: w's 16-wide axis gets a diagonal factor."""
  tx = kron(1e-2, preconditioner_update_probability=1.0, balance_prob=1.0, max_size_triangular=12,
            weight_decay=0.1)
  params = {k: jnp.asarray(RNG.standard_normal(s), jnp.float32) for k, s in SHARDED_SHAPES.items()}
  (u, p_sharded, state), p_ref = sharded_and_single(tx, params, SPECS, steps=3)
  for k, spec in SPECS.items():
    assert u[k].sharding.spec == spec and u[k].dtype == jnp.float32
    assert state[0].mu[k].sharding.spec == spec
    np.testing.assert_allclose(p_sharded[k], p_ref[k], rtol=0, atol=1e-6, err_msg=k)


def test_no_batched_lapack_call_or_collective_in_a_loop():
  """The train CLI hung at its first step with Kron on data=2,fsdp=2,tensor=2 (tiny preset): the batched triangular
  solves of a layer stack's fit blocked every thread of XLA:CPU's pool (optim/linalg.py). Compiled only, on the CLI's
  kind of mesh (Auto axes), stacks split over fsdp: each triangular solve takes one matrix, and no collective sits
  in a loop."""
  params = {"w_up": jnp.ones((2, 16, 8)), "w_down": jnp.ones((3, 8, 16)), "bias": jnp.ones(8)}
  specs = {"w_up": P(None, "fsdp", None), "w_down": P(None, None, "fsdp"), "bias": P(None)}
  assert_no_hang_patterns(compile_update(kron(1e-2), params, specs))
