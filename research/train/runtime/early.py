"""`python -m research.train`'s first lines, run by the package's front door before its imports (which take seconds):
SIGINT/SIGTERM from here on are kept in `signals.EARLY_SIGNALS` (the run then stops at its start, nothing written),
and a warning is one line without its source path. Standard library only; nothing happens when research.train is
imported by another program (a notebook, a test, an experiment)."""

from __future__ import annotations

import signal
import sys
import warnings

from research.entry import show_warning
from research.train.runtime.signals import EARLY_SIGNALS


def as_command(argv: list[str] | None = None) -> bool:
  """Whether this interpreter was started as `python -m research.train`.

  Args:
    argv: the interpreter's command line (None: `sys.orig_argv`).

  Returns:
    Whether it runs the module research.train.
  """
  argv = sys.orig_argv if argv is None else argv
  return any(a == "-m" and nxt == "research.train" for a, nxt in zip(argv, argv[1:])) or "-mresearch.train" in argv


def keep_signals() -> None:
  """SIGINT/SIGTERM appended to `EARLY_SIGNALS` instead of raising, and warnings on one line."""
  warnings.showwarning = show_warning
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda s, _frame: EARLY_SIGNALS.append(s))


if as_command():
  keep_signals()
