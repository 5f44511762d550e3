"""How should Muon treat a stacked expert weight (L, E, d_in, d_out)? Per-expert orthogonalization vs a flattened
stack vs AdamW on the experts, on a small MoE LM: validation loss, loss spikes, per-expert update RMS, and the
update size an expert gets when the router sends it few tokens.

  python -m research.experiments.muon_on_moe            # full size: writes research/results/muon_on_moe/
  python -m research.experiments.muon_on_moe --smoke    # seconds (the tests run this); writes nothing

Claim under test (shared/reference/methods.md §10; optimizers.md §1, §3). Muon's update is the polar factor
NS(U) ≈ U Vᵀ of the momentum U = U Σ Vᵀ of each matrix; Moonlight (Liu et al., arXiv 2502.16982, Lemma 1) scales
it by 0.2·√max(A, B) so that a full-rank A×B update has RMS 0.2, AdamW's, and the AdamW lr carries over. For an
expert stack "each matrix" is ambiguous, and public code gets it wrong in known ways (methods.md §10(b)):
  per_expert      NS batched over (L, E), scale 0.2·√max(d_in, d_out) from each expert's own shape: `optim.muon`,
                  the current practice (KellerJordan/Muon's batched NS, optax dimension numbers, MaxText #4843).
                  Intended expert RMS 0.2 (×RMS of NS's singular values, quintic: σ ∈ [0.68, 1.13]).
  flat_stack      each layer's stack as ONE (E·d_in, d_out) matrix (experts concatenated along the input axis),
                  scale 0.2·√max(E·d_in, d_out) from that matrix: what a 2-D-only optimizer does with a stack reshaped
                  to a matrix. The stack's RMS is 0.2, but expert e's block is G_e·(Σ_e' G_e'ᵀG_e')^(-1/2): experts
                  share one normalization and an expert with a small gradient gets a small update.
  moonlight_toy   Moonlight's examples/toy_train.py branch `g.view(g.size(0), -1)` on a layer's (E, d_in, d_out),
                  scale 0.2·√max(E, d_in) from `param_shape[:2]`: the E flattened experts become mutually orthogonal
                  unit rows, so every expert's RMS is 0.2·√max(E, d_in)/√(d_in·d_out), whatever its gradient
                  (e.g. 0.035 for E=8, 64×32: 5.7× too small).
  adamw_experts   AdamW on the expert stacks (bias-corrected, β = (0.9, 0.95), same decoupled decay), Muon elsewhere.
  adam_at_muon_lr the old optax.contrib.muon fallback (`'muon' if x.ndim == 2 else 'adam'`, one shared lr): the
                  experts on Adam at Muon's lr in Keller's convention (`fallback_lr` = 0.02, the KellerJordan/Muon
                  and optax default), everything else as in adamw_experts at the grid's lr.
Every arm treats the non-expert parameters as `optim.muon` does: Muon (Moonlight scale) on the hidden matrices,
router included, AdamW on embeddings, norms and the (tied) head, one lr for both groups; decoupled weight decay
0.1 everywhere; the CLI's schedule (10% linear warmup, cosine to 0.1×) and global-norm clip 1.0.

Setup: `moe_tiny` (d_model 64, 2 layers, E=8 SwiGLU experts of width 32, top-2, Switch load-balancing loss 1e-2),
the byte-level stdlib corpus, equal tokens for every arm (steps × batch × seq_len = 200 × 8 × 64 = 102,400
predicted training tokens per run, the same batches for the same seed; top-2 routing gives every arm the same
number of expert assignments), held-out loss on 8 fixed batches of the val split. Each arm's peak lr is tuned on
the same grid {1e-2, 3e-2, 1e-1} with seed 0, plus one lr past the edge (×3 or ÷3) for an arm whose best sits on
it, then run with seeds 1, 2 at its best lr (the seed-0 run reused); one lr per arm serves all its groups.

Measured per step, inside the jitted step (`common.fit(metrics=...)`): every expert's direction
d = −u/lr_t − wd·W (the update u = −lr_t·(d + wd·W) with the learning rate and decay removed), its RMS over the
expert's three matrices, and the expert's load f_e (its share of the step's top-2 assignments, the router's aux).
A loss spike is a step whose train loss exceeds `spike_ratio` × the median of the previous `spike_window` steps;
consecutive such steps count as one spike; a run whose loss turns non-finite counts as diverged (never "best").
"Honest" here: equal tokens, one lr grid for every arm, three seeds at the best lr, held-out loss, and spike
counts and update sizes reported as measured, zero spikes included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time
from typing import Annotated, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

import optim
from models import Transformer, preset
from research import flags
from research.experiments import common
from research.experiments.common import past_edge

ARMS = ("per_expert", "flat_stack", "moonlight_toy", "adamw_experts", "adam_at_muon_lr", "muonclip")
DEFAULT_ARMS = ARMS[:5]  # muonclip needs a model without QK-norm: the stress setting's
EXPERT_LEAVES = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")  # models/moe.py: (L, E, fan_in, fan_out) stacks
INTENDED_RMS = 0.2  # Moonlight's target update RMS (arXiv 2502.16982, Lemma 1)


class MuonMoEError(ValueError):
  """A bad arm, flattening mode or parameter shape for this experiment."""


@dataclasses.dataclass
class Config(common.Base):
  out: str = "research/results/muon_on_moe"
  model: str = "moe_tiny"
  steps: int = 200
  batch_size: int = 8
  seq_len: int = 64
  seeds: tuple[int, ...] = (0, 1, 2)
  lrs: tuple[float, ...] = (1e-2, 3e-2, 1e-1)
  extend_edge: bool = True  # one more lr (×3 or ÷3) for an arm whose best sits on the grid's edge
  arms: Annotated[tuple[str, ...], flags.one_of(*ARMS)] = DEFAULT_ARMS
  fallback_lr: float = 0.02  # adam_at_muon_lr: the experts' Adam lr (Keller/optax Muon default)
  weight_decay: float = 0.1
  spike_window: int = 50
  spike_ratio: float = 1.5
  eval_every: int = 50
  eval_batches: int = 8
  stress: bool = False
  """The stress setting (`stress_config`): no QK-norm, higher lrs, longer; max attention logits logged; MuonClip."""
  qk_norm: bool | None = None  # None: the preset's (moe_tiny: on)
  logit_stats: bool = False  # log each step's max attention logit per layer (the model's aux "max_logit")
  clip_threshold: float = 100.0  # muonclip's τ
  also_lrs: Annotated[tuple[float, ...], flags.Rule(lo=0, open_lo=True, empty=True)] = ()
  """Every arm also runs every seed at these lrs (the stress setting: 0.1, where plain Muon's logits grow)."""


def smoke_config(cfg: Config) -> Config:
  """The same code path at a few steps: every arm, a one-point grid, 2 seeds."""
  return dataclasses.replace(cfg, steps=12, batch_size=4, seq_len=32, seeds=(0, 1), lrs=(1e-2,),
                             spike_window=4, eval_every=6, eval_batches=1)


def stress_config(cfg: Config) -> Config:
  """Where plain Muon's attention logits grow: moe_tiny without QK-norm (Kimi K2 has none: MLA), 5× the steps,
  the grid moved up ×3 (3e-2 .. 3e-1), every step's max logit logged; arms: per-expert Muon, the same with
  QK-clip at τ = `STRESS_TAU`, and AdamW on the experts; besides each arm's best lr, all seeds at lr 0.1, where the
  logits grow (at the tuned lrs they may stay below τ, and the clip then never acts)."""
  return dataclasses.replace(cfg, stress=False, steps=1000, lrs=(3e-2, 1e-1, 3e-1), qk_norm=False, logit_stats=True,
                             arms=("per_expert", "muonclip", "adamw_experts"), clip_threshold=STRESS_TAU,
                             also_lrs=(1e-1,), eval_every=100, spike_window=50, out=cfg.out + "_stress")


# τ for the stress setting: Kimi K2's 100. A pilot (seed 0, lr 0.1, per-expert Muon, no QK-norm) measured the max
# logit at 36 after 40 steps, 378 after 120 and 790 within 400, so τ = 100 acts from about step 80 on; with
# QK-clip at 100 the same run stayed at 100-108 from then on (the clip reads this step's logits, so the maximum
# measured before a clip can exceed τ a little)
STRESS_TAU = 100.0


# --- the flattened-stack Muon variants -------------------------------------------------------------------------

def flat_shape(shape, mode: str) -> tuple[int, ...]:
  """The matrix stack NS sees for an expert stack (..., E, a, b): (..., E·a, b) or (..., E, a·b)."""
  if len(shape) < 3:
    raise MuonMoEError(f"an expert stack needs shape (..., E, fan_in, fan_out), got {tuple(shape)}")
  *lead, E, a, b = shape
  if mode == "flat_stack":
    return (*lead, E * a, b)
  if mode == "moonlight_toy":
    return (*lead, E, a * b)
  raise MuonMoEError(f"unknown flattening mode {mode!r}; use 'flat_stack' or 'moonlight_toy'")


def flat_scale(shape, mode: str) -> float:
  """Moonlight's 0.2·√max(A, B), from the flattened matrix (flat_stack) or from `param_shape[:2]` of the layer's
  (E, a, b) stack, i.e. (E, a) (moonlight_toy, as examples/toy_train.py sizes its lr)."""
  E, a, b = shape[-3:]
  if mode == "flat_stack":
    return optim.shape_scale("moonlight", E * a, b)
  flat_shape(shape, mode)  # validates the mode
  return INTENDED_RMS * math.sqrt(max(E, a))


def scale_by_flat_muon(mode: str, beta: float = 0.95, *, ns_steps: int = 5,
                       eps: float = 1e-7) -> optax.GradientTransformation:
  """Muon on expert stacks (..., E, a, b) whose last three axes are flattened to one matrix before Newton–Schulz.

    M ← β·M + (1−β)·G,  U = β·M + (1−β)·G           (`optim.scale_by_muon`'s EMA-Nesterov momentum, elementwise,
                                                    so it commutes with the reshape)
    O = flat_scale(mode)·NS(reshape(U, flat_shape(mode))), reshaped back to (..., E, a, b)
  mode "flat_stack": (E·a, b); "moonlight_toy": (E, a·b) with scale 0.2·√max(E, a). Leading axes (layers) stay
  batch axes. The momentum is kept in the flattened shape.
  """
  flat_shape((1, 1, 1), mode)  # validates the mode
  inner = optim.scale_by_muon(beta, ns_steps=ns_steps, eps=eps, scale="none")
  flatten = lambda tree: jax.tree.map(lambda x: x.reshape(flat_shape(x.shape, mode)), tree)

  def init(params):
    return inner.init(flatten(params))

  def update(updates, state, params=None):
    del params
    o, state = inner.update(flatten(updates), state)
    o = jax.tree.map(lambda o_, g: (o_.reshape(g.shape) * flat_scale(g.shape, mode)).astype(g.dtype), o, updates)
    return o, state

  return optax.GradientTransformation(init, update)


# --- the arms ----------------------------------------------------------------------------------------------------
# Every arm, lr and seed lowers to ONE program: the arm picks an expert rule through optimizer state
# (`select_rule`) and the peak lrs are state (`optax.inject_hyperparams`), so the persistent compilation cache
# (`compile_once`) compiles `common.fit`'s step once for the whole sweep instead of once per run.

EXPERT_RULES = ("per_expert", "flat_stack", "moonlight_toy", "adam")  # the arms' expert updates, by index
RULE_OF_ARM = {"per_expert": "per_expert", "flat_stack": "flat_stack", "moonlight_toy": "moonlight_toy",
               "adamw_experts": "adam", "adam_at_muon_lr": "adam", "muonclip": "per_expert"}


class SelectState(NamedTuple):
  index: jax.Array  # int32: the rule whose output is the update
  inner: tuple  # every rule's state


def select_rule(rules, index: int) -> optax.GradientTransformation:
  """Runs every rule in `rules` on the same gradients and returns rule `index`'s update (`jnp.select`, so a
  rule left out cannot leak a non-finite value). Rules keep their own state; the others' outputs are discarded."""
  rules = tuple(rules)
  if not 0 <= index < len(rules):
    raise MuonMoEError(f"rule index {index} outside [0, {len(rules)})")

  def init(params):
    return SelectState(jnp.asarray(index, jnp.int32), tuple(r.init(params) for r in rules))

  def update(updates, state, params=None):
    outs, inner = zip(*(r.update(updates, s, params) for r, s in zip(rules, state.inner)))
    pick = lambda *xs: jnp.select([state.index == i for i in range(len(xs))], xs)
    return jax.tree.map(pick, *outs), SelectState(state.index, tuple(inner))

  return optax.GradientTransformation(init, update)


def expert_labels(params):
  """`optim.muon_labels`, with the routed experts' stacks relabelled "expert"."""
  def relabel(path, label):
    return "expert" if str(getattr(path[-1], "key", path[-1])) in EXPERT_LEAVES else label
  return jax.tree_util.tree_map_with_path(relabel, optim.muon_labels(params))


def unit_schedule(steps: int) -> optax.Schedule:
  """The CLI's schedule (`common.optimizer`) at peak 1: linear warmup over 10% of the steps (≤ 100), cosine to
  0.1×; the peak multiplies it (`group`)."""
  return optim.make_schedule("cosine", 1.0, steps, warmup=min(100, steps // 10), min_ratio=0.1)


def expert_lr(arm: str, lr: float, fallback_lr: float = 0.02) -> float:
  """The peak learning rate the expert stacks get."""
  return fallback_lr if arm == "adam_at_muon_lr" else lr


def group(core, peak: float, steps: int, weight_decay: float, mask=None) -> optax.GradientTransformation:
  """u = −peak·s(t)·(core(g) + wd·W): `optax.adamw`'s chain (and `optim.muon_with_adamw`'s Muon group) with the
  schedule s at peak 1 and the peak held in state."""
  return optax.chain(core, optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(unit_schedule(steps)),
                     optax.inject_hyperparams(optax.scale)(step_size=peak))


def make_tx(arm: str, lr: float, steps: int, *, weight_decay: float = 0.1, fallback_lr: float = 0.02,
            clip_threshold: float = 100.0) -> optax.GradientTransformation:
  """clip_by_global_norm(1), then three `optax.partition` groups by `expert_labels`, each `group`:
    "muon"   (hidden matrices, router included): `optim.scale_by_muon` (Moonlight scale), peak lr
    "adam"   (embedding/head, norms): bias-corrected Adam (0.9, 0.95, 1e-8), no decay on norms, peak lr
    "expert" (routed expert stacks): the arm's rule, peak `expert_lr(arm)`.
  per_expert is `optim.muon` (the same groups and chains); the Adam arms' expert update is `optax.adamw`'s. The
  tests check every arm against a float64 NumPy reference and the Adam arms against `optax.adamw`.
  Last, `optim.qk_clip` with τ in state: `clip_threshold` for muonclip (per_expert + QK-clip = `optim.muonclip`'s
  steps), ∞ for the others (a no-op, bit for bit), so every arm stays one program."""
  if arm not in ARMS:
    raise MuonMoEError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
  rules = [optim.scale_by_muon(), scale_by_flat_muon("flat_stack"), scale_by_flat_muon("moonlight_toy"),
           optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8)]
  expert = select_rule(rules, EXPERT_RULES.index(RULE_OF_ARM[arm]))
  tx = optax.partition({"muon": group(optim.scale_by_muon(), lr, steps, weight_decay),
                        "adam": group(optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8), lr, steps, weight_decay,
                                      optim.decay_mask),
                        "expert": group(expert, expert_lr(arm, lr, fallback_lr), steps, weight_decay)},
                       expert_labels)
  tau = clip_threshold if arm == "muonclip" else math.inf
  return optax.chain(optax.clip_by_global_norm(1.0), tx, optax.inject_hyperparams(optim.qk_clip)(threshold=tau))


@contextlib.contextmanager
def compile_once():
  """A persistent compilation cache in a temporary folder for the sweep, unless one is configured already:
  `common.fit` jits a fresh step per run, and every run here is the same program."""
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  with tempfile.TemporaryDirectory(prefix="muon_on_moe-jax-") as folder:
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()
    try:
      yield
    finally:
      jax.config.update("jax_compilation_cache_dir", None)
      compilation_cache.reset_cache()


def predicted_rms(arm: str, E: int, d: int, f: int) -> float | None:
  """Per-expert direction RMS over the three matrices (gate, up (d, f); down (f, d)) for an exact polar factor
  (all singular values 1); None where it depends on the gradients (Adam)."""
  shapes = [(E, d, f), (E, d, f), (E, f, d)]
  if arm in ("per_expert", "flat_stack"):  # flat_stack: the stack's RMS, split between experts by gradient share
    return INTENDED_RMS
  if arm == "moonlight_toy":  # unit rows of an (E, a·b) polar factor: RMS 1/√(ab) per expert, × 0.2·√max(E, a)
    return float(np.sqrt(np.mean([(flat_scale(s, arm) / math.sqrt(s[1] * s[2])) ** 2 for s in shapes])))
  return None


# --- measurements ------------------------------------------------------------------------------------------------

def expert_metrics(grads, updates, params, aux) -> dict:
  """Per (layer, expert) sums over its three matrices: u², u·W, W², g² (u the update, W the parameter before
  it, g the raw gradient), and the router's load f_e. `direction_rms` turns them into RMS(d)."""
  moe_u, moe_w, moe_g = updates["blocks"]["moe"], params["blocks"]["moe"], grads["blocks"]["moe"]
  tot = lambda f: sum(jnp.sum(f(k).astype(jnp.float32), axis=(-2, -1)) for k in EXPERT_LEAVES)
  out = {"u2_LE": tot(lambda k: moe_u[k] ** 2), "uw_LE": tot(lambda k: moe_u[k] * moe_w[k]),
         "w2_LE": tot(lambda k: moe_w[k] ** 2), "g2_LE": tot(lambda k: moe_g[k] ** 2), "load_LE": aux["load"]}
  if "max_logit" in aux:  # (L, N): the largest attention logit of each layer (over heads) in this step's batch
    out["max_logit_L"] = jnp.max(aux["max_logit"], axis=-1)
  return out


def direction_rms(u2, uw, w2, lr: float, wd: float, n: int):
  """RMS of d = −u/lr − wd·W over n elements, from Σu², Σu·W, ΣW²: Σd² = Σu²/lr² + 2·wd·Σu·W/lr + wd²·ΣW²."""
  u2, uw, w2 = (np.asarray(v, np.float64) for v in (u2, uw, w2))
  return np.sqrt(np.maximum(u2 / lr ** 2 + 2 * wd * uw / lr + wd ** 2 * w2, 0.0) / n)


def count_spikes(losses, window: int = 50, ratio: float = 1.5) -> tuple[int, float]:
  """(spikes, largest jump): a spike step has loss > ratio × median(previous `window` losses); a run of
  consecutive spike steps is one spike. The largest jump is max_t loss_t / median(previous window)."""
  x = np.asarray(losses, np.float64)
  if window < 1:
    raise MuonMoEError(f"spike window must be >= 1, got {window}")
  jumps = np.array([x[t] / np.median(x[t - window:t]) for t in range(window, len(x))])
  if jumps.size == 0:
    return 0, float("nan")
  above = jumps > ratio
  return int(np.sum(above[1:] & ~above[:-1]) + above[0]), float(jumps.max())


def summarize_run(records: list[dict], arm: str, lr: float, cfg: Config, n_elem: int) -> dict:
  """A run's numbers: val loss, spikes, and per-expert direction RMS / load after the warmup."""
  losses = [r["loss"] for r in records if "loss" in r]
  spikes, max_jump = count_spikes(losses, cfg.spike_window, cfg.spike_ratio)
  lr_t = expert_lr(arm, lr, cfg.fallback_lr) * np.asarray(unit_schedule(cfg.steps)(np.arange(cfg.steps)))
  warmup = min(100, cfg.steps // 10)
  rms, load, gnorm = [], [], []
  for r in records:
    if "u2_LE" not in r or r["step"] - 1 < warmup:  # record "step" s holds the update made at lr(s − 1)
      continue
    rms.append(direction_rms(r["u2_LE"], r["uw_LE"], r["w2_LE"], float(lr_t[r["step"] - 1]), cfg.weight_decay,
                             n_elem))
    load.append(np.asarray(r["load_LE"], np.float64))
    gnorm.append(np.sqrt(np.asarray(r["g2_LE"], np.float64)))
  rms_TLE, load_TLE, g_TLE = np.stack(rms), np.stack(load), np.stack(gnorm)
  lo, hi = np.quantile(load_TLE, [0.1, 0.9])
  zero = load_TLE == 0  # experts the router sent no token this step: their update is momentum alone
  val_curve = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
  logit_T = np.array([max(r["max_logit_L"]) for r in records if "max_logit_L" in r])
  logits = {} if not logit_T.size else {
      "max_logit": float(logit_T.max()), "final_max_logit": float(logit_T[-1]), "logit_curve": logit_T.tolist(),
      "steps_above_tau": int(np.sum(logit_T > cfg.clip_threshold))}
  return {**logits, "final_val_loss": val_curve[-1][1], "val_curve": val_curve, "loss": losses, "spikes": spikes,
          "max_jump": max_jump,
          "rms_mean": float(rms_TLE.mean()), "rms_std_over_experts": float(rms_TLE.std(axis=(1, 2)).mean()),
          "rms_E": rms_TLE.mean(axis=(0, 1)).tolist(), "load_E": load_TLE.mean(axis=(0, 1)).tolist(),
          "rms_rare": float(rms_TLE[load_TLE <= lo].mean()), "rms_busy": float(rms_TLE[load_TLE >= hi].mean()),
          "load_rare": float(load_TLE[load_TLE <= lo].mean()), "load_busy": float(load_TLE[load_TLE >= hi].mean()),
          "zero_frac": float(zero.mean()), "rms_zero": float(rms_TLE[zero].mean()) if zero.any() else math.nan,
          "corr_load_rms": float(np.corrcoef(load_TLE.ravel(), rms_TLE.ravel())[0, 1]),
          "corr_gnorm_rms": float(np.corrcoef(g_TLE.ravel(), rms_TLE.ravel())[0, 1]),
          "scatter": [load_TLE[::5].ravel().round(5).tolist(), rms_TLE[::5].ravel().round(5).tolist()]}


def model_config(cfg: Config):
  """The preset with the stress setting's overrides (QK-norm, logit statistics)."""
  over = {"logit_stats": cfg.logit_stats} | ({} if cfg.qk_norm is None else {"qk_norm": cfg.qk_norm})
  return preset(cfg.model, **over)


def run_arm(arm: str, lr: float, seed: int, cfg: Config, tokens, val) -> dict:
  c = model_config(cfg)
  model = Transformer(c, rngs=nnx.Rngs(seed))
  tx = make_tx(arm, lr, cfg.steps, weight_decay=cfg.weight_decay, fallback_lr=cfg.fallback_lr,
               clip_threshold=cfg.clip_threshold)
  t0 = time.perf_counter()
  fitted = common.fit(model, tx, tokens, steps=cfg.steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed,
                      val=val, eval_every=cfg.eval_every, metrics=expert_metrics,
                      update_args=optim.needs("muonclip", {}).update_args if c.logit_stats else ())
  d, f = c.d_model, c.moe.d_expert or c.d_ff
  out = {"arm": arm, "lr": lr, "seed": seed, "seconds": time.perf_counter() - t0,
         **summarize_run(fitted.records, arm, lr, cfg, n_elem=3 * d * f)}
  out["diverged"] = not (np.all(np.isfinite(out["loss"])) and np.isfinite(out["final_val_loss"]))
  logit = f"  max logit {out['max_logit']:.1f}" if "max_logit" in out else ""
  print(f"{arm:>16} lr {lr:<6g} seed {seed}: val {out['final_val_loss']:.4f}  spikes {out['spikes']}  "
        f"max jump {out['max_jump']:.2f}  expert RMS {out['rms_mean']:.4f}{logit}  ({out['seconds']:.0f} s)",
        flush=True)
  return out


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.stress:
    cfg = stress_config(cfg)
  if cfg.smoke:
    cfg = smoke_config(cfg)
  for arm in cfg.arms:
    if arm not in ARMS:
      raise MuonMoEError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
  c = model_config(cfg)
  if c.moe is None:
    raise MuonMoEError(f"model {cfg.model!r} has no experts; use an MoE preset such as moe_tiny")
  if "muonclip" in cfg.arms and (c.qk_norm or not c.logit_stats):
    raise MuonMoEError("the muonclip arm needs --qk-norm False and --logit-stats (QK-norm undoes the clip; the clip "
                       "reads the logits): use --stress")
  tokens, val = common.corpus_and_val(cfg.batch_size, cfg.seq_len, cfg.eval_batches)
  t0, cpu0 = time.perf_counter(), time.process_time()
  score = lambda r: math.inf if r["diverged"] else r["final_val_loss"]
  done = {(r["arm"], r["lr"], r["seed"]): r for r in (common.load_partial(cfg) or {}).get("runs", [])}

  def run(arm, lr, seed):  # each finished run is kept in OUT/partial.json: an interrupted study resumes
    if (arm, lr, seed) not in done:
      done[arm, lr, seed] = run_arm(arm, lr, seed, cfg, tokens, val)
      if not cfg.smoke:
        common.save_partial(cfg, runs=list(done.values()))
    return done[arm, lr, seed]

  with compile_once():
    runs = [run(arm, lr, cfg.seeds[0]) for arm in cfg.arms for lr in cfg.lrs]
    for arm in cfg.arms:
      edge = past_edge({r["lr"]: score(r) for r in runs if r["arm"] == arm}) if cfg.extend_edge else None
      if edge is not None:
        runs.append(run(arm, edge, cfg.seeds[0]))
    best = {arm: min((r for r in runs if r["arm"] == arm), key=score)["lr"] for arm in cfg.arms}
    runs += [run(arm, best[arm], seed) for arm in cfg.arms for seed in cfg.seeds[1:]]
    runs += [run(arm, lr, seed) for arm in cfg.arms for lr in cfg.also_lrs for seed in cfg.seeds
             if (arm, lr, seed) not in {(r["arm"], r["lr"], r["seed"]) for r in runs}]
  E, d, f = c.moe.num_experts, c.d_model, c.moe.d_expert or c.d_ff
  arms = {}
  for arm in cfg.arms:
    rs = [r for r in runs if r["arm"] == arm and r["lr"] == best[arm]]
    stat = lambda k: common.mean_std(r[k] for r in rs)
    arms[arm] = {"best_lr": best[arm], "seeds": [r["seed"] for r in rs], "val": stat("final_val_loss"),
                 "spikes": sum(r["spikes"] for r in rs), "max_jump": float(np.nanmax([r["max_jump"] for r in rs])),
                 "rms": stat("rms_mean"), "rms_spread": stat("rms_std_over_experts"),
                 "rms_rare": stat("rms_rare"), "rms_busy": stat("rms_busy"), "load_rare": stat("load_rare"),
                 "load_busy": stat("load_busy"), "rms_zero": stat("rms_zero"), "zero_frac": stat("zero_frac"),
                 "corr_load_rms": stat("corr_load_rms"), "val_by_seed": [r["final_val_loss"] for r in rs],
                 "corr_gnorm_rms": stat("corr_gnorm_rms"), "predicted_rms": predicted_rms(arm, E, d, f),
                 "grid_spikes": sum(r["spikes"] for r in runs if r["arm"] == arm)}
    arms[arm]["at"] = {}
    for lr in cfg.also_lrs:
      at = [r for r in runs if r["arm"] == arm and r["lr"] == lr]
      m = lambda k: common.mean_std(r[k] for r in at)
      arms[arm]["at"][lr] = {"val": m("final_val_loss"), "spikes": sum(r["spikes"] for r in at),
                             "val_by_seed": [r["final_val_loss"] for r in at],
                             **({"max_logit": m("max_logit"), "steps_above_tau": m("steps_above_tau")}
                                if "max_logit" in at[0] else {})}
    if "max_logit" in rs[0]:
      arms[arm] |= {"max_logit": stat("max_logit"), "final_max_logit": stat("final_max_logit"),
                    "steps_above_tau": stat("steps_above_tau"),
                    "grid_max_logit": float(max(r["max_logit"] for r in runs if r["arm"] == arm))}
  settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("smoke", "out")}
  result = {"settings": settings, "tokens_per_run": cfg.steps * cfg.batch_size * cfg.seq_len, "arms": arms,
            "runs": runs, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - cpu0,
            "shape": {"E": E, "d_model": d, "d_expert": f}}
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


# --- report ------------------------------------------------------------------------------------------------------

def plot(result: dict):
  """Train loss per arm at its best lr (mean over seeds, 10-step moving average), val loss vs lr, and every
  expert's direction RMS vs its load (seed 0, best lr, every 5th step after warmup)."""
  import matplotlib.pyplot as plt
  logits = any("max_logit" in a for a in result["arms"].values())
  fig, axes = plt.subplots(1, 4 if logits else 3, figsize=(20 if logits else 15, 4.2))
  ax0, ax1, ax2 = axes[:3]
  colors = dict(zip(ARMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  for arm, a in result["arms"].items():
    rs = [r for r in result["runs"] if r["arm"] == arm and r["lr"] == a["best_lr"]]
    loss = np.mean([r["loss"] for r in rs], axis=0)
    k = min(10, len(loss))
    ax0.plot(np.arange(k, len(loss) + 1), np.convolve(loss, np.ones(k) / k, "valid"), color=colors[arm],
             label=f"{arm} (lr {a['best_lr']:g})")
    grid = sorted((r["lr"], r["final_val_loss"]) for r in result["runs"] if r["arm"] == arm
                  and r["seed"] == result["settings"]["seeds"][0])
    ax1.plot(*zip(*grid), "o-", color=colors[arm], label=arm)
    r0 = rs[0]
    ax2.scatter(*r0["scatter"], s=4, alpha=0.4, color=colors[arm], label=arm)
    if logits:
      axes[3].plot(np.arange(1, len(r0["logit_curve"]) + 1), r0["logit_curve"], color=colors[arm], lw=0.8,
                   label=f"{arm} (lr {a['best_lr']:g}, seed {r0['seed']})")
  ax0.set(xlabel="step", ylabel="train loss (nats/byte), 10-step mean", title="loss at each arm's best lr")
  ax0.set_ylim(top=min(ax0.get_ylim()[1], 4.0))
  ax1.set(xscale="log", xlabel="peak lr", ylabel="final val loss", title="lr grid (seed 0)")
  E = result["shape"]["E"]
  ax2.axhline(INTENDED_RMS, color="k", lw=0.8, ls="--", label="Moonlight target 0.2")
  ax2.axvline(1 / E, color="gray", lw=0.8, ls=":")
  ax2.set(xlabel="expert load f_e (share of top-k assignments)", ylabel="expert update RMS (lr, wd removed)",
          yscale="log", title="per-expert update size vs load")
  if logits:
    axes[3].axhline(result["settings"]["clip_threshold"], color="k", lw=0.8, ls="--", label="τ (muonclip)")
    axes[3].set(xlabel="step", ylabel="max attention logit (over layers, heads, batch)", yscale="log",
                title="attention logits at each arm's best lr")
  for ax in axes:
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def table(result: dict) -> list[str]:
  lines = ["| arm | best lr | final val loss | spikes (best lr / grid) | max jump | expert RMS (measured) | "
           "predicted | RMS rare / busy experts (load) | RMS of zero-token experts (share) | corr(load, RMS) | "
           "corr(‖g_e‖, RMS) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for arm, a in result["arms"].items():
    pred = "—" if a["predicted_rms"] is None else f"{a['predicted_rms']:.4f}"
    rare, busy = a["rms_rare"][0], a["rms_busy"][0]
    lines.append(f"| {arm} | {a['best_lr']:g} | {common.pm(a['val'])} | {a['spikes']} / {a['grid_spikes']} | "
                 f"{a['max_jump']:.2f} | {common.pm(a['rms'])} | {pred} | {rare:.4f} / {busy:.4f} = {rare / busy:.2f}× "
                 f"({a['load_rare'][0]:.3f} / {a['load_busy'][0]:.3f}) | {a['rms_zero'][0]:.4f} "
                 f"({a['zero_frac'][0]:.1%}) | {common.pm(a['corr_load_rms'], digits=2)} | "
                 f"{common.pm(a['corr_gnorm_rms'], digits=2)} |")
  if any("max_logit" in a for a in result["arms"].values()):
    tau = result["settings"]["clip_threshold"]
    lines += ["", f"| arm | best lr | max attention logit over the run | final max logit | steps with max logit > "
              f"τ = {tau:g} | max logit over the lr grid |", "|---|---|---|---|---|---|"]
    for arm, a in result["arms"].items():
      lines.append(f"| {arm} | {a['best_lr']:g} | {common.pm(a['max_logit'], digits=1)} | "
                   f"{common.pm(a['final_max_logit'], digits=1)} | {common.pm(a['steps_above_tau'], digits=0)} | "
                   f"{a['grid_max_logit']:.1f} |")
  for lr in result["settings"]["also_lrs"]:
    lines += ["", f"| arm at lr {lr:g} (all seeds) | final val loss | spikes | max attention logit over the run | "
              f"steps with max logit > τ |", "|---|---|---|---|---|"]
    for arm, a in result["arms"].items():
      at = a["at"][str(lr)] if str(lr) in a["at"] else a["at"][lr]
      logit = (f"{common.pm(at['max_logit'], digits=1)} | {common.pm(at['steps_above_tau'], digits=0)}"
               if "max_logit" in at else "— | —")
      lines.append(f"| {arm} | {common.pm(at['val'])} | {at['spikes']} | {logit} |")
  lines += ["", "| arm | lr | seed | final val loss | spikes | max jump | expert RMS |",
            "|---|---|---|---|---|---|---|"]
  for r in sorted(result["runs"], key=lambda r: (ARMS.index(r["arm"]), r["lr"], r["seed"])):
    val = "diverged" if r["diverged"] else f"{r['final_val_loss']:.4f}"
    lines.append(f"| {r['arm']} | {r['lr']:g} | {r['seed']} | {val} | {r['spikes']} | "
                 f"{r['max_jump']:.2f} | {r['rms_mean']:.4f} |")
  return lines


def findings(result: dict) -> list[str]:
  """The "Reading:" lines, every number computed from the result."""
  a, st = result["arms"], result["settings"]
  n = len(st["seeds"])
  ranked = sorted(a, key=lambda k: a[k]["val"][0])
  paired = []
  for k in ranked[1:]:  # same seed = same init and batches: differences paired by seed
    diff = np.subtract(a[k]["val_by_seed"], a[ranked[0]]["val_by_seed"])
    m, sd = common.mean_std(diff)
    paired.append(f"{k} +{m:.3f} ± {sd:.3f} (higher in {int(np.sum(diff > 0))}/{len(diff)})")
  others = [a[k]["val"][0] for k in ranked[1:]]
  out = [f"Reading: final val loss ({n} seeds, each arm at its best lr): "
         + ", ".join(f"{k} {a[k]['val'][0]:.3f} ± {a[k]['val'][1]:.3f}" for k in ranked)
         + f". {ranked[0]} is lowest; paired by seed, the others are " + ", ".join(paired)
         + (f"; they span {max(others) - min(others):.3f} among themselves." if others else ".")]
  runs = result["runs"]
  worst = max(runs, key=lambda r: r["max_jump"] if np.isfinite(r["max_jump"]) else -math.inf)
  spikes = sum(r["spikes"] for r in runs)
  diverged = ", ".join(f"{r['arm']} lr {r['lr']:g} seed {r['seed']}" for r in runs if r["diverged"])
  out.append(f"Reading: {sum(r['diverged'] for r in runs)} of {len(runs)} runs diverged"
             f"{' (' + diverged + ')' if diverged else ''}; {spikes} loss spikes (train loss > {st['spike_ratio']}× "
             f"the median of the previous "
             f"{st['spike_window']} steps) in {len(runs)} runs"
             + (": " + ", ".join(f"{k} {a[k]['grid_spikes']}" for k in a if a[k]["grid_spikes"]) if spikes else "")
             + f"; the largest one-step jump was {worst['max_jump']:.2f}× ({worst['arm']}, lr {worst['lr']:g}, "
             f"seed {worst['seed']}).")
  rms = {k: a[k]["rms"][0] for k in a}
  if "per_expert" in a:
    ns = rms["per_expert"] / INTENDED_RMS
    parts = [f"per_expert {rms['per_expert']:.3f} = {INTENDED_RMS}×{ns:.2f} (quintic Newton–Schulz leaves singular "
             f"values below 1)"]
    for k in ("flat_stack", "moonlight_toy"):
      if k in a:
        parts.append(f"{k} {rms[k]:.3f} = {rms[k] / rms['per_expert']:.2f}× per_expert (exact-polar prediction "
                     f"{a[k]['predicted_rms']:.3f}, ×{ns:.2f} = {a[k]['predicted_rms'] * ns:.3f})")
    parts += [f"{k} {rms[k]:.3f}" for k in ("adamw_experts", "adam_at_muon_lr") if k in a]
    out.append("Reading: expert update RMS (lr and decay removed; Moonlight's target 0.2): " + "; ".join(parts)
               + ".")
  ratio = lambda k: a[k]["rms_rare"][0] / a[k]["rms_busy"][0]
  k0 = next(iter(a))
  assignments = st["batch_size"] * st["seq_len"] * 2  # top-2
  zero = ", ".join(f"{k} {a[k]['rms_zero'][0]:.3f}" for k in a if np.isfinite(a[k]["rms_zero"][0]))
  out.append(f"Reading: rarely-routed experts (each run's lowest load decile; {k0}: mean load "
             f"{a[k0]['load_rare'][0]:.3f}, ≈ {a[k0]['load_rare'][0] * assignments:.0f} of {assignments} top-2 "
             f"assignments, vs {a[k0]['load_busy'][0]:.3f} in the busiest decile) get "
             + ", ".join(f"{k} {ratio(k):.2f}×" for k in a) + " the busiest experts' update RMS"
             + (f"; experts that got no token at all in a step ({a[k0]['zero_frac'][0]:.1%} of {k0}'s expert-steps) "
                f"still moved by RMS {zero}" if zero else "") + ".")
  for lr in st["also_lrs"]:
    at = {k: a[k]["at"][lr] for k in a}
    logit = lambda k: f", max logit {at[k]['max_logit'][0]:.0f}" if "max_logit" in at[k] else ""
    line = (f"Reading: at lr {lr:g} ({n} seeds each): "
            + ", ".join(f"{k} val {common.pm(at[k]['val'], digits=3)}{logit(k)}, {at[k]['spikes']} spikes" for k in a))
    if "muonclip" in at and "per_expert" in at:
      diff = np.subtract(at["muonclip"]["val_by_seed"], at["per_expert"]["val_by_seed"])
      line += (f"; muonclip − per_expert, paired by seed: {common.pm(common.mean_std(diff), sign=True, digits=3)} "
               f"(lower in {int(np.sum(diff < 0))}/{len(diff)})")
    out.append(line + ".")
  return out


QUESTION = ("How should Muon treat a stacked expert weight (L, E, d_in, d_out)? Per-expert orthogonalization "
            "(`optim.muon`) vs a flattened stack (E·d_in, d_out) vs Moonlight-toy `view(E, -1)` vs AdamW on the "
            "experts vs Adam at Muon's lr on the experts (old optax fallback), on `moe_tiny` (E=8, top-2).")


STRESS_QUESTION = (" Stress setting (`--stress`): without QK-norm, at higher lrs and 5× the steps, do the attention "
                   "logits grow under Muon, and does MuonClip's QK-clip (τ = 100) keep them bounded and the loss "
                   "lower?")


def write(cfg: Config, result: dict):
  import matplotlib
  matplotlib.use("Agg")
  lines = table(result)
  question = QUESTION + (STRESS_QUESTION if cfg.logit_stats else "")
  common.write_results(cfg.out, "muon_on_moe", question, lines, findings=findings(result),
                       settings=result["settings"], data=result)
  fig = plot(result)
  fig.savefig(os.path.join(cfg.out, "muon_on_moe.png"), dpi=110)
  print("\n".join(lines))


if __name__ == "__main__":
  common.cli(main, Config)
