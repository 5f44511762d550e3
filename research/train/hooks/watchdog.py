"""A hung-peer watchdog for multi-process runs: when one process dies (SIGKILL, a lost host), the others may wait
in their next collective forever (NCCL on GPUs does not notice a dead peer; Gloo on CPUs does, and the train CLI
then ends at once with one line, status 4, without jax.distributed's shutdown barrier, which would wait for the dead
process). JAX's coordination service notices missing heartbeats and aborts the survivors with a C++ stack trace;
this watchdog ends them first, with one line.

The train loop calls `beat(step)` whenever a step's results have reached the host (so all processes took part in
it). Once armed (after the first step: compilation may take longer than any step), `timeout` seconds without a
beat print `error: ...` and end the process at once with status 4 (`os._exit`: the main thread is stuck inside a
collective and cannot raise). Committed checkpoints are untouched; an unfinished one is a temporary directory the
next start removes; restarting every process resumes exactly.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_STATUS = 4


class Watchdog:
  def __init__(self, timeout: float, what: str):
    """`what` ends the error line; "{step}" in it becomes the step of the last beat."""
    self.timeout, self.what = timeout, what
    self.last: float | None = None  # armed once set
    self.step: int | None = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="optlab-watchdog", daemon=True)

  def __enter__(self):
    self._thread.start()
    return self

  def beat(self, step: int):
    self.step, self.last = step, time.monotonic()

  def _watch(self):
    while not self._stop.wait(min(1.0, self.timeout / 10)):
      if self.last is not None and time.monotonic() - self.last > self.timeout:
        print(f"error: no progress for {self.timeout:g} s {self.what.format(step=self.step)}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_STATUS)

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
