"""One error discipline for every command line (`research.train`, `sample`, `export`, `quantize`, `plot`, `bench`,
`sweep`, `soak` and the experiments): bad input is one `error:` line and exit 2, before anything is written; Ctrl-C
is one line and exit 130 (a second one ends the process at once); a Python warning is one `warning:` line, without
the source path and code line Python prints by default.

`research.train` keeps its own signal handling (`research/train/runtime/signals.py`: a first Ctrl-C saves a checkpoint)
and uses the rest of this module."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
# XLA's words for an allocation that failed, whatever the status code it comes with (RESOURCE_EXHAUSTED on an
# accelerator; INTERNAL "... Out of memory allocating ..." from the CPU client; an allocator that "ran out of memory")
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory|Failed to allocate|\bOOM\b", re.IGNORECASE)
OOM_FIX = "ask for less at once (a smaller batch, sequence or model), or use a device with more memory"


class UsageError(ValueError):
  """Bad input found by a command line's own checks."""


class OutputError(UsageError):
  """An output path that cannot be written (found before the work that would fill it)."""


def show_warning(message, category, filename, lineno, file=None, line=None):
  """`warnings.showwarning` for a command line: the message's first line, nothing else."""
  text = str(message).strip().splitlines()
  print(f"warning: {text[0] if text else category.__name__}", file=file or sys.stderr, flush=True)


LIBRARY = ("optim.", "models.", "sharding.", "research.data.", "research.train.")  # whose errors refuse values


def library_refusal(e: BaseException) -> bool:
  """Whether `e` is one of the library's own refusals of a value: a ValueError of a class that optim, models,
  sharding or the data and trainer rooms define (PadNetError, ShardingError, UnknownOptimizerError, ...), which a
  command running on its user's values reports as bad input. A ValueError of anything else is a bug."""
  return isinstance(e, ValueError) and type(e).__module__.startswith(LIBRARY)


@contextlib.contextmanager
def one_line_errors(*errors: type[BaseException], library: bool = False):
  """The errors given (bad input) as one `error:` line and exit 2; `UsageError` always, and with `library` every
  refusal of the library's (`library_refusal`)."""
  caught: tuple[type[BaseException], ...] = (UsageError, *errors)
  try:
    yield
  except BaseException as e:
    if not (isinstance(e, caught) or (library and library_refusal(e))):
      raise
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT) from None


def out_of_memory(e: BaseException, fix: str = OOM_FIX) -> str | None:
  """The one-line message for an allocation failure (`OUT_OF_MEMORY`: any XLA status code) ending with `fix` (what
  a command's own flags can do about it), else None."""
  text = str(e)
  if isinstance(e, MemoryError) or type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and \
      OUT_OF_MEMORY.search(text):
    first = text.splitlines()[0][:200] if text else type(e).__name__
    return f"out of memory ({first}): {fix}"
  return None


def command(main: Callable[[], object], interrupted: str | Callable[[], str] = "") -> None:
  """Runs a command line's `main` (its `if __name__ == "__main__":` block): warnings in one line each, a first
  Ctrl-C as one line and exit 130, a second one at once, an allocation failure (`out_of_memory`) as one line and
  exit 2. `interrupted` says what was kept: a text, or a function asked at the interrupt (what was kept is known
  only then)."""
  warnings.showwarning = show_warning
  signal.signal(signal.SIGINT, _on_interrupt)
  try:
    status = main()
  except KeyboardInterrupt:
    kept = interrupted() if callable(interrupted) else interrupted
    print(f"error: interrupted (Ctrl-C){'; ' + kept if kept else ''}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED) from None
  except Exception as e:
    oom = out_of_memory(e)
    if oom is None:
      raise
    print(f"error: {oom}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT) from None
  if isinstance(status, int):
    raise SystemExit(status)


_INTERRUPTED: list[int] = []


def _on_interrupt(signum, _frame):
  if _INTERRUPTED:  # a second Ctrl-C while the first unwinds (or was swallowed by a library): end now
    print("error: interrupted again: stopped at once", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)
  _INTERRUPTED.append(signum)
  raise KeyboardInterrupt


def writable_file(path: str | None, flag: str = "--out") -> None:
  """Refuses (OutputError) a file path that could not be written: a directory, a file that is not writable, or a
  path under a parent that is a file or not writable. Creates nothing (the writer makes the parents: `parent_made`)."""
  if not path:
    return
  if os.path.isdir(path):
    raise OutputError(f"{flag} {path} is a directory; give a file path")
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise OutputError(f"{flag} {path} is not writable")
  writable_dir(os.path.dirname(os.path.abspath(path)), flag, of=path)


def parent_made(path: str) -> str:
  """`path`, its parent directories created (an output path `writable_file` accepted may name new folders)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return path


def writable_dir(path: str, flag: str = "--out", of: str | None = None) -> None:
  """Refuses (OutputError) a directory that is a file, or that could not be created or written (the nearest existing
  ancestor decides). Creates nothing."""
  name = of or path
  probe = nearest_existing(path)
  if not os.path.isdir(probe):
    raise OutputError(f"{flag} {name}: {probe} is a file, not a directory")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise OutputError(f"{flag} {name}: {probe} is not writable")


def nearest_existing(path: str) -> str:
  """`path` (absolute) or its nearest ancestor that exists: what decides whether it can be created."""
  probe = os.path.abspath(path)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  return probe
