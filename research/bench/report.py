"""How the benchmarks report: the machine line, a markdown table, and the text printed and (with --out) written."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import subprocess
import time
from pathlib import Path

import jax

from research import entry


def run_child(cmd: list[str], logs: str) -> tuple[int, int, str, str, float]:
  """Runs `cmd` in a fresh child process, its output kept in `logs`.stdout.log / .stderr.log; returns (exit status,
  the child's own peak RSS in bytes (`os.wait4`'s ru_maxrss, not all children's), stdout, stderr, wall seconds)."""
  t = time.perf_counter()
  os.makedirs(os.path.dirname(logs) or ".", exist_ok=True)
  with open(logs + ".stdout.log", "w") as out, open(logs + ".stderr.log", "w") as err:
    child = subprocess.Popen(cmd, stdout=out, stderr=err)
    _, status, usage = os.wait4(child.pid, 0)
  child.returncode = code = os.waitstatus_to_exitcode(status)
  stdout, stderr = (Path(f"{logs}.{k}.log").read_text() for k in ("stdout", "stderr"))
  return code, usage.ru_maxrss * 1024, stdout, stderr, time.perf_counter() - t


def machine() -> str:
  """"jax 0.10.2, cpu (cpu), 8 devices": what every table is measured on."""
  dev = jax.devices()[0]
  return f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), {jax.device_count()} devices"


def git_commit() -> str:
  """HEAD's short hash, marked dirty when tracked files differ from it (the record of what was measured)."""
  run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout
  head = run("rev-parse", "--short", "HEAD").strip() or "unknown"
  return head + (" (dirty)" if run("status", "--porcelain", "--untracked-files=no").strip() else "")


def call_command(name: str, fn, args: dict) -> str:
  """The command line that reruns benchmark `name`, the function `fn` called with `args` ({parameter: value}):
  `python -m research.bench NAME` and each argument that differs from `fn`'s default as `--name VALUE...`."""
  params = inspect.signature(fn).parameters
  parts = ["python -m research.bench", name]
  for key, value in args.items():
    if value != params[key].default:
      parts += ["--" + key.replace("_", "-"), *map(str, value if isinstance(value, tuple) else (value,))]
  return " ".join(parts)


def command(name: str, args) -> str:
  """The command line that reruns benchmark `name` with the dataclass `args`: `python -m research.bench NAME` and
  each field that differs from its default as `--field-name VALUE` (a sequence as its items)."""
  parts = ["python -m research.bench", name]
  for f in dataclasses.fields(args):
    value = getattr(args, f.name)
    if f.default is not dataclasses.MISSING and value == f.default:
      continue
    if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
      continue
    values = value if isinstance(value, (tuple, list)) else [value]
    parts += ["--" + f.name.replace("_", "-"), *(shlex.quote(str(v)) for v in values)]
  return " ".join(parts)


def table(cols: list[str], rows: list[list[str]]) -> list[str]:
  """A markdown table's lines: the header, its rule, one line per row of cells."""
  return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]


def publish(lines: list[str], out: str | None, preface: str = "") -> str:
  """Prints the lines as one text and, given `out`, writes `preface` + the text to that file; returns the text."""
  text = "\n".join(lines)
  print(text)
  if out:
    with open(entry.parent_made(out), "w") as f:
      f.write(preface + text + "\n")
  return text


class Progress:
  """A long benchmark's report as it grows: `emit()` prints the lines added since the last call and rewrites `out`
  (command + all lines so far), so a run that is stopped keeps every finished section."""

  def __init__(self, command: str, out: str | None, lines: list[str] | None = None):
    self.command, self.out, self.lines, self.printed = command, out, list(lines or []), 0

  def emit(self):
    print("\n".join(self.lines[self.printed:]), flush=True)
    self.printed = len(self.lines)
    if self.out:
      with open(entry.parent_made(self.out), "w") as f:
        f.write(f"Command: `{self.command}`\n\n" + "\n".join(self.lines) + "\n")
