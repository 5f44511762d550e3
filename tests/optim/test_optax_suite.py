"""optax's own test cases, ported to pytest and run over EVERY optimizer in `optim.OPTIMIZERS`.

Researchers drop these optimizers into code written for optax, so optax's tests are the contract. Ported from
optax's public repository: `optax/_src/alias_test.py` (convergence on a parabola and Rosenbrock in float32 and
complex64 with no recompilation, extra update arguments, inject_hyperparams, explicit and preserved dtypes,
state shape/dtype stability under lax.cond, MultiSteps accumulation) and `optax/contrib/_common_test.py` (four
problems by lax.scan, tree_map_params, learning-rate schedules). Their logic and tolerances are unchanged; where
optax runs a subtest inside a test, it is its own test here. The Muon-specific cases are in test_optax_muon.py.

Settings: optax's own case for the optimizers optax also has (its kwargs plus optax's defaults, so the math is
the same); for the rest, the house defaults with the learning rate of optax's case for the base optimizer and
optax's default weight decay (1e-4). `EXPECTED` lists the documented deviations (also in the README): each is a
clear error, asserted, never a silent skip.
"""

import inspect
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax._src import test_utils

from optim import OPTIMIZERS, BAdamError, get_optimizer
from optim.registry import STATIC_ARGS
from optim.trees import ParameterTreeError

