"""muon_on_moe: every arm's optimizer against a float64 NumPy reference written from the equations (momentum,
quintic Newton–Schulz, Moonlight scale, Adam, clip, schedule, decoupled decay), per_expert against `optim.muon`
and the Adam arms against `optax.adamw`, the analytic per-expert RMS claims against exact polar factors (SVD),
the measurement helpers on hand-made inputs, and one smoke run of the whole experiment."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from research.experiments import muon_on_moe as mm

QUINTIC = (3.4445, -4.7750, 2.0315)
TOTAL = 20  # schedule length: warmup min(100, 20 // 10) = 2 steps, then cosine to 0.1
STEPS = 6  # updates compared
WD = 0.1
E, D, F, L = 4, 8, 6, 2
SHAPES = {"embed_VD": (16, D), "final_norm": (D,),
          "blocks": {"attn_norm": (L, D), "wq_DQ": (L, D, 12),
                     "moe": {"router_DE": (L, D, E), "w_gate_EDF": (L, E, D, F), "w_up_EDF": (L, E, D, F),
                             "w_down_EFD": (L, E, F, D)}}}
EXPERTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
# optax evaluates schedules of its int32 count in float32 even under x64: lr(t) carries a relative rounding of
# up to 2^-24 (plus an ulp of cos), so updates agree to 2e-7 of their leaf's scale, not to float64's 1e-15
RTOL = 2e-7


def assert_close(got, want, msg):
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max(), err_msg=msg)


# --- the NumPy reference -----------------------------------------------------------------------------------------

def np_ns(x, steps=5, eps=1e-7):
  """Quintic Newton–Schulz on the last two axes: X ← X/(‖X‖_F + eps), then X ← aX + (bA + cA²)X, A = XXᵀ, on
  the wide orientation (KellerJordan/Muon, optimizers.md §1.2)."""
  tall = x.shape[-2] > x.shape[-1]
  X = np.swapaxes(x, -1, -2) if tall else x
  X = X / (np.sqrt(np.sum(X ** 2, axis=(-2, -1), keepdims=True)) + eps)
  a, b, c = QUINTIC
  for _ in range(steps):
    A = X @ np.swapaxes(X, -1, -2)
    X = a * X + (b * A + c * A @ A) @ X
  return np.swapaxes(X, -1, -2) if tall else X


def np_expert_direction(U, mode):
  """scale·NS of an expert stack (L, E, a, b): per expert, as one (E·a, b) matrix, or as (E, a·b) rows."""
  l, e, a, b = U.shape
  if mode == "per_expert":
    return 0.2 * math.sqrt(max(a, b)) * np_ns(U)
  if mode == "flat_stack":
    return 0.2 * math.sqrt(max(e * a, b)) * np_ns(U.reshape(l, e * a, b)).reshape(U.shape)
  return 0.2 * math.sqrt(max(e, a)) * np_ns(U.reshape(l, e, a * b)).reshape(U.shape)  # moonlight_toy


def np_unit_lr(t, total=TOTAL):
  w = min(100, total // 10)
  if t < w:
    return t / w
  return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - w) / (total - w)))


def flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    out.update(flat(v, prefix + k + "/") if isinstance(v, dict) else {prefix + k: v})
  return out


def unflat(d):
  out = {}
  for k, v in d.items():
    node = out
    *head, last = k.split("/")
    for h in head:
      node = node.setdefault(h, {})
    node[last] = v
  return out


def np_trajectory(arm, lr, params, grads, fallback_lr=0.02, beta=0.95, b1=0.9, b2=0.95, eps=1e-8):
  """The arm's updates at every step: clip to global norm 1; hidden matrices (wq, router) Muon per matrix,
  embedding and norms Adam (norms undecayed), expert stacks by the arm's rule; u = −peak·s(t)·(dir + wd·W)."""
  W = {k: v.copy() for k, v in flat(params).items()}
  M = {k: np.zeros_like(v) for k, v in W.items()}
  V = {k: np.zeros_like(v) for k, v in W.items()}
  # muonclip: per-expert Muon; its QK-clip acts only with max_logits, which these updates do not get (test_stress_*)
  rule = {"per_expert": "per_expert", "flat_stack": "flat_stack", "moonlight_toy": "moonlight_toy",
          "muonclip": "per_expert"}.get(arm, "adam")
  out = []
  for t, g_tree in enumerate(grads):
    g = flat(g_tree)
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g.values()))
    g = {k: x * min(1.0, 1.0 / norm) for k, x in g.items()}
    u = {}
    for k, gk in g.items():
      name = k.split("/")[-1]
      expert, hidden = name in EXPERTS, name in ("wq_DQ", "router_DE")
      muon = hidden or (expert and rule != "adam")
      if muon:
        M[k] = beta * M[k] + (1 - beta) * gk
        U = beta * M[k] + (1 - beta) * gk
        if expert:
          direction = np_expert_direction(U, rule)
        else:
          direction = 0.2 * math.sqrt(max(U.shape[-2:])) * np_ns(U)
      else:
        M[k] = b1 * M[k] + (1 - b1) * gk
        V[k] = b2 * V[k] + (1 - b2) * gk ** 2
        direction = (M[k] / (1 - b1 ** (t + 1))) / (np.sqrt(V[k] / (1 - b2 ** (t + 1))) + eps)
      decay = 0.0 if "norm" in name else WD
      peak = fallback_lr if (expert and arm == "adam_at_muon_lr") else lr
      u[k] = -peak * np_unit_lr(t) * (direction + decay * W[k])
    W = {k: W[k] + u[k] for k in W}
    out.append(u)
  return out


