"""Prints, as JSON, `python -m MODULE [SUB] --help` for each (module, sub) pair read as JSON from stdin, all in this
one process (one Python start-up and one import of JAX for every command, not one each). Each entry is
[exit status, stdout, stderr]; run by tests/docs/test_commands.py with COLUMNS=120."""

import contextlib
import io
import json
import runpy
import sys
import warnings


def help_text(module: str, sub: str | None) -> tuple[int, str, str]:
  """(exit status, stdout, stderr) of `python -m module [sub] --help`, run in this process."""
  # UTF-8 streams, as a terminal's or a pipe's: rich draws its boxes in ASCII on a stream with no encoding
  out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
  argv, sys.argv = sys.argv, [module, *([sub] if sub else []), "--help"]
  code, crash = 0, ""
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
      # runpy warns when an earlier command imported this module (research.sweep, imported by the experiments)
      warnings.simplefilter("ignore", RuntimeWarning)
      runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except Exception as e:  # noqa: BLE001 — reported to the test as a failed command
    code, crash = 1, f"{type(e).__name__}: {e}"
  finally:
    sys.argv = argv
  text = [stream.detach().getvalue().decode() for stream in (out, err)]
  return code, text[0], text[1] + crash


if __name__ == "__main__":
  pairs = json.load(sys.stdin)
  json.dump({f"{m} {s or ''}": help_text(m, s) for m, s in pairs}, sys.stdout)
