"""A mixture of named corpora with per-source sampling weights that may change during training, and the dynamic
rule of "Dynamic Data Mixing Maximizes Instruction Tuning for Mixture-of-Experts" (Zhu, Dong, Qu, Ruan, Chen, Cheng,
NAACL 2025, arXiv 2406.11256; code Spico197/MoE-SFT).

  spec = parse_mix("dynamic", ["code", "docs", "text"])      # or "uniform", "size", "fixed:2,1,1", "dynamic:eta=10"
  corpus = MixedCorpus({"code": load_corpus(a), ...}, spec)  # what the trainer reads (`--data code=A docs=B ...`)
  mix = Mixture({name: loader}, seed=0, weights=spec.initial(sizes))
  x, y, sources = mix.batch(step)     # this process's rows of the step's batch, and each row's source index
  mix.set_weights(step, w)            # from `step` on (earlier steps keep the weights they were drawn with)
  mix.state()                         # {"segments": [[from_step, [w...]], ...]}: what a checkpoint stores

Rows. Row r of step t comes from source c_r, drawn i.i.d. from the weights in force at step t with
rng(seed, t, MIX_STREAM) (the code: `rng.choices(names, weights=prob_map)` per packed instance); its tokens are row r
of source c_r's own loader at step t (research/data/loader.py: any sampling, layout and process rows), so a row's
content does not depend on the other sources. Every step's batch is a pure function of (seed, t, the weights in force
at t): the weights' history (`segments`) is the whole sampler state, and a resumed run reads the same batches.

The dynamic rule (the paper's Algorithm 1; the code's `src/callbacks.py::AdaptiveSamplingCallback`), every `every`
steps: each source i's held-out batches are routed by the model and Ô_i is the last MoE layer's top-k load (tokens
per expert, normalised to sum 1); with δ_ij = ‖Ô_i − Ô_j‖₂ and Δ_i = (1/|D|) Σ_j δ_ij (δ_ii = 0 included),
  α = softmax(log w_{t−1} + η Δ),   w_t = ((1 − c) α + c/|D|) / Σ(…)
so a source whose routing differs most from the others' (least redundant) gains weight; with two sources Δ_1 = Δ_2
(δ is symmetric) and the weights never move, so the rule needs three or more. Defaults are the code's:
η = 10, c = 0.05, every 100 steps, uniform initial weights. Pure NumPy; imports no jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import grain
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
  options: dict[str, Any] = {}
  for item in filter(None, args.split(",")):
    key, eq, value = item.partition("=")
    if key not in ("eta", "c", "every", "batches") or not eq:
      raise DataError(f"--mix {text!r}: dynamic takes eta=, c=, every=, batches= (e.g. dynamic:eta=10,c=0.05)")
    try:
      options[key] = int(value) if key in ("every", "batches") else float(value)
    except ValueError:
      raise DataError(f"--mix {text!r}: {key}={value!r} is not a number") from None
  spec = MixSpec(rule, names, **options)
  if len(names) < 3:  # Δ_i = (1/|D|) Σ_j δ_ij is the same for both of two sources (δ is symmetric)
    raise DataError(f"--mix dynamic needs at least 3 sources: with {len(names)} the redundancy scores are equal and "
                    f"the weights never move")
  if not (0 <= spec.eta < np.inf and 0 <= spec.c <= 1 and spec.every >= 1 and spec.batches >= 1):
    raise DataError(f"--mix {text!r}: needs a finite eta >= 0, 0 <= c <= 1, every >= 1 and batches >= 1")
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

  def restored(self, segments) -> list:
    """Saved segments ([[from_step, [w...]], ...]) checked against this mixture's sources."""
    return [(int(s), self._checked(w)) for s, w in segments]


def named_sources(entries) -> dict[str, str] | None:
  """{name: path} of --data entries written NAME=PATH (one entry may hold several, comma-separated: a=X,b=Y), in
  order; None when no entry names its source. Refuses (DataError) named and unnamed entries together, an empty name
  or path, and a name given twice."""
  if not entries:
    return None
  items: list[str] = []
  for entry in entries:
    parts = entry.split(",") if all("=" in p for p in entry.split(",")) else [entry]
    items += parts
  named = [p for p in items if "=" in p and not p.startswith(("/", ".", "~"))]
  if not named:
    return None
  if len(named) != len(items):
    raise DataError(f"--data: name every source (NAME=PATH) or none; got {', '.join(items)}")
  out = {}
  for item in named:
    name, _, path = item.partition("=")
    if not name or not path or not name.replace("_", "").replace("-", "").isalnum():
      raise DataError(f"--data {item!r}: a source is NAME=PATH, NAME letters, digits, - or _")
    if name in out:
      raise DataError(f"--data: the source name {name!r} is given twice")
    out[name] = path
  return out


@dataclasses.dataclass(frozen=True)
class MixedCorpus:
  """Named corpora trained on as one mixture, sampled by `spec`: the trainer reads it where it reads one `Corpus`."""
  sources: dict  # name -> Corpus, in --data's order
  spec: MixSpec

  @property
  def vocab_size(self) -> int:
    return max(c.vocab_size for c in self.sources.values())

  @property
  def fingerprint(self) -> str:
    return hashlib.sha256(json.dumps([[n, c.fingerprint] for n, c in self.sources.items()]).encode()).hexdigest()

  @property
  def source(self) -> str:
    return "mixture(" + ", ".join(f"{n}={c.source}" for n, c in self.sources.items()) + ")"

  def sizes(self) -> dict[str, int]:
    return {n: int(len(c.train)) for n, c in self.sources.items()}

  def record(self) -> dict:
    """config.json's "corpus" of a mixture: each source's, the rule, and the fingerprint over them."""
    val = sum(int(len(c.val)) for c in self.sources.values())
    return {"source": self.source, "fingerprint": self.fingerprint, "mix": dataclasses.asdict(self.spec),
            "train_tokens": sum(self.sizes().values()), "val_tokens": val,
            "sources": {n: {"source": c.source, "fingerprint": c.fingerprint, "train_tokens": int(len(c.train)),
                            "val_tokens": int(len(c.val))} for n, c in self.sources.items()}}


class MixedLoader:
  """A `Loader`'s interface (`batch`, `iterator`) over a `Mixture`: the trainer's feed reads it unchanged, and its
  iterator state carries the weights' history."""

  def __init__(self, mixture: Mixture, workers: int = 2):
    self.mixture, self.workers = mixture, workers
    self.dataset = grain.MapDataset.range(2 ** 62).map(lambda t: self.mixture.batch(t)[:2])

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    return self.dataset[step]

  def iterator(self, state: dict | None = None, start: int = 0):
    """Batches from step `start` (or a saved state: its step and the weights' history) on `workers` threads."""
    if state is not None and "mixture" in state:
      self.mixture.segments = self.mixture.restored(state["mixture"])
    options = grain.ReadOptions(num_threads=self.workers, prefetch_buffer_size=2 * self.workers)
    it = iter(self.dataset.to_iter_dataset(options))
    it.set_state({"next_index": state["next_index"] if state is not None else start})
    return _MixedIterator(it, self.mixture)


class _MixedIterator:
  def __init__(self, it, mixture: Mixture):
    self.it, self.mixture = it, mixture

  def __next__(self):
    return next(self.it)

  def get_state(self) -> dict:
    return {**self.it.get_state(), "mixture": self.mixture.state()["segments"]}

  def close(self):
    close = getattr(self.it, "close", None)
    if close is not None:
      close()
