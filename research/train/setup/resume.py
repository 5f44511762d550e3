"""Resuming a run: the newest checkpoint every process can read (damaged ones moved aside, never deleted), refused when
it holds another model or optimizer, or other training settings without --amend."""

from __future__ import annotations

import sys
from typing import Any

from models import TransformerConfig, schema
from research.train.config import RunError, flat_meta
from research.train.runtime.processes import all_agree, is_primary
from research.train.steps import sync
from research.train.steps.frozen import saved_frozen_dtype
from research.train.steps.train_state import TrainState
from research.train.store import rundir
from research.train.store.checkpoint import CheckpointError
from research.train.store.pretrained import peft_settings
from sharding import DATA, parse_mesh_spec


def state_signature(meta: dict) -> dict:
  """What fixes the saved state's shapes and structure: what the model is (its schema's MODEL fields, a router bias
  kept or not; models/schema.py) and the optimizer."""
  model = schema.signature(TransformerConfig, meta["model_config"])
  train = meta["train"]
  flag = train.get("sync", "allreduce")
  mode = sync.parse(flag)
  replicas = parse_mesh_spec(meta["mesh"], len(meta["devices"]))[DATA]
  # the frozen leaves' dtype
  stored: dict[str, Any] = {"frozen_dtype": saved_frozen_dtype(train)} if train.get("freeze") else {}
  if meta.get("blockwise_badam"):  # every parameter in this dtype, a master and AdamW state over one layer
    stored["blockwise_badam"] = meta["blockwise_badam"]["dtype"]
  # --freeze-layers: every parameter in its dtype, a master and optimizer state over layers N.. (None: off)
  stored["frozen_layers"] = meta.get("frozen_layers")
  return {**model, **stored, "optimizer": train["optimizer"], "opt": list(train["opt"]), "freeze": train.get("freeze"),
          "peft": peft_settings(meta), "sync": flag,  # per-replica state, the delays' draws
          **({"replicas": replicas} if mode.replicated or mode.random else {})}


def check_resume(saved: dict, meta: dict, out: str):
  saved, meta = flat_meta(saved), flat_meta(meta)  # either config layout: the flags compared one by one
  old, new = state_signature(saved), state_signature(meta)
  changed = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
  if changed:
    raise RunError(f"{out} holds a checkpoint of a different model/optimizer ({'; '.join(changed)}); "
                   f"use a new --out or the original settings")
  settings = rundir.changed_settings(saved, meta)
  before, now = saved["corpus"]["fingerprint"], meta["corpus"]["fingerprint"]
  if before != now:  # the same --data whose files changed: other data, a change of settings like --lr
    settings["data (corpus fingerprint)"] = [before[:16], now[:16]]
  if settings and not meta["train"]["amend"]:
    raise RunError(f"{out} was trained with other settings ({rundir.describe(settings)}); rerun with the original "
                   f"flags, or add --amend to go on with these (config.json's history records the change)")
  return settings


def newest_readable(ckpt, meta: dict, state, shardings, switches, out: str):
  """(step, restored state, its meta) of the newest checkpoint every process can read, or (None, None, None);
  unreadable newer ones are moved aside (never deleted), and none readable among several is an error."""
  start, damaged = None, []
  for s in reversed(ckpt.all_steps()):  # the newest readable checkpoint
    try:
      saved = ckpt.read_meta(s)
      settings = check_resume(saved, meta, out)
      layout = [sw for at, sw in switches if at <= s]  # the mesh the run had switched to by then
      restored = TrainState.of(ckpt.restore(s, state.as_dict(), (layout[-1][1] if layout else shardings).as_dict()))
      error = None
    except CheckpointError as e:
      error = e
    if all_agree(error is None):
      start = s
      break
    damaged.append((s, error or CheckpointError(f"checkpoint {ckpt.directory}/{s} is unreadable on another process")))
  if start is not None:
    meta["history"] = rundir.amend_history(saved, settings, start)
  if damaged and start is None:
    raise CheckpointError(f"{damaged[0][1]}; no older checkpoint is readable: move {ckpt.directory} aside or use a "
                          f"new --out")
  for s, err in damaged:  # kept byte for byte, out of orbax's sight (no overwrite, no keep-N deletion)
    moved = ckpt.quarantine(s)
    if is_primary():
      print(f"warning: {err}; moved to {moved}, resuming from step {start}", file=sys.stderr)
  return (start, restored, saved) if start is not None else (None, None, None)
