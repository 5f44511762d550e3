"""What a training run prints: a progress bar on a terminal, plain lines in a log file.

On a terminal: a tqdm bar on stderr (loss, tokens/s, MFU), and every evaluation as a persistent line above it.
Anywhere else (stdout redirected to a file, a CI log, a notebook's captured stream): no bar, one plain line per
logging interval and per evaluation, so a log stays readable line by line.
"""

from __future__ import annotations

import sys


def _fmt(rec: dict, total: int) -> str:
  parts = [f"step {rec['step']}/{total}", f"loss {rec['loss']:.3f}"]
  if "val_loss" in rec:
    parts.append(f"val_loss {rec['val_loss']:.3f}")
  if rec.get("tokens_per_s") is not None:
    parts.append(f"{rec['tokens_per_s']:,.0f} tokens/s")
  if rec.get("mfu") is not None:
    parts.append(f"mfu {rec['mfu']:.1%}")
  return " | ".join(parts)


class Progress:
  """`log(record)` after each logged step, `advance()` after every step, `close()` at the end."""

  def __init__(self, total: int, initial: int, enabled: bool = True, stream=None):
    self.total, self.stream = total, stream or sys.stdout
    self.bar = None
    self.enabled = enabled
    if enabled and self.stream.isatty():
      from tqdm import tqdm
      self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, file=self.stream)

  def log(self, rec: dict):
    if not self.enabled:
      return
    if self.bar is None:  # a plain line per logged step
      print(_fmt(rec, self.total), file=self.stream, flush=True)
      return
    if "val_loss" in rec:  # persistent, above the bar
      self.bar.write(_fmt(rec, self.total), file=self.stream)
    post = {"loss": f"{rec['loss']:.3f}"}
    if rec.get("tokens_per_s") is not None:
      post["tok_s"] = f"{rec['tokens_per_s']:.0f}"
    self.bar.set_postfix(post)

  def advance(self):
    if self.bar is not None:
      self.bar.update(1)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def summary(records: list[dict], out: str) -> str:
  """The final line: validation loss from the first to the last evaluation (or the one there was), and the run's
  averages (not the last interval's: `run_tokens_per_s`, `run_mfu` of the last record) and its steady state's."""
  evals = [r for r in records if "val_loss" in r]
  if len(evals) >= 2:
    val = (f"val_loss {evals[0]['val_loss']:.3f} (step {evals[0]['step']}) -> {evals[-1]['val_loss']:.3f} "
           f"(step {evals[-1]['step']})")
  elif evals:
    val = f"val_loss {evals[0]['val_loss']:.3f} at step {evals[0]['step']} (one evaluation)"
  else:
    val = "no evaluation"
  last = records[-1]
  steady = ("" if last.get("steady_tokens_per_s") is None else
            f"; steady state {last['steady_tokens_per_s']:,.0f} tokens/s, MFU {last['steady_mfu']:.1%} (the "
            f"windows {last['steady_after']}+ steps after compiling)")
  speed = ("" if last.get("run_tokens_per_s") is None else
           f", {last['run_tokens_per_s']:,.0f} tokens/s and MFU {last['run_mfu']:.1%} averaged over the run"
           f"{steady} (peak: {last['peak_source']})")
  return f"done: step {records[-1]['step']}, {val}{speed}; outputs in {out}"
