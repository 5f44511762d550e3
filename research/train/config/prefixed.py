"""The config sections with a flag prefix of their own: --moe.* (`MoEFlags`, each flag one field of the preset's MoE,
but for PAD-Net's partition flags, `MoEFlags.PARTITION`), --data.* (`DataFlags`, how --data's records become rows)
and --peft.* (`PeftFlags`: the settings every adapter method reads, then each registered method's own options,
`models.peft.Adapter.OPTIONS`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, ClassVar, Literal

import jax.numpy as jnp
import tyro

from models import MoEConfig, peft
from research.train.config.derived import flags_of, optional_flag


def _model_fields(self) -> dict:
  """{field: value} of the MoEConfig fields these flags set (unset ones and the partition's left out)."""
  return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.PARTITION and v is not None}


PAD_BATCHES = 4  # --moe.pad-batches unset: the batches PAD-Net's partition scores at step 0


def _partition(self) -> dict | None:
  """`models.padnet.partition`'s settings the flags ask for at step 0, defaults filled in; None without a
  --moe.pad-ratio below 1."""
  if not self.pad or self.pad_ratio is None or self.pad_ratio >= 1:
    return None
  return {"ratio": self.pad_ratio, "rounds": self.pad_rounds or 5, "batches": self.pad_batches or PAD_BATCHES,
          "schedule": self.pad_schedule or "exponential", "scope": self.pad_scope or "global"}


# the flags that set no MoEConfig field: what research/train/setup/padnet.py does at step 0
_PARTITION = (
    ("pad_ratio", float, "PAD-Net: the final dynamic share r in (0, 1]; r < 1 runs Iterative Mode Partition at step 0 "
                         "of a new run, before the first update (unset or 1: no partition, every entry dynamic). "
                         "Needs --moe.pad."),
    ("pad_rounds", int, "IMP rounds T >= 1 (unset: 5). Needs --moe.pad-ratio."),
    ("pad_batches", int, f"The first training batches IMP scores |dL/dM| on, summed (unset: {PAD_BATCHES}). Needs "
                         "--moe.pad-ratio."),
    ("pad_schedule", Literal["exponential", "linear"], "Each round's dynamic share: r^(t/T), or 1 - (1 - r) t/T "
                                                       "(unset: exponential). Needs --moe.pad-ratio."),
    ("pad_scope", Literal["global", "local"], "One ranking over every expert matrix of the model, or one per expert "
                                              "matrix (unset: global). Needs --moe.pad-ratio."))
# one flag per field of models.MoEConfig (its schema: models/schema.py), then the partition's
MoEFlags = flags_of(
    MoEConfig, "MoEFlags", __name__,
    last=tuple(optional_flag(*flag) for flag in _PARTITION),
    namespace={"PARTITION": tuple(name for name, _, _ in _PARTITION),
               "PREFIX": "moe.",  # the flags' spelling in research/train/setup/checks.py's messages
               "POSITIVE": ("pad_rounds", "pad_batches"), "RANGES": {"pad_ratio": (0, 1, False)},
               # flag: the flag it needs
               "NEEDS": {"pad_ratio": "pad", **{name: "pad_ratio" for name, _, _ in _PARTITION[1:]}},
               "model_fields": _model_fields, "partition": _partition},
    doc="Mixture of experts in every block: each flag overrides one field of the preset's MoE (see "
        "models.MoEConfig). On a dense preset, --moe.num-experts turns it into an MoE; --moe.num-experts 0 makes an "
        "MoE preset dense.")
if typing.TYPE_CHECKING:  # a derived class: its flags are MoEConfig's fields and the partition's
  class MoEFlags:  # type: ignore[no-redef]  # noqa: D101
    PARTITION: ClassVar[tuple]

    def __init__(self, **flags: Any): ...
    def __getattr__(self, name: str) -> Any: ...
    def model_fields(self) -> dict: ...  # noqa: D102
    def partition(self) -> dict | None: ...  # noqa: D102


