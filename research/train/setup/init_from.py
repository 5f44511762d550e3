"""Where a run's initial parameters come from (--init-from).

- `--init-from hf:PATH` (a Hugging Face directory, `models.from_hf`) or `--init-from RUN_DIR` (an optlab run: the
  parameters of its newest checkpoint): the model config is the checkpoint's, a flag naming what the model is (a
  `models.schema.MODEL` field: its shape) that disagrees with it is an error, the flags for how it is computed and laid
  out (dtype, attention, routing, remat, ...) apply, and the optimizer state starts fresh.
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

from models import MoEConfig, TransformerConfig, from_hf, schema
from models.hf import config_from_hf
from research.train.store.pretrained import hf_path, load_run

# a flag that names what the model is must agree with the checkpoint; how it is computed and laid out may differ
SHAPE_FLAGS = schema.names(TransformerConfig, schema.MODEL, documented=True)
FREE_FLAGS = schema.names(TransformerConfig, schema.COMPUTE, schema.LAYOUT, documented=True)


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
  moe = flags.get("moe", {})
  for k, v in moe.items():
    if base.moe is None or _changes_state(k, getattr(base.moe, k), v):
      raise InitError(f"--moe.{k.replace('_', '-')} {v} conflicts with --init-from {source} "
                      f"(moe.{k}={None if base.moe is None else getattr(base.moe, k)}); leave it out")
  free = {k: flags[k] for k in FREE_FLAGS if k in flags}
  if moe and base.moe is not None:  # the routing and its losses may differ from the checkpoint's
    free["moe"] = dataclasses.replace(base.moe, **moe)  # what is left differs in how it computes, not what it keeps
  return dataclasses.replace(base, param_dtype="float32", **free)


def _changes_state(field: str, old, new) -> bool:
  """Whether an --moe.* value other than the checkpoint's makes another state: a MODEL field (an expert's shape), or
  a COMPUTE field whose schema says what of it the state keeps (a positive bias rate keeps a router bias)."""
  s = schema.schema(MoEConfig)[field]
  if s["kind"] == schema.MODEL:
    return old != new
  return s["state"] is not None and s["state"](old) != s["state"](new)


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