SETTINGS = {
    # optax alias_test's cases, with optax's defaults written out where ours differ
    "adamw": dict(learning_rate=1e-1, b2=0.999, weight_decay=1e-4),
    "sgd": dict(learning_rate=1e-3, momentum=0.9, nesterov=False),
    "lion": dict(learning_rate=1e-2, weight_decay=1e-4),
    # optax contrib's muon case (lr 1e-2) with optax.contrib.muon's defaults where optlab has them: no decay, eps
    # 1e-8, the √max(1, fan_out/fan_in) scale, Adam β2 0.999 for the non-matrix leaves. Not exactly optax's math:
    # optax's Nesterov step uses the bias-corrected momentum and its Adam branch is Nesterov too (identical first
    # Muon step, ~5% apart later on matrices; README, Muon); optlab has no such option
    "muon": dict(learning_rate=1e-2, weight_decay=0.0, eps=1e-8, scale="keller", adam_b2=0.999,
                 adam_weight_decay=0.0),
    # no optax counterpart: house defaults, the lr of optax's case for the base, optax's default decay 1e-4
    # MGUP-AdamW: half the lr of optax's adamw case. Its boosted coordinate steps α = 2 times AdamW's, so at lr 1e-1
    # it ends oscillating at 0.5-1.05 of the 3e-2 tolerance (Rosenbrock, 10k steps; which one depends on XLA:CPU's
    # code generation, ulps that the valley amplifies); at 5e-2 at 0.08-0.19, at 1e-2 at 0.01-0.04
    "mgup_adamw": dict(learning_rate=5e-2, weight_decay=1e-4),
    "cautious_adamw": dict(learning_rate=1e-1, weight_decay=1e-4),
    "mgup_lion": dict(learning_rate=1e-2, weight_decay=1e-4),
    "cautious_lion": dict(learning_rate=1e-2, weight_decay=1e-4),
    "mgup_muon": dict(learning_rate=1e-2, weight_decay=1e-4),
    "cautious_muon": dict(learning_rate=1e-2, weight_decay=1e-4),
    "muon_mvr": dict(learning_rate=1e-2, weight_decay=1e-4),
    # Dion: microsoft/dion's lr 0.01 (= optax's muon case), full rank (its default), optax's default decay
    "dion": dict(learning_rate=1e-2, weight_decay=1e-4),
    # MARS on every leaf (optimize_1d), so these vector problems test MARS itself, not its AdamW fallback
    "mars": dict(learning_rate=1e-1, weight_decay=1e-4, optimize_1d=True),
    # BAdam restarts Adam at every block switch; a restart's first step is lr·sign(g), so lr 1e-2 keeps it
    # inside optax's 3e-2 tolerance (any lr ≥ 3e-2 cannot pass at an unlucky final step)
    "badam": dict(learning_rate=1e-2, b2=0.999, weight_decay=1e-4),
    "bread": dict(learning_rate=1e-2, b2=0.999, weight_decay=1e-4),
    # Scion's unconstrained mode (uSCG) with no decay: the constrained one (Frank–Wolfe, W ← (1−lr)W − lr·ρ·lmo)
    # stays in the radius-ρ ball and cannot reach a minimum outside it (these problems' lie outside radius 1);
    # radius 1 for matrices as for vectors; momentum 0.5, the Scion README's value for low-noise runs (these are
    # noiseless). Every step has norm lr·ρ, so the iterate ends oscillating at ~lr: at lr 5e-3 the worst final
    # error is 0.21 of optax's 3e-2 tolerance (Rosenbrock complex64), at lr 1e-2 0.84 (2.5 with momentum 0.1)
    "scion": dict(learning_rate=5e-3, momentum=0.5, constrained=False, hidden_scale=1.0),
    # NorMuon / AdaMuon: house defaults (the paper's RMS-0.2 update, Nesterov; AdaMuon with sign) as the other
    # Muon variants, the lr of optax's muon case, optax's default decay 1e-4
    "normuon": dict(learning_rate=1e-2, weight_decay=1e-4),
    "adamuon": dict(learning_rate=1e-2, weight_decay=1e-4),
    # SOAP: house defaults (the oracle's betas (0.95, 0.95), frequency 10), the lr of optax's case for its base
    # (Adam), optax's default decay. Worst final error 3e-3 of the 3e-2 tolerance at lr 1e-1 (2e-4 at lr 1e-2)
    "soap": dict(learning_rate=1e-1, weight_decay=1e-4),
    # Kron: the oracle's defaults (b1 0.9, its update-probability schedule), optax's default decay. Its steps have
    # RMS ≤ 1.1·lr and P grows as the gradient shrinks (P ≈ E[hhᵀ]^(-1/2)), so it ends oscillating at ~lr: worst
    # final error 0.08 of the 3e-2 tolerance at lr 3e-3 (Rosenbrock, 10k steps), 0.45 at 1e-2, 1.16 at 3e-2
    "kron": dict(learning_rate=3e-3, weight_decay=1e-4),
    # MuonClip: muon's case; optax's problems have no attention, so no max_logits reach it and it is Muon here
    # (its clip: tests/optim/test_muon_clip.py)
    "muonclip": dict(learning_rate=1e-2, weight_decay=0.0, eps=1e-8, scale="keller", adam_b2=0.999),
}
NAMES = sorted(OPTIMIZERS)
# Optimizers that refuse complex parameters at init (ParameterTreeError): sign- or mask-based updates have no
# complex meaning. optax skips its sign-based ones (lion, signum, ...) on complex for the same reason. The masked
# Muons refuse complex matrices only: their vectors go to plain AdamW, which takes complex numbers.
NO_COMPLEX = {"lion", "mgup_adamw", "mgup_lion", "cautious_adamw", "cautious_lion"}
# SOAP's eigenbases are real (eigh, QR of real factors); its oracle raises NoComplexParameterError the same way.
NO_COMPLEX |= {"soap"}
# Kron: its oracle (pytorch_optimizer's Kron) raises NoComplexParameterError; refused the same way.
NO_COMPLEX |= {"kron"}
# AdaMuon orthogonalizes sign(U) (sign=True, its default): complex matrices refused the same way.
# Dion: its paper and reference are real (QR, Cholesky, column norms of real matrices): complex matrices refused.
NO_COMPLEX_MATRIX = {"mgup_muon", "cautious_muon", "adamuon", "dion"}
# Documented deviations from optax's cases (README, "optax conformance"): test -> {name: reason}.
EXPECTED = {
    "optimization": {("mgup_lion", "rosenbrock", "float32"): (
        "MGUP-Lion needs more than alias_test's 10,000 steps on Rosenbrock: at (0.83, 0.68) after 10k at lr 1e-2 "
        "(inside 3e-2 by 30k, as contrib's test_optimizers checks); of 2 coordinates τ·N = 1 is boosted (α = 2) "
        "and the other damped to γ = 0.1, which slows the walk along the valley; lr 3e-3 .. 3e-2 are no better")},
    "tree_map_params": {"badam": "BAdam's state is one block's view (slices of stacked layers, shared slots), not a "
                                 "tree shaped like the params, so optax.tree.map_params cannot map it: init on the "
                                 "placeholder raises BAdamError saying so",
                        "bread": "BREAD's state is BAdam's block view plus low-rank factors, not a tree shaped like "
                                 "the params: init on the placeholder raises BAdamError, as badam's"},
}