@dataclasses.dataclass
class DataFlags:
  """How --data's records become training rows (--data.field, --data.layout, --data.workers)."""
  PREFIX: ClassVar[str] = "data."
  RANGES: ClassVar[dict] = {"workers": (0, None, True)}  # a thread count; 0 reads in the loop
  field: str = "text"
  """The column (Parquet, Arrow) or key (JSON Lines) holding each document's text."""
  layout: Literal["windows", "pack", "pad"] = "windows"
  """What a row holds (research/data/records.py): windows (seq_len + 1 tokens anywhere in the token stream:
  pretraining), pack (the documents in an order drawn per epoch, joined by their end-of-text tokens, cut into rows),
  or pad (one document per row from its start, split when longer, padded when shorter, the loss masked on the
  padding: fine-tuning data). The held-out batches are laid out the same way."""
  workers: int = 2
  """Background threads that read and assemble batches ahead of the step (grain's prefetch; 0: in the loop)."""


def _apply_options(self) -> dict:
  """Keyword arguments of `models.peft.apply` for these flags (the base dtype as a dtype)."""
  opts = dataclasses.asdict(self)
  opts["base_dtype"] = None if self.base_dtype is None else jnp.dtype(self.base_dtype)
  return opts


def _adapted(self, base, method: str, seed: int):
  """`base` adapted in place by `method` with these flags (`models.peft.apply`)."""
  return peft.apply(base, method, **self.apply_options(), seed=seed)


def _common() -> list:
  """The settings every method reads (--peft.rank, --peft.alpha, --peft.targets, --peft.base-dtype)."""
  arg = lambda kind, default, doc: (Annotated[kind, tyro.conf.arg(help=doc)], dataclasses.field(default=default))
  return [
      ("rank", *arg(int, 8, "Adapter rank r (a method that prunes: the budget, its adapter wider before pruning).")),
      ("alpha", *arg(float, 16.0, "alpha: the low-rank update is (alpha / r)·A B.")),
      ("targets", *arg(str, peft.DEFAULT_TARGETS, "Regular expression searched in parameter paths (blocks/wq_DQ, "
                                                  "blocks/moe/w_up_EDF, ...): the weights to adapt; the default names "
                                                  "the attention q/k/v/o and the MLP, expert and shared-expert "
                                                  "projections.")),
      ("base_dtype", *arg(Literal["float32", "bfloat16"] | None, None,
                          "The frozen base weights' dtype (unset: --frozen-dtype's default, bfloat16 when fine-tuning "
                          "with --init-from, else float32); the adapters keep the parameter dtype."))]


def _own() -> list:
  """One flag per option a registered method declares (`models.peft.Adapter.OPTIONS`), its help naming the method."""
  fields: dict = {}
  for method, cls in peft.ADAPTERS.items():
    for name, (default, doc) in cls.OPTIONS.items():
      fields.setdefault(name, (name, Annotated[type(default), tyro.conf.arg(help=f"{method}: {doc}")],
                               dataclasses.field(default=default)))
  return list(fields.values())


if typing.TYPE_CHECKING:  # a derived class: the common settings and the methods' options
  @dataclasses.dataclass
  class PeftFlags:  # noqa: D101
    base_dtype: str | None

    def __init__(self, **flags: Any): ...
    def __getattr__(self, name: str) -> Any: ...
    def apply_options(self) -> dict: ...  # noqa: D102
    def adapted(self, base: Any, method: str, seed: int) -> Any: ...  # noqa: D102
else:  # --peft.*: the settings every method reads, then each registered method's own options
  PeftFlags = dataclasses.make_dataclass("PeftFlags", [*_common(), *_own()],
                                         namespace={"PREFIX": "peft.", "apply_options": _apply_options,
                                                    "adapted": _adapted})
  PeftFlags.__doc__ = "The adapters' settings (--peft picks the method)."
  PeftFlags.__module__ = __name__
