"""The config sections with a flag prefix of their own: --moe.* (`MoEFlags`, each flag one field of the preset's MoE,
but for PAD-Net's partition flags, `MoEFlags.PARTITION`) and --data.* (`DataFlags`, how --data's records become rows);
--peft.* is research/train/setup/adapters.py's `PeftFlags`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal


@dataclasses.dataclass
class MoEFlags:
  """Mixture of experts in every block: each flag overrides one field of the preset's MoE (see models.MoEConfig).
  On a dense preset, --moe.num-experts turns it into an MoE; --moe.num-experts 0 makes an MoE preset dense."""
  num_experts: int | None = None
  """Routed experts per block (0: a dense FFN)."""
  top_k: int | None = None
  """Experts each token is sent to."""
  d_expert: int | None = None
  """Each expert's SwiGLU hidden width (unset: --d-ff)."""
  num_shared: int | None = None
  """Always-on shared experts (DeepSeekMoE), fused into one SwiGLU."""
  d_shared: int | None = None
  """The fused shared SwiGLU's width (unset: num_shared x d_expert)."""
  shared_gate: bool | None = None
  """Scale the shared output by a per-token sigmoid gate (Qwen2-MoE)."""
  router: Literal["softmax", "sigmoid"] | None = None
  """Router scores: softmax, or sigmoid (always renormalised over the top-k)."""
  normalize_top_k: bool | None = None
  """Softmax router: renormalise the k selected probabilities to sum 1 (Mixtral)."""
  capacity_factor: float | None = None
  """Slots per expert = ceil(cf x tokens x k / E), the rest dropped (unset: dropless)."""
  lb_weight: float | None = None
  """Load-balancing loss weight."""
  z_weight: float | None = None
  """Router z-loss weight."""
  bias_rate: float | None = None
  """Aux-loss-free balancing step (DeepSeek-V3: 1e-3; 0: none)."""
  ragged_a2a: bool | None = None
  """Expert parallelism with ragged_all_to_all (GPU/TPU only)."""
  pad: bool | None = None
  """PAD-Net form: experts mixed with one static matrix per stack by masks and two scales (models/padnet.py), all
  dynamic until --moe.pad-ratio partitions them."""
  pad_ratio: float | None = None
  """PAD-Net: the final dynamic share r in (0, 1]; r < 1 runs Iterative Mode Partition at step 0 of a new run, before
  the first update (unset or 1: no partition, every entry dynamic). Needs --moe.pad."""
  pad_rounds: int | None = None
  """IMP rounds T >= 1 (unset: 5). Needs --moe.pad-ratio."""
  pad_batches: int | None = None
  """The first training batches IMP scores |dL/dM| on, summed (unset: 4). Needs --moe.pad-ratio."""
  pad_schedule: Literal["exponential", "linear"] | None = None
  """Each round's dynamic share: r^(t/T), or 1 - (1 - r) t/T (unset: exponential). Needs --moe.pad-ratio."""
  pad_scope: Literal["global", "local"] | None = None
  """One ranking over every expert matrix of the model, or one per expert matrix (unset: global). Needs
  --moe.pad-ratio."""

  # the flags that set no MoEConfig field: what research/train/setup/padnet.py does at step 0
  PARTITION: ClassVar[tuple] = ("pad_ratio", "pad_rounds", "pad_batches", "pad_schedule", "pad_scope")
  PREFIX: ClassVar[str] = "moe."  # the flags' spelling in research/train/config/checks.py's messages
  POSITIVE: ClassVar[tuple] = ("pad_rounds", "pad_batches")
  RANGES: ClassVar[dict] = {"pad_ratio": (0, 1, False)}
  NEEDS: ClassVar[dict] = {"pad_ratio": "pad", **{k: "pad_ratio" for k in PARTITION[1:]}}  # flag: the flag it needs

  def model_fields(self) -> dict:
    """{field: value} of the MoEConfig fields these flags set (unset ones and the partition's left out)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.PARTITION and v is not None}

  def partition(self) -> dict | None:
    """`models.padnet.partition`'s settings the flags ask for at step 0, defaults filled in; None without a
    --moe.pad-ratio below 1."""
    if not self.pad or self.pad_ratio is None or self.pad_ratio >= 1:
      return None
    return {"ratio": self.pad_ratio, "rounds": self.pad_rounds or 5, "batches": self.pad_batches or 4,
            "schedule": self.pad_schedule or "exponential", "scope": self.pad_scope or "global"}


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