def make(name, **override):
  return get_optimizer(name, **{**SETTINGS[name], **override})


def test_every_registered_optimizer_is_under_test():
  assert set(SETTINGS) == set(OPTIMIZERS), "a new optimizer needs its settings here (and passes the whole suite)"


def parabola(dtype):
  initial = jnp.array([-1.0, 10.0, 1.0], dtype=dtype)
  final = jnp.array([1.0, -1.0, 1.0], dtype=dtype)
  if jnp.iscomplexobj(initial):
    final = final * (1 + 1j)
  return initial, final, lambda p: jnp.sum(jnp.abs(p - final) ** 2)


def rosenbrock(dtype):
  a, b = 1.0, 100.0
  if jnp.issubdtype(jnp.dtype(dtype), jnp.complexfloating):
    a *= 1 + 1j
  initial = jnp.array([0.0, 0.0], dtype=dtype)
  final = jnp.array([a, a ** 2], dtype=dtype)
  return initial, final, lambda p: jnp.abs(a - p[0]) ** 2 + b * jnp.abs(p[1] - p[0] ** 2) ** 2


def matrix_parabola(dtype):
  final = jnp.array([[3.0, -2.0], [1.0, 4.0]], dtype=dtype)
  return jnp.zeros((2, 2), dtype), final, lambda p: jnp.sum(jnp.abs(p - final) ** 2)


def mixed_tensors(dtype):
  final = (jnp.array([1.0, -1.0, 2.0], dtype), jnp.array([[1.0, 0.0], [-1.0, 1.0]], dtype))
  initial = (jnp.zeros((3,), dtype), jnp.zeros((2, 2), dtype))
  return initial, final, lambda p: jnp.sum(jnp.abs(p[0] - final[0]) ** 2) + jnp.sum(jnp.abs(p[1] - final[1]) ** 2)


def refuses_complex(name, params):
  complex_leaves = [x for x in jax.tree.leaves(params) if jnp.iscomplexobj(x)]
  return bool(complex_leaves) and (name in NO_COMPLEX or (name in NO_COMPLEX_MATRIX and
                                                          any(x.ndim >= 2 for x in complex_leaves)))


def step_fn(opt, objective):
  @jax.jit
  def step(params, state):
    _, grads = jax.value_and_grad(objective)(params)
    grads = jax.tree.map(jnp.conj, grads)  # complex gradients are conjugated before they are applied (optax)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


# ---- alias_test.py --------------------------------------------------------------------------------------------


def _cases():
  for name in NAMES:
    for target in (parabola, rosenbrock):
      for dtype in ("float32", "complex64"):
        reason = EXPECTED["optimization"].get((name, target.__name__, dtype))
        marks = [pytest.mark.xfail(reason=reason, strict=True, raises=AssertionError)] if reason else []
        yield pytest.param(name, target, dtype, marks=marks, id=f"{name}-{target.__name__}-{dtype}")


@pytest.mark.parametrize("name,target,dtype", list(_cases()))
def test_optimization(name, target, dtype):
  """alias_test.test_optimization: 10,000 jitted steps reach the minimum within 3e-2; the second call of the
  step does not recompile."""
  opt = make(name)
  initial, final, objective = target(dtype)
  if refuses_complex(name, initial):
    with pytest.raises(ParameterTreeError, match="does not support complex parameters"):
      opt.init(initial)
    return
  step = step_fn(opt, objective)
  params, state = initial, opt.init(initial)
  for it in range(10_000):
    params, state = step(params, state)
    if it == 1:
      assert step._cache_size() == 1, "the optimizer recompiles on the second call of update"
  test_utils.assert_trees_all_close(params, final, rtol=3e-2, atol=3e-2)


def _check_map_params(name, params):
  opt = make(name)
  state = opt.init(params)
  reason = EXPECTED["tree_map_params"].get(name)
  if reason:
    with pytest.raises(BAdamError, match="map_params"):
      optax.tree.map_params(opt, lambda v: v, state)
    return
  mapped = optax.tree.map_params(opt, lambda v: v, state)  # a no-op change, to verify that the map works
  test_utils.assert_trees_all_equal(mapped, state)
  # and it finds the parameter-shaped trees (every optimizer here keeps at least one): mapped to ones, they change
  ones = optax.tree.map_params(opt, jnp.ones_like, state)
  assert jax.tree.structure(ones) == jax.tree.structure(state)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ones), jax.tree.leaves(state)))


