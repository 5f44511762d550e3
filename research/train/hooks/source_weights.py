"""--data NAME=PATH ... --mix RULE: the trainer's side of a data mixture (research/data/mixture.py).

  corpus = load_data(cfg.data, cfg.data_options)  # a Corpus, or a MixedCorpus of the named sources with --mix's rule
  mixing = Mixing(corpus, graphdef, val)
  mixing.update(r)                   # after a step: the dynamic rule's new weights every `every` steps
  rec.update(mixing.record(...))     # mix/<name>: the weights of the step's batch; val_loss/<name> at evaluations

Held-out data: each source's own val split, laid out as a single corpus's (`feed.held_out`), the sources' batches one
after the other; `val_loss` is their mean, so every source counts equally whatever the weights. The dynamic rule
reads the last MoE layer's top-k loads (`moe.router_stats` "load": each expert's share of the assignments) on the
first `batches` held-out batches of each source, the code's per-dataset dev data; its new weights apply from the
next step's batch, and the feed's saved state holds every change (`Mixture.segments`), so a resumed run reads the
batches the uninterrupted one would have.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from research.data import DataError, load_corpus
from research.data.mixture import MixedCorpus, dynamic_update, named_sources, parse_mix
from research.train.config import RunError
from research.train.config.prefixed import DataFlags
from research.train.config.sections import DataSection
from sharding.mesh import STAGE


def load_data(data: DataSection, options: DataFlags):
  """The run's data (the config's data section and --data.*): one corpus, or (named --data sources) a MixedCorpus
  sampled by --mix; refused in one line."""
  named = named_sources(data.paths)
  if named is None:
    if data.mix is not None:
      raise RunError("--mix mixes named --data sources: give them as NAME=PATH (--data code=src/ docs=d.jsonl)")
    return load_corpus(data.paths, tokenizer=data.tokenizer, field=options.field)
  spec = parse_mix(data.mix or "uniform", named)
  sources = {}
  for name, path in named.items():
    try:
      sources[name] = load_corpus(path, tokenizer=data.tokenizer, field=options.field)
    except DataError as e:
      raise DataError(f"--data {name}={path}: {e}") from None
  return MixedCorpus(sources, spec)


def check(corpus, mcfg, mesh):
  """The dynamic rule needs a router to read (an MoE model) and the plain forward (no pipeline mesh)."""
  if isinstance(corpus, MixedCorpus) and corpus.spec.rule == "dynamic":
    if mcfg.moe is None:
      raise RunError("--mix dynamic reads the router's expert loads: it needs an MoE model (--moe.num-experts N)")
    if mesh.shape[STAGE] > 1:
      raise RunError("--mix dynamic does not run on a pipeline (stage) mesh")


def router_loads(graphdef):
  """The jitted (params, buffers, tokens) -> the last MoE layer's expert loads (E,): what the dynamic rule reads."""
  return jax.jit(lambda p, b, x: nnx.merge(graphdef, p, b).forward(x)[1]["load"][-1])


def source_loads(loads, params, buffers, batches_by_source, k: int) -> list[np.ndarray]:
  """Ô_i for each source: its loads averaged over the first `k` of its held-out (x, y) batches."""
  return [np.mean([np.asarray(loads(params, buffers, x)) for x, _ in batches[:k]], 0) for batches in batches_by_source]


class Mixing:
  """A run's mixture: its per-source held-out slices, the weights it logs, the dynamic rule's updates (inactive
  for one corpus)."""

  def __init__(self, corpus, graphdef, val: list):
    self.on = isinstance(corpus, MixedCorpus)
    if not self.on:
      return
    self.names, self.spec = list(corpus.sources), corpus.spec
    n = len(val) // len(self.names)  # --eval-batches per source
    self.slices = {name: slice(i * n, (i + 1) * n) for i, name in enumerate(self.names)}
    self.scoring = min(self.spec.batches, n)
    if self.spec.rule == "dynamic":
      self.loads = router_loads(graphdef)

  def record(self, feed, step: int, losses: list | None) -> dict:
    """mix/<name>: the weights step `step` was drawn with; val_loss/<name> when the held-out `losses` (one per
    batch, the sources' in order) are given."""
    if not self.on:
      return {}
    rec = {f"mix/{n}": float(w) for n, w in zip(self.names, feed.weights(step - 1))}
    if losses is not None:
      rec.update({f"val_loss/{n}": float(np.mean(losses[s])) for n, s in self.slices.items()})
    return rec

  def update(self, r):
    """Every `every` steps of --mix dynamic: the per-source loads, the rule, the new weights from the next batch."""
    if not self.on or self.spec.rule != "dynamic" or r.step % self.spec.every:
      return
    params, buffers = r.syncer.model(r.state).params, r.state.model_buffers
    loads = source_loads(self.loads, params, buffers, [r.layout.val[s] for s in self.slices.values()], self.scoring)
    r.feed.set_weights(r.step, dynamic_update(r.feed.weights(r.step - 1), loads, self.spec.eta, self.spec.c))
