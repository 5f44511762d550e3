"""The paths a run records, absolute: --data (its NAME=PATH sources and globs too), --tokenizer and --init-from are made
absolute when the config is built (`DataSection`, `WeightsSection`), so the run and every tool that reads its
config.json later (research.sample, export, quantize) resolve the same file from any working directory; and the files
a run depends on beyond its data, the tokenizer and an `hf:` source's config.json, recorded with their sha256
(`fingerprints`, config.json's "files"), so a tool names in one line one that changed since (`changed`).

What is no local path stays as given: None, an empty value (the section's checks refuse it), a URL (`scheme://...`);
a glob keeps its pattern under an absolute directory. Runs written before recorded their paths as typed, relative to
the directory they started in: `start_dir` tells that directory from the run directory's path and the --out it
recorded, and `absolute(path, base)` resolves against it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

from research.data import DataError
from research.data.mixture import named_sources

HF = "hf:"  # --init-from hf:PATH: a Hugging Face directory
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def absolute(path: str | None, base: str | None = None) -> str | None:
  """`path` absolute (`~` expanded, `.` and `..` folded), relative to `base` (default: the working directory); None,
  a blank value and a URL as they are."""
  if path is None or not path.strip() or _URL.match(path):
    return path
  path = os.path.expanduser(path)
  return os.path.normpath(os.path.join(base, path)) if base is not None else os.path.abspath(path)


def absolute_source(source: str | None, base: str | None = None) -> str | None:
  """An --init-from source absolute: `hf:PATH` keeps its prefix, a run directory is a path."""
  if source is not None and source.startswith(HF):
    return HF + (absolute(source[len(HF):], base) or "")
  return absolute(source, base)


def absolute_data(entries: Sequence[str] | None, base: str | None = None) -> tuple[str, ...] | None:
  """--data's entries absolute: each path, or each NAME=PATH source's path (one entry per source); entries that
  `named_sources` refuses stay as given, to be refused in one line when the data is read."""
  if not entries:
    return None if entries is None else tuple(entries)
  try:
    named = named_sources(entries)
  except DataError:
    return tuple(entries)
  if named is None:
    return tuple(absolute(e, base) or e for e in entries)
  return tuple(f"{name}={absolute(path, base)}" for name, path in named.items())


def is_relative(value: str | None, named: bool = False) -> bool:
  """Whether a recorded path is relative (a run's record written before paths were recorded absolute): an `hf:`
  source's directory, and with `named` (an entry of --data) a NAME=PATH source's path."""
  if value is None or not value.strip() or _URL.match(value):
    return False
  if value.startswith(HF):
    value = value[len(HF):]
  elif named and "=" in value and not value.startswith(("/", ".", "~")):  # research.data.mixture's rule
    value = value.partition("=")[2]
  return not os.path.isabs(os.path.expanduser(value))


def start_dir(run_dir: str, out: str | None) -> str | None:
  """The working directory a run was started in, told by its run directory's absolute path ending in the relative
  --out it recorded; None when it cannot be told (--out was absolute, or the directory was moved or renamed)."""
  if not out or os.path.isabs(os.path.expanduser(out)):
    return None
  here, tail = os.path.abspath(run_dir), os.path.normpath(out)
  if tail == ".":
    return here
  if tail.startswith("..") or not here.endswith(os.sep + tail):
    return None
  return here[:-len(tail) - 1] or os.sep


def tokenizer_file(path: str) -> str:
  """The tokenizer.json that --tokenizer names (a file, or a directory holding one)."""
  return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def sha256(file: str) -> str:
  h = hashlib.sha256()
  with open(file, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def fingerprints(tokenizer: str | None, init_from: str | None) -> dict:
  """config.json's "files": {"tokenizer": {"path", "sha256"}, "init_from": ...} for the tokenizer.json and an `hf:`
  source's config.json (not its weights: too large to hash at every start), those that exist. An optlab run
  directory as the source is not hashed: its config.json changes whenever it is resumed."""
  files = {"tokenizer": tokenizer and tokenizer_file(tokenizer),
           "init_from": init_from and init_from.startswith(HF) and os.path.join(init_from[len(HF):], "config.json")}
  return {k: {"path": f, "sha256": sha256(f)} for k, f in files.items() if f and os.path.isfile(f)}


def changed(record: dict | None, file: str) -> str | None:
  """How `file` differs from its `fingerprints` record ("has changed since (sha256 ... then, ... now)"); None when it
  does not, or when nothing was recorded (a run written before the records)."""
  if not record or "sha256" not in record:
    return None
  now = sha256(file)
  if now == record["sha256"]:
    return None
  return f"has changed since (sha256 {record['sha256'][:12]}… then, {now[:12]}… now)"
