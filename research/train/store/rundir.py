"""A run directory's ownership and history: one writer at a time, no stray directory from a run that never started,
and a record of every setting changed on resume.

  claim(out)            creates --out if needed and locks it (`<out>/.lock`, an exclusive flock held until the run
                        ends: a second run on the same directory is refused in one line); if this run created the
                        directory and fails before its first checkpoint, the directory is removed again
  changed_settings      the settings that change what the remaining steps compute, old -> new, between a
                        checkpoint's config and this run's
  amend_history         config.json's `history`: one segment per resume that changed settings (with --amend)
  MetricsLog            metrics.jsonl: records up to the resumed step kept, one line appended (and flushed) per
                        record, cut back to a committed step when a save fails
  refused(e)            whether an OSError is the run directory's disk refusing a write: the run stops in one line
                        as when a save fails (research/train/loop.py), whichever file hit it first

What may differ on resume without --amend (it changes neither the math nor the data of the steps to come): where
and how the run is laid out (mesh, devices, --zero1, --switch-at, remat, pipeline microbatches, processes), how it
reports and saves (logging, evaluation, checkpoint cadence, keep, progress, cache, bad-step and spike limits, peak
FLOP/s), --stop-at and --init-from (which only a fresh run reads). Paths compare absolute (`--data d.txt` from the
directory a run started in is `--data /that/dir/d.txt`). Model shapes and the optimizer are compared separately and
never change (the state would not fit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import sys
from typing import TextIO

from models import TransformerConfig, schema
from research.train.config import paths
from research.train.config.observe import ObserveSection

REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}  # the run directory's disk is full or read-only


def refused(e: BaseException) -> bool:
  """Whether `e` is the run directory's disk refusing a write (full, over quota, remounted read-only)."""
  return isinstance(e, OSError) and e.errno in REFUSED


class RunDirError(ValueError):
  """A run directory this run cannot own or resume as asked."""


LAYOUT_AND_REPORTING = {
    "out", "mesh", "devices", "zero1", "switch_at", "remat", "microbatches", "coordinator", "num_processes",
    "process_id", "distributed", "peer_timeout", "eval_every", "eval_batches", "ckpt_every", "keep", "log_every",
    "progress", "compile_cache", "max_bad_steps", "spike_factor", "spike_window", "peak_flops", "stop_at",
    "profile", "init_from", "amend", "memory_limit", "tracker",
    *(f.name for f in dataclasses.fields(ObserveSection))}  # observers read the step, they change nothing in it
# flags that only name model fields (compared through the resolved model config instead: its schema's COMPUTE fields)
MODEL_FLAGS = {"model", "moe", *schema.names(TransformerConfig, documented=True)}


# settings added after runs were saved: a saved config without one trained as its default did
LATER_DEFAULTS = {"sync": "allreduce", "outer_lr": 0.7, "outer_momentum": 0.9, "sampling": "random",
                  "data_options": {"field": "text", "layout": "windows"}, "mix": None}


def changed_settings(saved: dict, meta: dict) -> dict[str, list]:
  """{setting: [before, now]} for every training setting, and every field of the model config of the COMPUTE kind
  (models/schema.py: the dtype, the attention, the MoE routing as "moe.top_k", ...), that differs between a
  checkpoint's config (`saved`) and this run's (`meta`)."""
  skip = LAYOUT_AND_REPORTING | MODEL_FLAGS
  old, new = {**LATER_DEFAULTS, **saved["train"]}, json.loads(json.dumps(meta["train"]))  # as saved: tuples -> lists
  if isinstance(old.get("data"), str):  # saved before --data took several paths
    old["data"] = [old["data"]]
  # paths compare absolute: a relative one was saved before paths were recorded absolute, from the directory the run
  # started in (told by the run directory's path and the --out it saved), else taken to be this one
  base = paths.start_dir(new.get("out") or ".", old.get("out")) or os.getcwd()
  for d in (old, new):
    if d.get("data"):
      d["data"] = list(paths.absolute_data(d["data"], base) or ())
    if d.get("tokenizer"):
      d["tokenizer"] = paths.absolute(d["tokenizer"], base)
    if isinstance(d.get("data_options"), dict):  # --data.workers (reader threads) changes no batch
      d["data_options"] = {k: v for k, v in d["data_options"].items() if k != "workers"}
  changed = {k: [old.get(k), v] for k, v in new.items() if k not in skip and old.get(k) != v}
  changed.update(schema.changed(TransformerConfig, saved["model_config"], meta["model_config"], schema.COMPUTE))
  return changed


def amend_history(saved: dict, changed: dict, step: int) -> list[dict]:
  """The history a resumed run records: the checkpoint's, plus a segment from `step` on if settings changed."""
  history = list(saved.get("history", []))
  if changed:
    history.append({"from_step": step, "changed": changed})
  return history