@pytest.mark.parametrize("name", NAMES)
def test_tree_map_params(name):
  """alias_test / _common_test subtest 'Test that tree_map_params works', on a bare array and on a tuple."""
  _check_map_params(name, jnp.array([-1.0, 10.0, 1.0]))
  _check_map_params(name, mixed_tensors(jnp.float32)[0])


@pytest.mark.parametrize("name", NAMES)
def test_optimizers_accept_extra_args(name):
  """alias_test / _common_test: update takes an argument it does not expect; no recompilation on the 2nd call."""
  opt = make(name)
  initial, _, objective = rosenbrock(jnp.float32)

  @jax.jit
  def step(params, state):
    _, grads = jax.value_and_grad(objective)(params)
    updates, state = opt.update(grads, state, params, unexpected_extra_args_your_optimizer_doesnt_expect=1)
    return optax.apply_updates(params, updates), state

  params, state = initial, opt.init(initial)
  for _ in range(2):
    params, state = step(params, state)
  assert step._cache_size() == 1
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("name", NAMES)
def test_optimizers_can_be_wrapped_in_inject_hyperparams(name):
  """alias_test / _common_test: inject_hyperparams(factory)(**kwargs) gives the same updates and inner state.

  Tolerances: _common_test's (rtol 1e-5 on updates, rtol = atol = 1e-5 on the state; alias_test's are looser).
  static_args: only `optim.registry.STATIC_ARGS` (loop counts, as optax's own list: ns_steps) — a new
  factory with another non-injectable argument fails here."""
  factory = OPTIMIZERS[name]
  kwargs = SETTINGS[name]
  static = tuple(a for a in STATIC_ARGS if a in inspect.signature(factory).parameters)
  opt = factory(**kwargs)
  opt_inject = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
  params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
  grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
  updates, new_state = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  updates_inject, new_state_inject = jax.jit(opt_inject.update)(grads, jax.jit(opt_inject.init)(params), params)
  test_utils.assert_trees_all_close(updates_inject, updates, rtol=1e-5)
  test_utils.assert_trees_all_close(new_state_inject.inner_state, new_state, rtol=1e-5, atol=1e-5)


DTYPE_ARG = {n: a for n in NAMES for a in ("mu_dtype", "accumulator_dtype")
             if a in inspect.signature(OPTIMIZERS[n]).parameters}


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32", "complex64", None])
@pytest.mark.parametrize("params_dtype", ["bfloat16", "float32", "complex64", None])
@pytest.mark.parametrize("name", sorted(DTYPE_ARG))
def test_explicit_dtype(name, params_dtype, state_dtype):
  """alias_test.test_explicit_dtype (sgd's accumulator_dtype, adam(w)'s mu_dtype), for every factory with such an
  argument: every momentum buffer ('mu' / 'trace' in the state) has the asked dtype, else the params'."""
  opt = make(name, **{DTYPE_ARG[name]: state_dtype})
  params_dtype = jax.dtypes.canonicalize_dtype(params_dtype)
  params = jnp.array([0.0, 0.0], dtype=params_dtype)
  if refuses_complex(name, params):
    with pytest.raises(ParameterTreeError, match="complex"):
      opt.init(params)
    return
  state = opt.init(params)
  expected = params_dtype if state_dtype is None else jax.dtypes.canonicalize_dtype(state_dtype)
  found = [leaf for key in ("mu", "trace") for _, buf in optax.tree.get_all_with_path(state, key)
           for leaf in jax.tree.leaves(buf)]
  assert found, "no momentum buffer found in the state"
  assert {x.dtype for x in found} == {expected}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_preserve_dtype(name, dtype):
  """alias_test / _common_test: updates have the gradients' (= the params') dtype."""
  opt = make(name)
  fun = lambda x: jnp.sum(x ** 2)
  params = jnp.array([1.0, 2.0], dtype=dtype)
  grads = jax.grad(fun)(params)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  assert updates.dtype == grads.dtype == params.dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("name", NAMES)
