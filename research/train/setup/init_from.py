"""Where a run's initial parameters come from (--init-from).

- `--init-from hf:PATH` (a Hugging Face directory, `models.from_hf`) or `--init-from RUN_DIR` (an optlab run: the
  parameters of its newest checkpoint): the model config is the checkpoint's, a model flag that disagrees with it is
  an error (dtype, remat and microbatches may still be set), and the optimizer state starts fresh.
- Dtypes: the parameters a run trains are float32 whatever the checkpoint's dtype (a bfloat16 file is widened
  exactly: AdamW's updates are not rounded to bfloat16); the ones it does not train (--freeze's, --peft's frozen base,
  BAdam's storage) are stored in --frozen-dtype, bfloat16 by default when fine-tuning. research.export writes the
  checkpoint's dtype back by default.
- `--freeze REGEX` (which of them train) is `research/train/steps/frozen.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from models import TransformerConfig, from_hf
from models.hf import config_from_hf
from research.train.store.pretrained import hf_path, load_run

SHAPE_FLAGS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "qk_norm", "qkv_bias", "tie_embeddings")
FREE_FLAGS = ("compute_dtype", "remat", "microbatches")  # may differ from the checkpoint's


class InitError(ValueError):
  """An --init-from that cannot be used."""


def source_config(source: str) -> TransformerConfig:
  """The model config of an --init-from source, read without loading any weight."""
  path = hf_path(source) or source
  try:
    meta = json.load(open(os.path.join(path, "config.json")))
  except (OSError, ValueError) as e:
    raise InitError(f"--init-from {source}: cannot read {path}/config.json ({e})") from None
  if hf_path(source):
    return config_from_hf(meta)[1]
  if "model_config" not in meta:
    raise InitError(f"--init-from {source}: not an optlab run directory (prefix a Hugging Face directory with hf:)")
  return TransformerConfig(**meta["model_config"])


def model_config(source: str, flags: dict) -> TransformerConfig:
  """The checkpoint's config with the allowed flags applied; RunError-style InitError for one that disagrees.
  `source`: --init-from's; `flags`: the model flags given on the command line (unset ones left out), --moe.* under
  "moe"."""
  base = source_config(source)
  for k in SHAPE_FLAGS:
    if k in flags and flags[k] != getattr(base, k):
      raise InitError(f"--{k.replace('_', '-')} {flags[k]} conflicts with --init-from {source} "
                      f"({k}={getattr(base, k)}); leave it out")
  for k, v in flags.get("moe", {}).items():
    if base.moe is None or getattr(base.moe, k) != v:
      raise InitError(f"--moe.{k.replace('_', '-')} {v} conflicts with --init-from {source} "
                      f"(moe.{k}={None if base.moe is None else getattr(base.moe, k)}); leave it out")
  return dataclasses.replace(base, param_dtype="float32", **{k: flags[k] for k in FREE_FLAGS if k in flags})


def load_arrays(source: str, mesh) -> tuple[dict, dict]:
  """(parameters, other variables) of the source's model (a PEFT run's merged) as plain dicts, each array on its
  shards of `mesh` (the model's logical rules), in the checkpoint's own dtype (a Hugging Face file's torch_dtype): the
  train state's construction casts each to the dtype it stores (a bfloat16 file is never widened to float32 for a run
  that stores it in bfloat16)."""
  from flax import nnx
  path = hf_path(source)
  model = from_hf(path, mesh=mesh)[0] if path else load_run(source, mesh=mesh)[0]
  _, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # flax: variadic tuple of states
  return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