def describe(changed: dict) -> str:
  return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())


def has_checkpoint(out: str) -> bool:
  ckpt = os.path.join(out, "ckpt")
  return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


@contextlib.contextmanager
def claim(out: str, *, lock: bool = True, keep_on: tuple[type[BaseException], ...] = ()):
  """Creates `out` if needed and holds its lock for the block. A directory this call created is removed if the
  block raises (anything but `keep_on`) before a checkpoint exists in it: a failed start leaves nothing behind."""
  try:
    os.makedirs(out)  # atomic: of two runs starting on a new directory, one creates it
    created = True
  except FileExistsError:
    created = False
  handle = None
  try:
    if lock:
      handle = open(os.path.join(out, ".lock"), "a+")
      try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        handle = None
        raise RunDirError(f"{out} is in use by another run ({holder}); wait for it to end or use another --out") \
            from None
      handle.seek(0)
      handle.truncate()
      handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
      handle.flush()
    yield
  except BaseException as e:
    if created and not isinstance(e, keep_on) and not has_checkpoint(out):
      shutil.rmtree(out, ignore_errors=True)
    raise
  finally:
    if handle is not None:
      handle.close()  # releases the lock


def write_json_lines(path: str, records: list[dict], indent: int | None = None):
  """Writes `records` one JSON object each, whole, then renames: a crash leaves the old file or the new one."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r, indent=indent) + "\n" for r in records)
  os.replace(tmp, path)


def read_records(path: str) -> tuple[list[dict], int]:
  """metrics.jsonl's records (JSON objects with an integer "step") and how many other lines it has, not counting
  an unterminated last line that does not parse: one cut short by a crash (SIGKILL while writing it), dropped. (An
  unterminated line that parses is another file's bytes, e.g. orbax's one-line metadata: it counts as damaged.)"""
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  records, damaged = [], 0
  for i, line in enumerate(lines):
    try:
      record = json.loads(line.decode())
    except ValueError:  # (JSON and UTF-8 errors are ValueErrors)
      damaged += bool(line.strip()) and i < len(lines) - 1
      continue
    if isinstance(record, dict) and isinstance(record.get("step"), int):
      records.append(record)
    else:
      damaged += 1
  return records, damaged


def aside_name(path: str, suffix: str) -> str:
  """`path + suffix`, or `.1`, `.2`, ... after it: the first name that is free (a file kept aside never replaces an
  earlier one)."""
  name, n = path + suffix, 0
  while os.path.lexists(name):
    n += 1
    name = f"{path}{suffix}.{n}"
  return name


def keep_aside(path: str, suffix: str) -> str:
  """Keeps `path` as it is under `aside_name(path, suffix)` too, and returns that name: a second link to the same
  bytes (no space needed, on a full disk too) or, where links are not supported, a copy. The caller then replaces
  `path` (write a new file, rename it over): the kept bytes are never rewritten in place."""
  kept = aside_name(path, suffix)
  try:
    os.link(path, kept)
  except OSError:  # a filesystem without hard links
    shutil.copy2(path, kept)
  return kept


class MetricsLog:
  """A run's metrics.jsonl: `open(up_to)` keeps the records of steps <= up_to (what the resumed checkpoint had
  logged), `write` appends one record, `cut(step)` truncates the file back to the records of steps <= step (in place:
  it needs no free space, for a disk that filled up). `enabled=False` (other processes): writes nothing."""

  def __init__(self, path: str, enabled: bool = True):
    self.path, self.enabled = path, enabled
    self.file: TextIO | None = None
    self.ends: list[tuple[int, int]] = []  # (step, file offset after its record)

  def open(self, up_to: int | None) -> list[dict]:
    records: list[dict] = []
    if up_to is not None and os.path.exists(self.path):
      records, damaged = read_records(self.path)
      records = [r for r in records if r["step"] <= up_to]
      if damaged and self.enabled:  # the file as it was is kept; the readable records go on
        kept = keep_aside(self.path, ".damaged")
        print(f"warning: {self.path}: {damaged} line(s) are not metrics records (the file was damaged); kept as it "
              f"was in {kept}, the {len(records)} readable records up to step {up_to} go on", file=sys.stderr)
    if self.enabled:
      write_json_lines(self.path, records)
      self.file = open(self.path, "a")
      self.ends = [(0, self.file.tell())]
    return records

  def write(self, record: dict):
    if self.file is not None:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()
      self.ends.append((record["step"], self.file.tell()))

  def cut(self, step: int | None):
    if self.file is not None:
      keep = max(end for s, end in self.ends if s <= (step or 0))
      self.file.truncate(keep)
      self.file.seek(keep)

  def close(self):
    if self.file is not None:
      self.file.close()
      self.file = None
