"""`python -m research.train`: the handlers for SIGINT/SIGTERM go up first (a signal during the seconds of imports is
kept in `signals.EARLY_SIGNALS` and stops the run at its start), then the CLI (`research/train/cli.py`) runs."""

import signal
import warnings

from research.entry import show_warning  # standard library only: nothing slow is imported before these
from research.train.signals import EARLY_SIGNALS

warnings.showwarning = show_warning  # a warning is one line, without Python's source path and code line

for _signum in (signal.SIGINT, signal.SIGTERM):
  signal.signal(_signum, lambda signum, _frame: EARLY_SIGNALS.append(signum))

from research.train.cli import main  # noqa: E402  (the imports that take seconds, after the handlers on purpose)

main()
for _signum in (signal.SIGINT, signal.SIGTERM):  # the run is complete and saved: a signal during the
  signal.signal(_signum, signal.SIG_IGN)         # interpreter's teardown (which resets Python handlers) is moot
