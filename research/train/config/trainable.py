"""What trains: one notion for the four mechanisms that leave parameters untrained.

`Trainable` says it for a run, from its flags (`of_run`) or from its config.json (`of_meta`, runs of every earlier
layout): --freeze's regex (those leaves fixed, stored in the frozen dtype), --freeze-layers' N (the bottom N layers
and the embedding fixed, a float32 master of the rest), --peft (the adapters only; the base a buffer) and a
block-coordinate optimizer's blockwise step (one layer at a time, a float32 master of it). The step builder
(`step`), the checkpoint restore (`stored`) and the resume check (`signature`) read it.
What does not combine with what is one table beside it (research/train/setup/clashes.py).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from optim.trees import path_name
from research.train.config import flat_record


class FreezeError(ValueError):
  """A --freeze that cannot be used."""


def pattern(regex: str) -> re.Pattern:
  """--freeze's regex compiled; FreezeError for one that is not a regular expression."""
  try:
    return re.compile(regex)
  except re.error as e:
    raise FreezeError(f"--freeze {regex!r} is not a regular expression ({e})") from None


def frozen_mask(regex: str | None):
  """A function of a parameter tree giving True for each leaf whose path matches `regex` (frozen), or None."""
  if not regex:
    return None
  compiled = pattern(regex)
  return lambda params: jax.tree_util.tree_map_with_path(lambda p, _: bool(compiled.search(path_name(p))), params)


def frozen_dtype(trains, init_from: str | None):
  """The storage dtype of --freeze's parameters: --frozen-dtype, else bfloat16 when fine-tuning (--init-from), else
  float32.

  Args:
    trains: the config's trains section (--frozen-dtype).
    init_from: --init-from (the weights section's), or None.

  Returns:
    The dtype.
  """
  return jnp.dtype(trains.frozen_dtype or ("bfloat16" if init_from else "float32"))


def saved_frozen_dtype(train: dict) -> str:
  """`frozen_dtype` of a run's recorded flags (config.json's "train"); runs from before --frozen-dtype stored
  float32."""
  if "frozen_dtype" not in train:
    return "float32"
  return train["frozen_dtype"] or ("bfloat16" if train.get("init_from") else "float32")


@dataclasses.dataclass(frozen=True)
class Trainable:
  """What a run trains (see the module docstring).

  Args:
    freeze: --freeze's regex: the leaves it matches are fixed (stored in `frozen_dtype`), or None.
    layers: --freeze-layers' N: layers 0..N-1 and the embedding fixed; every parameter stored in `dtype`.
    blockwise: a blockwise optimizer's step: one layer trains at a time; every parameter stored in `dtype`.
    adapters: --peft: only the adapters train (the base is a buffer of the state).
    dtype: the storage dtype of every parameter (blockwise, layers), or None: the parameters' own.
    frozen_dtype: the storage dtype of --freeze's leaves.
  """
  freeze: str | None = None
  layers: int = 0
  blockwise: bool = False
  adapters: bool = False
  dtype: str | None = None
  frozen_dtype: str = "float32"

  @classmethod
  def of_meta(cls, meta: dict) -> Trainable:
    """What a recorded run trains.

    Args:
      meta: its config.json (or a checkpoint's metadata), of any layout written before this class too.

    Returns:
      The run's `Trainable`.
    """
    train = flat_record(meta.get("train") or {})
    whole = meta.get("blockwise_badam") or meta.get("frozen_layers")
    layers = (meta.get("frozen_layers") or {}).get("n", 0)
    return cls(train.get("freeze"), layers, bool(meta.get("blockwise_badam")), bool(train.get("peft")),
               whole["dtype"] if whole else None, saved_frozen_dtype(train))

  @classmethod
  def of_run(cls, trains, init_from: str | None, blockwise: bool) -> Trainable:
    """What a run about to start trains.

    Args:
      trains: its config's trains section.
      init_from: its --init-from (the weights section's), or None.
      blockwise: whether its optimizer runs its blockwise step (`research.train.setup.blockwise.eligible` says so).

    Returns:
      The run's `Trainable`.
    """
    dtype = str(frozen_dtype(trains, init_from))
    return cls(trains.freeze, trains.freeze_layers, blockwise, bool(trains.peft),
               dtype if blockwise or trains.freeze_layers else None, dtype)

  @property
  def step(self) -> str:
    """The step that trains it: "blockwise", "layers" (--freeze-layers) or "plain" (full backprop, --freeze's mask
    and --peft's adapters included)."""
    return "blockwise" if self.blockwise else "layers" if self.layers else "plain"

  def stored(self, abstract_params: dict) -> dict:
    """The parameters as the run's checkpoints hold them (a restore reads them as written, so their checksums verify).

    Args:
      abstract_params: the model's abstract parameters (`jax.ShapeDtypeStruct`s).

    Returns:
      The same tree with every leaf in `dtype`, or --freeze's leaves in `frozen_dtype`.
    """
    if self.dtype is not None:
      return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(self.dtype)), abstract_params)
    mask = frozen_mask(self.freeze)
    if mask is None:
      return abstract_params
    dtype = jnp.dtype(self.frozen_dtype)
    return jax.tree.map(lambda f, a: jax.ShapeDtypeStruct(a.shape, dtype) if f else a, mask(abstract_params),
                        abstract_params)