def random_problem(seed=0):
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: rng.standard_normal(s) * 0.1, SHAPES, is_leaf=lambda s: isinstance(s, tuple))
  # gradient scales alternate below and above the clip threshold; one expert gets a 1e-3× gradient
  grads = []
  for t in range(STEPS):
    g = jax.tree.map(lambda s: rng.standard_normal(s) * (0.02 if t % 2 else 0.5), SHAPES,
                     is_leaf=lambda s: isinstance(s, tuple))
    for k in EXPERTS:
      g["blocks"]["moe"][k][:, 1] *= 1e-3
    grads.append(g)
  return params, grads


def run_tx(tx, params, grads):
  """The updates at every step (float64, one jitted update: every arm lowers to the same program)."""
  params = jax.tree.map(jnp.asarray, params)
  state = tx.init(params)
  step = jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = step(jax.tree.map(jnp.asarray, g), state, params)
    params = optax.apply_updates(params, u)
    out.append(jax.tree.map(np.asarray, u))
  return out


# --- the optimizers ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arm", mm.ARMS)
def test_arm_matches_numpy_reference(arm):
  """The whole update tree, six steps: the flattened-stack transforms (`scale_by_flat_muon`) on the experts of
  flat_stack / moonlight_toy, per-expert Muon, Adam, and the shared groups around them."""
  with jax.enable_x64(True):
    params, grads = random_problem()
    got = run_tx(mm.make_tx(arm, 3e-3, TOTAL, weight_decay=WD), params, grads)
    want = np_trajectory(arm, 3e-3, params, grads)
  assert len(got) == STEPS
  for t, (g, w) in enumerate(zip(got, want)):
    g = flat(g)
    assert set(g) == set(w)
    for k in w:
      assert_close(g[k], w[k], f"{arm} step {t} {k}")
  moved = flat(got[-1])["blocks/moe/w_gate_EDF"]
  assert np.all(np.abs(moved) > 0)  # a test that cannot pass on zero updates


