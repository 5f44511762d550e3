"""What the run-directory tests share: a run's loss trace (what "exact" compares), a directory's files by content, and a
free local port for a multi-process run's coordinator."""

import os
import pathlib
import socket


def trace(records):
  """(step, loss, grad norm, lr, val loss) of each metrics record: two runs are exact when these are equal."""
  return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("val_loss")) for r in records]


def files(root):
  """{path relative to root: bytes} of every file under root."""
  return {os.path.relpath(os.path.join(d, p), root): pathlib.Path(d, p).read_bytes() for d, _, ps in os.walk(root)
          for p in ps}


def free_port() -> int:
  """A local TCP port nothing listens on now (for --coordinator localhost:PORT)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]
