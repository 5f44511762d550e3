"""--spectra-every: the spectra of the hidden weight matrices' updates (Muon's claim is a near-orthogonal update), per
layer (per expert): the spectral norm (power iteration), the orthogonality error ||O^T O - I|| of the update scaled to
unit mean square singular value (0 when every singular value is equal, what Newton-Schulz aims at; an update with
decoupled weight decay includes lr*wd*W), singular-value quantiles (exact, or randomized for a large matrix) and the
effective rank; of the optimizer's momentum too where --watch names it.

The matrices are the leaves `optim.trees.is_hidden_matrix` selects (rank >= 2, not an embedding, head, norm or bias),
each a stack (..., fan_in, fan_out) whose leading axes (layers, experts) are kept. Records:
spectra/<tree>/<stat>/<leaf>, e.g. spectra/updates/spectral_norm/blocks/wq_DQ = [L values],
spectra/updates/sv_quantiles/<leaf> = [L x 5] (quantiles 0, .25, .5, .75, 1).
"""

from __future__ import annotations

import jax

from optim.diagnostics import spectra
from optim.trees import is_hidden_matrix, named_leaves
from research.train.observers import watch
from research.train.observers.registry import Observer, register


def matrices(tree, params) -> dict:
  """{leaf name: array} of the hidden weight matrices of `tree` (a flat dict by leaf name, or a tree like params)."""
  hidden = named_leaves(jax.tree_util.tree_map_with_path(is_hidden_matrix, params))
  return {k: x for k, x in named_leaves(tree).items() if hidden.get(k)}


def observe(result, held, section) -> dict:
  """The matrices, out of the step (`post` takes their spectra in a program of its own)."""
  wanted = ("updates",) + (("momentum",) if "momentum" in watch.watched(section) else ())
  return {f"{name}|{leaf}": w for name, tree in watch.trees(result, wanted).items()
          for leaf, w in matrices(tree, result.params).items()}


def post(values: dict, section) -> dict:
  """The spectra of the step's matrices. In a program apart from the step: inside it, with the step's other work, the
  full set of spectra on the tiny model's seven matrices hung XLA:CPU (jaxlib 0.10) while each part alone ran."""
  out = {}
  for key, w in values.items():
    name, leaf = key.split("|", 1)
    out.update({f"{name}/{stat}/{leaf}": v for stat, v in spectra.matrix_spectra({leaf: w})[leaf].items()})
  return out


SPECTRA = register(Observer(
    "spectra", frozenset({"params", "updates", "opt_state"}),
    "out of the step: a copy of each hidden matrix's update; then, in a program of its own, an eigendecomposition of "
    "each one's smaller Gram matrix",
    observe, every=lambda section: section.spectra_every, post=post))