def test_adam_at_muon_lr_is_optax_adamw_at_the_fallback_lr_on_the_experts():
  """The wiring of the one arm whose experts get their own lr, against the installed oracle (the NumPy reference
  covers adamw_experts)."""
  lr, fallback = 3e-3, 0.02
  with jax.enable_x64(True):
    params, grads = random_problem(1)
    got = run_tx(mm.make_tx("adam_at_muon_lr", lr, TOTAL, weight_decay=WD, fallback_lr=fallback), params, grads)
    adamw = optax.adamw(optim.make_schedule("cosine", fallback, TOTAL, warmup=2, min_ratio=0.1), b1=0.9, b2=0.95,
                        eps=1e-8, weight_decay=WD)
    want = run_tx(optax.chain(optax.clip_by_global_norm(1.0), adamw), params, grads)
  for t in range(STEPS):
    for k in EXPERTS:
      assert_close(got[t]["blocks"]["moe"][k], want[t]["blocks"]["moe"][k], f"step {t} {k}")
  assert np.abs(got[-1]["blocks"]["moe"]["w_up_EDF"]).max() > 0


def test_select_rule_returns_one_rule_and_hides_the_others_non_finite_values():
  nan_rule = optax.stateless(lambda u, p: jax.tree.map(lambda x: x * jnp.nan, u))
  g = {"w": jnp.arange(4.0)}
  for index, want in ((0, 2 * g["w"]), (1, 3 * g["w"])):
    tx = mm.select_rule([optax.scale(2.0), optax.scale(3.0), nan_rule], index)
    out, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(out["w"], want)
  with pytest.raises(mm.MuonMoEError, match="rule index"):
    mm.select_rule([optax.identity()], 1)


def test_labels_and_bad_input():
  labels = flat(mm.expert_labels(jax.tree.map(np.zeros, SHAPES, is_leaf=lambda s: isinstance(s, tuple))))
  assert labels == {"embed_VD": "adam", "final_norm": "adam", "blocks/attn_norm": "adam", "blocks/wq_DQ": "muon",
                    "blocks/moe/router_DE": "muon", **{f"blocks/moe/{k}": "expert" for k in EXPERTS}}
  with pytest.raises(mm.MuonMoEError, match="unknown arm"):
    mm.make_tx("sgd", 1e-2, 10)
  with pytest.raises(mm.MuonMoEError, match="fan_in, fan_out"):
    mm.flat_shape((4, 5), "flat_stack")
  with pytest.raises(mm.MuonMoEError, match="flattening mode"):
    mm.scale_by_flat_muon("rows")
  with pytest.raises(mm.MuonMoEError, match="spike window"):
    mm.count_spikes([1.0, 2.0], window=0)


# --- the analytic claims on exact polar factors ------------------------------------------------------------------

def polar(x):
  """Exact U Vᵀ of every matrix in x (SVD)."""
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  return u @ vt


@pytest.mark.parametrize("arm", ["per_expert", "flat_stack", "moonlight_toy"])
def test_predicted_rms_on_exact_polar_factors(arm):
  """With exact polar factors: per_expert gives every expert RMS 0.2; moonlight_toy gives every expert the same
  predicted RMS (0.2·√max(E, a)/√(ab) per matrix), a starved expert included; flat_stack keeps the stack at 0.2
  but shrinks the starved expert's update."""
  rng = np.random.default_rng(3)
  E_, d, f = 8, 64, 32
  gs = [rng.standard_normal((E_, d, f)), rng.standard_normal((E_, d, f)), rng.standard_normal((E_, f, d))]
  for g in gs:
    g[5] *= 1e-3  # expert 5 got (almost) no tokens
  outs = []
  for g in gs:
    e, a, b = g.shape
    if arm == "per_expert":
      outs.append(0.2 * math.sqrt(max(a, b)) * polar(g))
    elif arm == "flat_stack":
      outs.append(mm.flat_scale(g.shape, arm) * polar(g.reshape(e * a, b)).reshape(g.shape))
    else:
      outs.append(mm.flat_scale(g.shape, arm) * polar(g.reshape(e, a * b)).reshape(g.shape))
  rms_E = np.sqrt(sum(np.sum(o ** 2, axis=(1, 2)) for o in outs) / (3 * d * f))
  stack_rms = [np.sqrt(np.mean(o ** 2)) for o in outs]
  predicted = mm.predicted_rms(arm, E_, d, f)
  if arm == "flat_stack":
    np.testing.assert_allclose(stack_rms, 0.2, rtol=1e-10)
    assert rms_E[5] < 1e-2 * np.delete(rms_E, 5).min()
  else:
    np.testing.assert_allclose(rms_E, predicted, rtol=1e-10)
  if arm == "moonlight_toy":
    np.testing.assert_allclose(predicted, math.sqrt((2 * (0.2 * 8 / math.sqrt(2048)) ** 2
                                                     + (0.2 * math.sqrt(32) / math.sqrt(2048)) ** 2) / 3), rtol=1e-12)
  assert mm.predicted_rms("adamw_experts", E_, d, f) is None


