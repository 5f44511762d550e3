"""A mixture of named corpora with per-source sampling weights that may change during training, and the dynamic
rule of "Dynamic Data Mixing Maximizes Instruction Tuning for Mixture-of-Experts" (Zhu, Dong, Qu, Ruan, Chen, Cheng,
NAACL 2025, arXiv 2406.11256; code Spico197/MoE-SFT).

  spec = parse_mix("dynamic", ["code", "docs", "text"])      # or "uniform", "size", "fixed:2,1,1", "dynamic:eta=10"
  mix = Mixture({name: loader}, seed=0, weights=spec.initial(sizes))
  x, y, sources = mix.batch(step)     # this process's rows of the step's batch, and each row's source index
  mix.set_weights(step, w)            # from `step` on (earlier steps keep the weights they were drawn with)
  mix.state()                         # {"segments": [[from_step, [w...]], ...]}: what a checkpoint stores

Rows. Row r of step t comes from source c_r, drawn i.i.d. from the weights in force at step t with
rng(seed, t, MIX_STREAM) (the code: `rng.choices(names, weights=prob_map)` per packed instance); its tokens are row r
of source c_r's own loader at step t (research/data/loader.py: any sampling, layout and process rows), so a row's
content does not depend on the other sources. Every step's batch is a pure function of (seed, t, the weights in force
at t): the weights' history (`segments`) is the whole sampler state, and a resumed run reads the same batches.

The dynamic rule (the paper's Algorithm 1, `src/callbacks.py::AdaptiveSamplingCallback` in the code), every `every`
steps: each source i's held-out batches are routed by the model and Ô_i is the last MoE layer's top-k load (tokens
per expert, normalised to sum 1); with δ_ij = ‖Ô_i − Ô_j‖₂ and Δ_i = (1/|D|) Σ_j δ_ij (δ_ii = 0 included),
  α = softmax(log w_{t−1} + η Δ),   w_t = ((1 − c) α + c/|D|) / Σ(…)
so a source whose routing differs most from the others' (least redundant) gains weight. Defaults are the code's:
η = 10, c = 0.05, every 100 steps, uniform initial weights. Pure NumPy; imports no jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from research.data.corpus import DataError

MIX_STREAM = 0x6D6978  # "mix": the row-source draws' own random stream
RULES = ("uniform", "size", "fixed", "dynamic")


@dataclasses.dataclass(frozen=True)
class MixSpec:
  """A parsed --mix: the rule, fixed weights (rule "fixed"), and the dynamic rule's η, c and update period."""
  rule: str
  names: tuple[str, ...]
  fixed: tuple[float, ...] | None = None
  eta: float = 10.0
  c: float = 0.05
  every: int = 100
  batches: int = 5  # held-out batches per source behind each Ô_i (the code's --max_eval_steps 5)

  def initial(self, sizes: dict[str, int]) -> np.ndarray:
    """The weights at step 0: uniform (also dynamic's start), proportional to each source's training tokens, or the
    fixed ones, normalised."""
    if self.rule == "fixed":
      w = np.asarray(self.fixed, np.float64)
    elif self.rule == "size":
      w = np.asarray([sizes[n] for n in self.names], np.float64)
    else:
      w = np.ones(len(self.names))
    return w / w.sum()


def parse_mix(text: str, names) -> MixSpec:
  """`--mix`: "uniform", "size", "fixed:W1,W2,..." (one non-negative weight per source, in --data's order, not all 0)
  or "dynamic[:eta=E,c=C,every=N,batches=K]". Anything else is refused in one line (DataError)."""
  names = tuple(names)
  rule, _, args = text.partition(":")
  if rule not in RULES:
    raise DataError(f"--mix {text!r}: the rule must be one of {', '.join(RULES)}")
  if rule in ("uniform", "size"):
    if args:
      raise DataError(f"--mix {rule} takes no arguments, got {text!r}")
    return MixSpec(rule, names)
  if rule == "fixed":
    try:
      w = tuple(float(x) for x in args.split(","))
    except ValueError:
      raise DataError(f"--mix {text!r}: fixed weights must be numbers, as fixed:2,1,1") from None
    if len(w) != len(names) or min(w) < 0 or not np.isfinite(w).all() or sum(w) <= 0:
      raise DataError(f"--mix {text!r}: give {len(names)} non-negative weights, not all 0, one per --data source "
                      f"({', '.join(names)})")
    return MixSpec(rule, names, fixed=w)
  options = {}
  for item in filter(None, args.split(",")):
    key, eq, value = item.partition("=")
    if key not in ("eta", "c", "every", "batches") or not eq:
      raise DataError(f"--mix {text!r}: dynamic takes eta=, c=, every=, batches= (e.g. dynamic:eta=10,c=0.05)")
    try:
      options[key] = int(value) if key in ("every", "batches") else float(value)
    except ValueError:
      raise DataError(f"--mix {text!r}: {key}={value!r} is not a number") from None
  spec = MixSpec(rule, names, **options)
  if not (spec.eta >= 0 and 0 <= spec.c <= 1 and spec.every >= 1 and spec.batches >= 1):
    raise DataError(f"--mix {text!r}: needs eta >= 0, 0 <= c <= 1, every >= 1 and batches >= 1")
  return spec


