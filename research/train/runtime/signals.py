"""SIGINT/SIGTERM as a flag the loop checks after each step (a checkpoint, then exit 128 + signum); a second signal
ends the process at once with one line and the same status (the newest committed checkpoint is where a rerun
resumes). `EARLY_SIGNALS` holds the ones that came while the CLI was still importing (`research/train/__main__.py`)."""

from __future__ import annotations

import os
import signal
import sys

EARLY_SIGNALS: list[int] = []  # SIGINT/SIGTERM that came while the CLI was still importing (seconds)


class Stop:
  """Turns SIGINT/SIGTERM into a flag the loop checks after each step."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    if EARLY_SIGNALS:  # one came during the CLI's imports
      self.signum = EARLY_SIGNALS[0]
    for s in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[s] = signal.signal(s, self._handle)
      except ValueError:  # not the main thread: no handler
        pass
    return self

  def _handle(self, signum, _frame):
    if self.signum is not None:  # a second signal: stop now, without the checkpoint, in one line (a raised
      # KeyboardInterrupt unwound through orbax's save and the loop as a 75-line traceback)
      print(f"error: signal {signum} again: stopped at once, without a checkpoint; rerun the same command to resume "
            f"from the newest checkpoint", file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(128 + signum)  # the run directory's lock goes with the process; a save cut short is never committed
    self.signum = signum
    print(f"\nsignal {signum}: saving a checkpoint after this step (again to abort)", file=sys.stderr)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)