# --- the measurement helpers -------------------------------------------------------------------------------------

def test_count_spikes_on_a_hand_made_curve():
  rng = np.random.default_rng(4)
  curve = 2.0 + 0.05 * rng.standard_normal(200)
  assert mm.count_spikes(curve, 50, 1.5)[0] == 0
  curve[80:83] = 4.0  # one spike three steps long
  curve[120] = 3.5  # a one-step spike
  curve[160] = 2.9  # 1.45×: under the threshold
  spikes, jump = mm.count_spikes(curve, 50, 1.5)
  assert spikes == 2
  np.testing.assert_allclose(jump, 4.0 / np.median(curve[30:80]), rtol=1e-12)
  decreasing = np.linspace(5.0, 1.0, 200)  # falling fast: never above its past median
  assert mm.count_spikes(decreasing, 50, 1.5)[0] == 0


def test_past_edge_extends_the_grid_only_at_a_best_edge():
  inf = math.inf
  assert mm.past_edge({0.01: 2.2, 0.03: 2.16, 0.1: 2.13}) == 0.3
  assert mm.past_edge({0.01: 2.1, 0.03: 2.16, 0.1: 2.2}) == 0.00333
  assert mm.past_edge({0.01: 2.2, 0.03: 2.1, 0.1: 2.3}) is None
  assert mm.past_edge({0.01: 2.2, 0.03: 2.1, 0.1: inf}) is None  # a diverged top edge is no reason to go higher
  assert mm.past_edge({0.01: 2.2, 0.03: inf}) == 0.00333
  assert mm.past_edge({0.01: 2.2}) is None and mm.past_edge({0.01: inf, 0.03: inf}) is None


def test_direction_rms_removes_lr_and_decay():
  rng = np.random.default_rng(5)
  d, W = rng.standard_normal((2, 4, 30)), rng.standard_normal((2, 4, 30))
  lr, wd = 3e-3, 0.1
  u = -lr * (d + wd * W)
  got = mm.direction_rms(np.sum(u ** 2, -1), np.sum(u * W, -1), np.sum(W ** 2, -1), lr, wd, 30)
  np.testing.assert_allclose(got, np.sqrt(np.mean(d ** 2, -1)), rtol=1e-9)


# --- the experiment at smoke size --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(notebooks):
  """(`muon_on_moe.main(Config(smoke=True))` as notebooks/muon_on_moe.ipynb ran it, where its default `out` would
  be)."""
  run = notebooks.run("muon_on_moe")
  return run.result, run.cwd / mm.Config().out


