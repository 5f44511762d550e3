"""--freeze REGEX: the parameters whose path (`blocks/wq_DQ`, `embed_VD`, ...) matches stay fixed, and cost nothing
but their storage.

- No gradient: the train step differentiates the other parameters only (`frozen_mask` →
  `research.train.steps.step.value_and_grad_trained`), so XLA computes no frozen weight's gradient (no weight-gradient
  dot in the backward; activation gradients still flow through them to the layers below).
- No optimizer state and no update: `freeze(tx)` is `optax.partition` with `optax.set_to_zero` on them.
- Stored in --frozen-dtype (`store_frozen`): bfloat16 by default when fine-tuning (with --init-from), else float32;
  the forward reads them in the compute dtype. --peft's frozen base takes the same default
(`research.train.setup.build.resolved_peft`).
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from optim.trees import tree_bytes
from research.train.config.trainable import FreezeError, frozen_dtype, frozen_mask, saved_frozen_dtype

# FreezeError, frozen_mask, frozen_dtype and saved_frozen_dtype read the flags: they live with what a run trains
# (research/train/config/trainable.py) and are this module's too
__all__ = ["FreezeError", "freeze", "frozen_dtype", "frozen_mask", "frozen_summary", "saved_frozen_dtype",
           "store_frozen"]


def freeze(tx: optax.GradientTransformation, regex: str | None):
  """(tx, labels): `tx` on the parameters whose path does not match `regex`, `set_to_zero` (no state) on the rest."""
  mask = frozen_mask(regex)
  if mask is None:
    return tx, None

  def labels(params):
    return jax.tree.map(lambda f: "frozen" if f else "train", mask(params))

  return optax.partition({"train": tx, "frozen": optax.set_to_zero()}, labels), labels


def store_frozen(params: dict, shardings: dict, regex: str | None, dtype) -> dict:
  """`params` with the leaves `regex` freezes cast to `dtype` (their storage: they are read, never updated), each
  kept on its sharding."""
  mask = frozen_mask(regex)
  if mask is None:
    return params
  cast = lambda ps: jax.tree.map(lambda f, x: x.astype(dtype) if f else x, mask(ps), ps)
  return jax.jit(cast, out_shardings=shardings)(params)


def frozen_summary(params: dict, labels, tx_plain: optax.GradientTransformation, tx_frozen) -> str:
  """One line: what --freeze froze and the optimizer-state bytes it saved (state with and without freezing)."""
  lab = jax.tree.leaves(labels(params))
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
  n = sum(s for s, l in zip(sizes, lab) if l == "frozen")
  if not n:
    raise FreezeError("--freeze matches no parameter (paths look like blocks/wq_DQ, embed_VD, final_norm)")
  nbytes = lambda tx: tree_bytes(jax.eval_shape(tx.init, params))
  saved = nbytes(tx_plain) - nbytes(tx_frozen)
  frozen = [x for x, l in zip(jax.tree.leaves(params), lab) if l == "frozen"]
  dtypes = "/".join(sorted({str(x.dtype) for x in frozen}))
  return (f"froze {n:,} of {sum(sizes):,} parameters ({lab.count('frozen')} arrays, stored as {dtypes}: "
          f"{tree_bytes(frozen) / 2**20:.1f} MiB, no gradient); optimizer state {saved / 2**20:.1f} MiB smaller")
