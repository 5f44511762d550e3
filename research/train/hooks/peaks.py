"""The peak that MFU divides by: the chip's datasheet figure for the compute dtype, dense (no sparsity), per chip.

MaxText, torchtitan, nanoGPT and PaLM all divide the model's FLOP rate by this figure; a matmul sampled on the
machine is only the fallback for a device not in the table (a CPU, an unknown part), never a substitute for it on a
known one (a 1024³ float32 matmul timed from the host on an H100 is launch-bound: "MFU 99.5%" for a 25% step).

`spec_peak(device_kind, dtype)` reads the table; `research/train/hooks/throughput.py` (`Peak`) chooses between it, a
measured matmul and `--peak-flops`, and says which in the run's records. No jax here: the table is data.
"""

from __future__ import annotations

import re

T = 1e12

# (pattern of jax's `device_kind`, name, {dtype: dense FLOP/s}, source). First match wins: specific parts first.
# "float32" is the non-tensor-core rate; "tfloat32" the tensor-core rate XLA uses for float32 matmuls on NVIDIA
# Ampere and newer at the default precision (`matmul_dtype`). TPUs multiply float32 matmuls in bfloat16 passes at
# the default precision; their datasheets give bfloat16 (and int8) only.
TABLE = [
    (r"H100.*(PCIe|PCIE)", "NVIDIA H100 PCIe",
     {"bfloat16": 756 * T, "float16": 756 * T, "float8": 1513 * T, "tfloat32": 378 * T, "float32": 51 * T},
     "NVIDIA H100 Tensor Core GPU datasheet, PCIe column, dense"),
    (r"H[12]00.*NVL", "NVIDIA H100 NVL / H200 NVL",
     {"bfloat16": 835 * T, "float16": 835 * T, "float8": 1671 * T, "tfloat32": 418 * T, "float32": 60 * T},
     "NVIDIA H100 and H200 datasheets, NVL columns, dense"),
    (r"H100|H200|GH200", "NVIDIA H100 SXM / H200",
     {"bfloat16": 989 * T, "float16": 989 * T, "float8": 1979 * T, "tfloat32": 495 * T, "float32": 67 * T},
     "NVIDIA H100 (SXM) and H200 datasheets, dense"),
    (r"A100", "NVIDIA A100",
     {"bfloat16": 312 * T, "float16": 312 * T, "tfloat32": 156 * T, "float32": 19.5 * T},
     "NVIDIA A100 Tensor Core GPU datasheet, dense"),
    (r"\bL4\b", "NVIDIA L4",
     {"bfloat16": 121 * T, "float16": 121 * T, "float8": 242 * T, "tfloat32": 60 * T, "float32": 30.3 * T},
     "NVIDIA L4 datasheet, dense (half its sparsity figures)"),
    (r"RTX 4090", "NVIDIA GeForce RTX 4090",
     {"bfloat16": 165.2 * T, "float16": 165.2 * T, "float8": 330.3 * T, "tfloat32": 82.6 * T, "float32": 82.6 * T},
     "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090, FP32 accumulate, dense"),
    (r"RTX 3090", "NVIDIA GeForce RTX 3090",
     {"bfloat16": 71 * T, "float16": 71 * T, "tfloat32": 35.6 * T, "float32": 35.6 * T},
     "NVIDIA Ampere GA102 whitepaper, RTX 3090, FP32 accumulate, dense"),
    (r"TPU v4$", "TPU v4", {"bfloat16": 275 * T}, "Google Cloud TPU v4 documentation, per chip"),
    (r"TPU v5 ?lite|TPU v5e", "TPU v5e", {"bfloat16": 197 * T, "int8": 394 * T},
     "Google Cloud TPU v5e documentation, per chip"),
    (r"TPU v5p?$|TPU v5p", "TPU v5p", {"bfloat16": 459 * T}, "Google Cloud TPU v5p documentation, per chip"),
    (r"TPU v6 ?lite|TPU v6e|Trillium", "TPU v6e", {"bfloat16": 918 * T, "int8": 1836 * T},
     "Google Cloud TPU v6e (Trillium) documentation, per chip"),
]


def matmul_dtype(device_kind: str, dtype: str, precision: str | None = None) -> str | None:
  """The dtype a `dtype` matmul runs in on that device at jax's matmul precision `precision` (None: the default),
  or None when no single datasheet figure describes it. float32 at the default precision is TF32 on NVIDIA tensor
  cores (Ampere and newer) and one bfloat16 pass on a TPU; "bfloat16" precision is bfloat16 everywhere; "high"
  (TF32 on NVIDIA, three bfloat16 passes on a TPU) has no TPU figure; "highest" / "float32" is float32."""
  precision = (precision or "default").lower()
  if dtype != "float32" or precision in ("highest", "float32"):
    return dtype
  if precision == "bfloat16":
    return "bfloat16"
  if device_kind.startswith("TPU"):
    return "bfloat16" if precision == "default" else None
  if device_kind.startswith("NVIDIA") and not re.search(r"V100|T4\b|P100", device_kind):
    return "tfloat32"
  return dtype


def spec_peak(device_kind: str, dtype: str, precision: str | None = None) -> tuple[float, str] | None:
  """(dense FLOP/s, where the figure comes from) for a `dtype` matmul on one chip of that kind, or None when the
  kind or the dtype is not in the table (then a measured matmul is the fallback)."""
  runs_as = matmul_dtype(device_kind, dtype, precision)
  if runs_as is None:
    return None
  for pattern, name, peaks, source in TABLE:
    if re.search(pattern, device_kind):
      if runs_as not in peaks:
        return None
      how = (f" (float32 matmuls run as {runs_as} at jax's {precision or 'default'} matmul precision)"
             if runs_as != dtype else "")
      return peaks[runs_as], f"{name} {runs_as} datasheet peak {peaks[runs_as] / T:g} TFLOP/s: {source}{how}"
  return None
