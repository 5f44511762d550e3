"""The config sections with a flag prefix of their own: --moe.* (`MoEFlags`, each flag one field of the preset's MoE)
and --data.* (`DataFlags`, how --data's records become rows); --peft.* is research/train/setup/adapters.py's
`PeftFlags`."""

from __future__ import annotations

import dataclasses
from typing import Literal


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
  dynamic here; a partition is `models.padnet.partition` (research/experiments/pad_net.py)."""


@dataclasses.dataclass
class DataFlags:
  """How --data's records become training rows (--data.field, --data.layout, --data.workers)."""
  field: str = "text"
  """The column (Parquet, Arrow) or key (JSON Lines) holding each document's text."""
  layout: Literal["windows", "pack", "pad"] = "windows"
  """What a row holds (research/data/records.py): windows (seq_len + 1 tokens anywhere in the token stream:
  pretraining), pack (the documents in an order drawn per epoch, joined by their end-of-text tokens, cut into rows),
  or pad (one document per row from its start, split when longer, padded when shorter, the loss masked on the
  padding: fine-tuning data). The held-out batches are laid out the same way."""
  workers: int = 2
  """Background threads that read and assemble batches ahead of the step (grain's prefetch; 0: in the loop)."""