def test_smoke_run(smoke):
  result, out = smoke
  cfg = mm.smoke_config(mm.Config(smoke=True))
  assert not out.exists(), "the smoke size must not write results"
  assert set(result["arms"]) == set(mm.DEFAULT_ARMS)
  assert len(result["runs"]) == len(mm.DEFAULT_ARMS) * (len(cfg.lrs) + len(cfg.seeds) - 1)
  assert result["tokens_per_run"] == cfg.steps * cfg.batch_size * cfg.seq_len
  for r in result["runs"]:  # equal tokens, finite, and learning: below ln 256 = 5.55 and falling
    assert len(r["loss"]) == cfg.steps and np.all(np.isfinite(r["loss"])) and not r["diverged"]
    (_, first), (_, last) = r["val_curve"]
    assert last < first < 5.0 and last == r["final_val_loss"]
    assert np.mean(r["loss"][-3:]) < np.mean(r["loss"][:3]) - 0.5
  a = result["arms"]
  for arm in mm.DEFAULT_ARMS:
    assert a[arm]["seeds"] == list(cfg.seeds) and np.isfinite(a[arm]["val"][0]) and a[arm]["val"][1] > 0
  # the invariants the experiment relies on: per-expert Muon gives every expert the same size, 0.2 × NS's
  # singular-value RMS (quintic: σ in [0.68, 1.13]), whatever its load; the toy flattening ~5.7× smaller
  ns = a["per_expert"]["rms"][0] / mm.INTENDED_RMS
  assert 0.68 < ns < 1.13
  assert abs(a["per_expert"]["rms_rare"][0] / a["per_expert"]["rms_busy"][0] - 1) < 0.1  # rank-deficient rare grads
  np.testing.assert_allclose(a["moonlight_toy"]["rms"][0], ns * a["moonlight_toy"]["predicted_rms"], rtol=0.1)
  assert a["moonlight_toy"]["rms"][0] < 0.25 * a["per_expert"]["rms"][0]
  assert a["flat_stack"]["rms"][0] < 0.2 * 1.13


def test_plot_and_table(smoke):
  result, _ = smoke
  fig = mm.plot(result)
  assert len(fig.axes) == 3 and all(ax.has_data() for ax in fig.axes)
  lines = mm.table(result)
  assert sum(line.startswith("| ") for line in lines) == 1 + len(mm.DEFAULT_ARMS) + 1 + len(result["runs"])
  assert len(mm.findings(result)) == 4


def test_stress_setting_logs_logits_and_muonclip_caps_them():
  """The stress setting at smoke size with a τ the logits cross within 12 steps: every run logs a max logit per step;
  at the same lr and seed, after plain per-expert Muon first crosses τ, QK-clip's logits stay lower (max and mean)
  and exceed τ on fewer steps. muonclip on a QK-norm model is refused."""
  # τ = 0.1: at smoke size (lr 1e-2, 12 steps) plain Muon's max logit measured 0.09 at first, 0.12-0.15 from step 5
  cfg = dataclasses.replace(mm.stress_config(mm.Config()), smoke=True, clip_threshold=0.1)
  result = mm.main(cfg)
  runs = {(r["arm"], r["seed"]): r for r in result["runs"]}
  assert set(result["arms"]) == {"per_expert", "muonclip", "adamw_experts"}
  plain, clipped = np.array(runs["per_expert", 0]["logit_curve"]), np.array(runs["muonclip", 0]["logit_curve"])
  assert len(plain) == len(clipped) == mm.smoke_config(cfg).steps
  first = int(np.argmax(plain > 0.1))
  assert plain.max() > 0.1 and first < len(plain) - 3  # the clip has something to do
  after_plain, after_clip = plain[first + 1:], clipped[first + 1:]
  assert after_clip.max() < after_plain.max() and after_clip.mean() < after_plain.mean()
  assert result["arms"]["muonclip"]["steps_above_tau"][0] < result["arms"]["per_expert"]["steps_above_tau"][0]
  lines = mm.table(result)
  assert any(line.startswith("| arm | best lr | max attention logit") for line in lines)
  assert any(line.startswith("| arm at lr 0.1 (all seeds)") for line in lines)  # the stress lr, every seed
  assert all(len(a["at"][0.1]["val_by_seed"]) == 2 for a in result["arms"].values())
  assert mm.findings(result)[-1].startswith("Reading: at lr 0.1 (2 seeds each)")
  assert len(mm.plot(result).axes) == 4
  with pytest.raises(mm.MuonMoEError, match="muonclip arm needs"):
    mm.main(mm.Config(smoke=True, arms=("muonclip",)))
