"""`python -m research.train`: the package's front door has already put up the handlers that keep SIGINT/SIGTERM
during the seconds of imports (research/train/runtime/early.py); the CLI (research/train/command.py) runs."""

import signal

from research.train.command import main

main()
for _signum in (signal.SIGINT, signal.SIGTERM):  # the run is complete and saved: a signal during the
  signal.signal(_signum, signal.SIG_IGN)         # interpreter's teardown (which resets Python handlers) is moot
