"""What the run-directory tests share: a run's loss trace (what "exact" compares) and a directory's files by content."""

import os
import pathlib


def trace(records):
  """(step, loss, grad norm, lr, val loss) of each metrics record: two runs are exact when these are equal."""
  return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("val_loss")) for r in records]


def files(root):
  """{path relative to root: bytes} of every file under root."""
  return {os.path.relpath(os.path.join(d, p), root): pathlib.Path(d, p).read_bytes() for d, _, ps in os.walk(root)
          for p in ps}