def test_state_shape_dtype_shard_stability(name, dtype):
  """alias_test: a step behind lax.cond (update or keep) compiles, i.e. the new state has the old one's
  shapes and dtypes, and the params keep their dtype (64-bit dtypes with x64 on)."""
  with jax.enable_x64(dtype in ("float64", "complex128")):
    opt = make(name)
    initial, _, objective = parabola(dtype)
    if refuses_complex(name, initial):
      with pytest.raises(ParameterTreeError, match="complex"):
        opt.init(initial)
      return

    @jax.jit
    def step(params, state):
      value, grads = jax.value_and_grad(objective)(params)
      grads = jax.tree.map(lambda x: x.conj(), grads)
      del value
      cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0  # defeats constant folding
      updates, state = jax.lax.cond(cond, lambda: opt.update(grads, state, params), lambda: (params, state))
      return optax.apply_updates(params, updates), state

    params, state = initial, opt.init(initial)
    for _ in range(2):
      params, new_state = step(params, state)
      assert jax.tree.leaves(params)[0].dtype == jnp.dtype(dtype)
      cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
      state = jax.lax.cond(cond, lambda: state, lambda: new_state)  # noqa: B023


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_gradient_accumulation(name, dtype):
  """alias_test / _common_test: inside optax.MultiSteps(every 4) the first mini-step's update is exactly zero."""
  opt = optax.MultiSteps(make(name), every_k_schedule=4)
  fun = lambda x: jnp.sum(x ** 2)
  params = jnp.array([1.0, 2.0], dtype=dtype)
  grads = jax.grad(fun)(params)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  test_utils.assert_trees_all_equal(updates, jnp.zeros_like(grads))


# ---- contrib/_common_test.py ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [parabola, rosenbrock, matrix_parabola, mixed_tensors],
                         ids=["parabola", "rosenbrock", "matrix_parabola", "mixed_tensors"])
@pytest.mark.parametrize("name", NAMES)
def test_optimizers(name, target):
  """_common_test.test_optimizers: 30,000 steps in one lax.scan reach the minimum within 3e-2 (float32)."""
  opt = make(name)
  initial, final, objective = target(jnp.float32)
  step = step_fn(opt, objective)
  (params, _), _ = jax.lax.scan(lambda c, _: (step(*c), None), (initial, opt.init(initial)), length=30_000)
  test_utils.assert_trees_all_close(params, final, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", NAMES)
def test_optimizers_accept_learning_rate_schedule(name):
  """_common_test.test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_such: every factory is
  annotated to take a schedule (asserted, where optax skips), and constant_schedule(1e-3) equals 1e-3 over
  10 steps."""
  factory = OPTIMIZERS[name]
  annotation = typing.get_type_hints(factory)["learning_rate"]  # resolved: the modules use postponed annotations
  assert annotation in (optax.ScalarOrSchedule, optax.Schedule)
  initial, _, objective = parabola(jnp.float32)
  results = []
  for lr in (optax.constant_schedule(1e-3), 1e-3):
    opt = make(name, learning_rate=lr)
    params, state = initial, opt.init(initial)
    for _ in range(10):
      grads = jax.grad(objective)(params)
      updates, state = opt.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    results.append(params)
  test_utils.assert_trees_all_close(*results)


def test_static_args_are_only_loop_counts():
  """The documented exception to 'no static_args': loop counts, which a traced value cannot drive; without it
  the error says what to do."""
  assert {"ns_steps", "rank_fraction"} <= set(STATIC_ARGS)  # and what fixes a state shape: Dion's rank
  tx = optax.inject_hyperparams(OPTIMIZERS["muon"])(learning_rate=1e-2)
  params = jnp.ones((3, 3))
  with pytest.raises(TypeError, match="static_args=\\('ns_steps',\\)"):
    jax.jit(tx.update)(params, tx.init(params), params)


@pytest.mark.parametrize("name", sorted(NO_COMPLEX | NO_COMPLEX_MATRIX))
def test_complex_refusals_are_clear_errors_at_init(name):
  """The documented refusals, on a complex matrix (vectors: see the cases above) — never NaN later."""
  with pytest.raises(ParameterTreeError, match="does not support complex parameters"):
    make(name).init({"w": jnp.ones((3, 4), jnp.complex64), "b": jnp.ones((4,), jnp.complex64)})
