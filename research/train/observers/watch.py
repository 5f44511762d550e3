"""--watch: per-layer statistics of what the step read and wrote (Levanter's `WatchConfig`, nanodo's per-leaf
metrics), split along the logical `layers` and `expert` axes: for each watched tree (params, grads, updates, the
optimizer's momentum) the RMS and Frobenius norm of every leaf per layer (per expert), with updates the relative update
||dW|| / ||W|| ("Muon is Scalable" matches AdamW's update RMS), and with --histograms a log10|x| histogram per leaf.

Records: watch/<tree>/<stat>/<leaf> = a number per layer (per layer and expert), e.g.
watch/updates/rms/blocks/wq_DQ = [L values]; watch/relative_update/<leaf>; watch/<tree>/hist/<leaf> = 32 counts.
"""

from __future__ import annotations

import jax
import optax

from optim.diagnostics import layers
from optim.trees import named_leaves, path_name
from research.train.observers.registry import Observer, register

TREES = ("params", "grads", "updates", "momentum")
_MOMENTUM_NAMES = ("mu", "momentum")


def watched(section) -> tuple[str, ...]:
  """--watch's trees, comma- or space-separated, in `TREES` order; ValueError naming an unknown one."""
  names = {n.strip() for item in section.watch for n in item.split(",") if n.strip()}
  unknown = names - set(TREES)
  if unknown:
    raise ValueError(f"--watch {','.join(sorted(unknown))}: choose from {', '.join(TREES)}")
  return tuple(t for t in TREES if t in names)


def momentum(opt_state, params) -> dict:
  """The optimizer's first moment, by leaf name: the leaves of every state field named "mu" or "momentum" whose
  shape is that parameter's (a partitioned optimizer keeps each group's under its own transform; masked-out leaves are
  skipped). {} when the optimizer keeps none."""
  shapes = {path_name(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  found = {}
  for key in _MOMENTUM_NAMES:
    for _, sub in optax.tree_utils.tree_get_all_with_path(opt_state, key):
      for p, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
        name = path_name(p)
        if name in shapes and getattr(x, "shape", None) == shapes[name] and name not in found:
          found[name] = x
  return found


def trees(result, names: tuple[str, ...]) -> dict:
  """{tree name: tree} of the watched trees of a step's result."""
  get = {"params": lambda: result.params, "grads": lambda: result.grads, "updates": lambda: result.updates,
         "momentum": lambda: momentum(result.opt_state, result.params)}
  return {n: get[n]() for n in names}


def axes_by_name(result) -> dict:
  """{leaf name: its logical axis names} of the trained tree (the probe's), {} where unknown."""
  if result.probe is None or result.probe.axes is None:
    return {}
  tree = result.probe.axes()
  return {path_name(p): n for p, n in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda n: isinstance(n, tuple))[0]}


def observe(result, held, section) -> dict:
  names = axes_by_name(result)
  out = {}
  for name, tree in trees(result, watched(section)).items():
    flat = named_leaves(tree)
    axes = {k: names.get(k) for k in flat}
    for leaf, stats in layers.tree_stats(flat, axes).items():
      for stat, value in stats.items():
        out[f"{name}/{stat}/{leaf}"] = value
    if section.histograms:
      out.update({f"{name}/hist/{leaf}": h for leaf, h in layers.histograms(flat).items()})
    if name == "updates":
      params = named_leaves(result.params)
      out.update({f"relative_update/{leaf}": v for leaf, v in
                  layers.relative_update(flat, {k: params[k] for k in flat}, axes).items()})
  return out


WATCH = register(Observer(
    "watch", frozenset({"params", "grads", "updates", "opt_state"}),
    "two reductions per watched leaf (a pass over each watched tree), ~0.1 step for three trees",
    observe, every=lambda section: section.watch_every if section.watch else 0,
    check=lambda section, batch_size: watched(section)))
