"""The ladder's ledger: one line per finished run in OUT/ledger.jsonl, a tracked file beside the record.

runs/ (each run's checkpoints, metrics and flags) is not tracked: a fresh checkout has none. The ledger keeps what the
protocol and the record read from a finished run (its final held-out loss, its steps, the commit it finished at, the
machine time it took), so that a fresh checkout resumes where the last one stopped instead of rerunning the ladder.
A group's runs are appended as soon as the group ends.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

from research.entry import UsageError
from research.train.config import flat_record
from research.train.store.rundir import read_records

FILE = "ledger.jsonl"


def load(out: str) -> dict[str, dict]:
  """OUT/ledger.jsonl as {run: entry}, run the path under runs/ (a later line for a run replaces an earlier one).

  A last line that is not JSON (an append cut off by a kill) is left out: its runs are read again from runs/ or rerun.
  A line before it that is not JSON raises `research.entry.UsageError` naming the file and line.
  """
  path = os.path.join(out, FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
  entries = []
  for k, (i, line) in enumerate(lines):
    try:
      entries.append(json.loads(line))
    except json.JSONDecodeError as e:
      if k < len(lines) - 1:
        raise UsageError(f"{path}:{i}: not a ledger entry ({e.msg}); fix or remove that line") from None
  return {e["run"]: e for e in entries}


def append(out: str, entries: list[dict]):
  """Appends `entries` to OUT/ledger.jsonl (one JSON object per line, flushed before returning); a torn last line (an
  append cut off by a kill, which `load` leaves out) is cut away first, so that the new lines do not continue it."""
  if not entries:
    return
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, FILE)
  if os.path.exists(path):
    with open(path, "rb+") as f:
      text = f.read()
      if text and not text.endswith(b"\n"):
        f.truncate(text.rfind(b"\n") + 1)
  with open(path, "a") as f:
    f.write("".join(json.dumps(e) + "\n" for e in entries))
    f.flush()
    os.fsync(f.fileno())


def key(path: str, runs_dir: str) -> str:
  """A run's name in the ledger: its directory under runs/, "/"-separated."""
  return os.path.relpath(path, runs_dir).replace(os.sep, "/")


def metrics(run_dir: str) -> list[dict]:
  """The run's metrics.jsonl records ([] where it has none)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  return read_records(path)[0] if os.path.exists(path) else []


def final_val(run_dir: str, steps: int, records: list[dict] | None = None) -> float | None:
  """The run's final held-out loss when it finished (inf when it diverged), else None; `records`: its `metrics`
  when already read."""
  if os.path.exists(os.path.join(run_dir, "diverged")):
    return math.inf
  done = [r["val_loss"] for r in (metrics(run_dir) if records is None else records)
          if r["step"] == steps and "val_loss" in r]
  return done[-1] if done else None


def kept(cfg) -> str:
  """What an interrupted ladder kept, for the command line's one line (`common.cli(kept=...)`): the ledger's runs."""
  n = len(load(cfg.out))
  where = os.path.join(cfg.out, FILE)
  return (f"{n} finished run(s) are kept in {where} (a cut-off group's state under runs/); rerun the same command "
          "to go on") if n else "no run had finished: a rerun starts over (a cut-off group's state is under runs/)"


def _sig(x: float) -> float:
  return float(f"{x:.6g}")


def from_dirs(runs_dir: str, paths: list[str], tokens_per_step: int) -> list[dict]:
  """Ledger entries of the finished runs among `paths` (run directories under `runs_dir`).

  Args:
    runs_dir: the ladder's runs/.
    paths: run directories; an unfinished one is skipped.
    tokens_per_step: batch size × sequence length (a logged tokens_per_s is the group's, in tokens of one member).

  Returns:
    One entry per finished run: run, steps, final_val_loss, commit (None where the run has no `commit` file), seconds
    (its share of its group's wall time: runs whose logged tokens_per_s are identical trained as one vmapped group in
    one directory and split it evenly) and rates (seconds per member-step over each logging interval).
  """
  found, groups = [], {}
  for path in paths:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
      continue
    with open(cfg_path) as f:
      train = flat_record(json.load(f)["train"])
    records = metrics(path)
    loss = final_val(path, train["steps"], records)
    if loss is None:
      continue
    recs = [x for x in records if "tokens_per_s" in x]
    gaps = [(b["step"] - a["step"], (b["step"] - a["step"]) * tokens_per_step / b["tokens_per_s"])
            for a, b in zip([{"step": 0}, *recs], recs)]
    commit_path = os.path.join(path, "commit")
    commit = None
    if os.path.exists(commit_path):
      with open(commit_path) as f:
        commit = f.read().strip()
    entry = {"run": key(path, runs_dir), "steps": train["steps"], "final_val_loss": loss, "commit": commit}
    found.append((entry, gaps))
    groups.setdefault((os.path.dirname(path), tuple(x["tokens_per_s"] for x in recs)), []).append(entry["run"])
  size = {run: len(members) for members in groups.values() for run in members}
  for entry, gaps in found:
    n = size[entry["run"]]
    entry["seconds"] = _sig(sum(t for _, t in gaps) / n)
    entry["rates"] = [_sig(t / k / n) for k, t in gaps if k]
  return [e for e, _ in found]


def from_record(record: dict, log_every: Callable[[int], int]) -> list[dict]:
  """Ledger entries for the runs a record (results.json) lists that a checkout has neither in runs/ nor in a ledger:
  each run's time is its stage's recorded wall hours shared in proportion to its steps, and each of its logging
  intervals takes the width's recorded quiet rate (quiet hours ÷ member-steps), so that the compute re-read from the
  ledger is the record's, and a width's later runs pool their intervals with as many of the restored ones as the
  record pooled. Marked `"restored": true`.

  Args:
    record: results.json as `study.main` writes it ("runs", and "compute": {width: {stage: cell}}).
    log_every: `log_every(steps)`, how often a run of `steps` steps logged its time.

  Returns:
    One entry per listed run, as `from_dirs` gives them.
  """
  out = []
  for r in record.get("runs", []):
    width, _, stage = r["run"].split("/")[:3]
    cell = record["compute"][width[1:]][stage[0]]
    rate = _sig(cell["quiet"] * 3600 / cell["member_steps"])
    out.append({**r, "seconds": _sig(cell["hours"] * 3600 * r["steps"] / cell["member_steps"]),
                "rates": [rate] * math.ceil(r["steps"] / log_every(r["steps"])), "restored": True})
  return out