def dynamic_update(weights, loads, eta: float = 10.0, c: float = 0.05) -> np.ndarray:
  """One step of the paper's rule: `loads` (sources, experts) the per-source expert loads (normalised here to sum 1
  per source), `weights` the current ones."""
  w = np.asarray(weights, np.float64)
  o = np.asarray(loads, np.float64)
  o = o / o.sum(-1, keepdims=True)
  delta = np.sqrt(((o[:, None, :] - o[None, :, :]) ** 2).sum(-1)).mean(-1)  # Δ_i = mean_j ‖Ô_i − Ô_j‖₂
  with np.errstate(divide="ignore"):  # a weight of 0 stays 0 before the smoothing (log 0 = −inf)
    z = np.log(w) + eta * delta
  alpha = np.exp(z - z.max())
  alpha /= alpha.sum()
  new = (1 - c) * alpha + c / len(w)
  return new / new.sum()


class Mixture:
  """Step t -> this process's rows of the mixed batch of step t (see the module docstring). `loaders` maps each
  source's name to its loader (research/data/loader.py `Loader`, all with the same batch size, sequence length and
  process rows)."""

  def __init__(self, loaders: dict, *, seed: int, weights, segments: list | None = None):
    self.names = tuple(loaders)
    self.loaders = [loaders[n] for n in self.names]
    first = self.loaders[0]
    self.B, self.rows, self.seed = first.B, first.rows, seed
    if any(ld.B != self.B or ld.L != first.L or not np.array_equal(ld.rows, self.rows) for ld in self.loaders):
      raise DataError("the mixture's sources must share batch size, sequence length and rows")
    self.segments = [(int(s), self._checked(w)) for s, w in segments] if segments else [(0, self._checked(weights))]

  def _checked(self, w) -> np.ndarray:
    w = np.asarray(w, np.float64)
    if w.shape != (len(self.names),) or (w < 0).any() or not w.sum() > 0:
      raise DataError(f"mixture weights must be {len(self.names)} non-negative numbers, not all 0; got {w.tolist()}")
    return w / w.sum()

  def weights(self, step: int) -> np.ndarray:
    """The weights in force at `step` (the last segment starting at or before it)."""
    return [w for s, w in self.segments if s <= step][-1]

  def set_weights(self, step: int, weights):
    """`weights` from `step` on; a later segment (a resumed run that rewinds) is dropped."""
    self.segments = [(s, w) for s, w in self.segments if s < step] + [(int(step), self._checked(weights))]

  def sources(self, step: int) -> np.ndarray:
    """The source index of each of the B rows of step `step`'s global batch."""
    u = np.random.default_rng([self.seed, step, MIX_STREAM]).random(self.B)
    return np.minimum(np.searchsorted(np.cumsum(self.weights(step)), u, side="right"), len(self.names) - 1)

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, source index) of this process's rows of step `step`: row r is row r of its source's step-`step` batch."""
    mine = self.sources(step)[self.rows]
    x = np.empty((len(self.rows), self.loaders[0].L), np.int32)
    y = np.empty_like(x)
    for c in np.unique(mine):
      at = np.flatnonzero(mine == c)
      ld = self.loaders[c]
      epochs, ids = ld.records[step]
      xs, ys = ld.source.read(np.asarray(epochs)[self.rows[at]], np.asarray(ids)[self.rows[at]])
      x[at], y[at] = xs, ys
    return x, y, mine

  def state(self) -> dict:
    return {"segments": [[s, w.tolist()] for s, w in self.segments]}
