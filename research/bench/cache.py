"""`python -m research.bench cache`: what checking a data cache against its meta.json adds to a process's start-up.

Question: the data caches (research/data/corpus.py, tokenized.py, shards.py) hash their token files with sha256 and
compare the result with the fingerprint meta.json records the first time a process maps them (a file that does not
match is rebuilt, never served); what does that cost a run's start-up, from a cold and from a warm page cache?
  1. In `work/`, a cache of about `gb` GB of each layout: the byte corpus's (`corpus.write_cache`: train.bin, val.bin
     and meta.json, as the stdlib corpus is cached; the tokenized cache has the same layout and check) and the
     structured-data token shards (`build_shards` over text files written there for it, encoded as bytes: train.bin,
     val.bin, train_docs.npy, val_docs.npy and meta.json; the text files are deleted once it is built). Both are kept
     for a rerun.
  2. Each cache is opened in a fresh child process, as a run's start-up opens it (the module's own open function,
     timed alone: not the imports), `REPEATS` times each way: with the check, and without it (the hash replaced by
     `True`: the size-only open of before); cold (the files' pages dropped from the page cache first with
     posix_fadvise DONTNEED) and warm (the files read once just before). The same child then opens the cache a second
     time: what a process pays after its first open (the check is remembered while the files are unchanged).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

from research.bench.report import Progress, call_command, git_commit, machine, run_child, table
from research.data import corpus, shards

GB, REPEATS = 10 ** 9, 5

CHILD = """
import json, os, sys, time
from research.data import cache, corpus, shards
kind, folder, check, cold = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
if not check:
  cache.hashes_to = shards.hashes_to = lambda paths, sha256: True  # the size-only open of before
for name in os.listdir(folder):
  with open(os.path.join(folder, name), "rb") as f:
    if cold:
      os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    else:
      while f.read(1 << 26):
        pass
open_cache = corpus._read_cache if kind == "bytes" else shards._open
times = []
for _ in range(2):
  t = time.perf_counter()
  got, problem = open_cache(folder)
  times.append(time.perf_counter() - t)
  assert got is not None, problem
print(json.dumps(times))
"""


def _byte_cache(folder: str, n_bytes: int, seed: int = 0) -> float:
  """A byte corpus cache of `n_bytes` printable ASCII bytes (5% of them val) in `folder`, written by the corpus
  module's own writer (kept when its meta.json is there); the seconds it took."""
  if os.path.exists(os.path.join(folder, "meta.json")):
    return 0.0
  t = time.perf_counter()
  data = np.random.default_rng(seed).integers(32, 127, size=n_bytes, dtype=np.uint8)
  train, val = data[:n_bytes - n_bytes // 20], data[n_bytes - n_bytes // 20:]
  meta = dict(fingerprint=corpus.corpus_fingerprint(train, val), train_bytes=len(train), val_bytes=len(val),
              source="research.bench.cache")
  if not corpus.write_cache(os.path.dirname(folder), folder, train, val, meta):
    raise OSError(f"cannot write {folder}")
  return time.perf_counter() - t


def _shards_cache(work: str, n_bytes: int, files: int = 250, seed: int = 1) -> tuple[str, float]:
  """(the folder, the seconds its build took) of the byte-level token shards `build_shards` makes of `files` text
  files of `n_bytes` together (written to `work/text/`, deleted after the build); a built one is found again through
  `work/shards.json`."""
  saved = os.path.join(work, "shards.json")
  if os.path.exists(saved):
    folder = json.load(open(saved))["folder"]
    if os.path.exists(os.path.join(folder, "meta.json")):
      return folder, 0.0
  t, text, rng = time.perf_counter(), os.path.join(work, "text"), np.random.default_rng(seed)
  os.makedirs(text, exist_ok=True)
  for i in range(files):
    line = rng.integers(97, 123, size=n_bytes // files, dtype=np.uint8)
    line[rng.integers(0, len(line), size=len(line) // 8)] = ord(" ")  # words
    line[::100] = ord("\n")
    line.tofile(os.path.join(text, f"doc{i:04d}.txt"))
  cache_dir = os.path.join(work, "cache")
  build = shards.build_shards(os.path.join(text, "*.txt"), cache_dir=cache_dir)
  (folder,) = [os.path.join(cache_dir, d) for d in os.listdir(cache_dir) if d.startswith("shards-")]
  assert build.fingerprint == json.load(open(os.path.join(folder, "meta.json")))["fingerprint"]
  shutil.rmtree(text)
  json.dump({"folder": folder}, open(saved, "w"))
  return folder, time.perf_counter() - t


def _sync(folder: str):
  """Every file of `folder` on disk, so its pages are clean and posix_fadvise can drop them."""
  for name in os.listdir(folder):
    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _open_times(kind: str, folder: str, check: bool, cold: bool, logs: str) -> tuple[float, float]:
  """(median seconds of a child's first open, median of its second) over REPEATS fresh children."""
  firsts, seconds = [], []
  for i in range(REPEATS):
    cmd = [sys.executable, "-c", CHILD, kind, folder, str(int(check)), str(int(cold))]
    code, _, stdout, stderr, _ = run_child(cmd, f"{logs}-{i}")
    if code != 0:
      raise RuntimeError(f"the {kind} child failed: {stderr.strip().splitlines()[-1] if stderr.strip() else code}")
    first, second = json.loads(stdout.strip().splitlines()[-1])
    firsts.append(first)
    seconds.append(second)
  return statistics.median(firsts), statistics.median(seconds)


def cache(gb: float = 1.0, work: str = "runs/bench-cache", out: str | None = None) -> dict:
  """Times a fresh process's first open of a ~`gb`-GB byte corpus cache and token-shards cache, with and without
  the check of their contents against meta.json, from a cold and a warm page cache (see the module docstring)."""
  args = dict(gb=gb, work=work)
  work = os.path.abspath(work)
  os.makedirs(work, exist_ok=True)
  n_bytes = int(gb * GB)
  byte_folder = os.path.join(work, "cache", "bytes")
  built = {"bytes": _byte_cache(byte_folder, n_bytes)}
  shard_folder, built["shards"] = _shards_cache(work, n_bytes)
  if any(built.values()):
    time.sleep(2.5)  # past corpus._RACY_NS: files this fresh are hashed at every open, older ones once per process
  folders = {"bytes": byte_folder, "shards": shard_folder}
  sizes = {k: sum(os.path.getsize(os.path.join(f, n)) for n in os.listdir(f)) for k, f in folders.items()}
  when = {k: f"built in {s:.0f} s" if s else "built earlier" for k, s in built.items()}
  progress = Progress(call_command("cache", cache, args), out, [
      f"{datetime.date.today()}, commit {git_commit()}; {machine()}; {os.cpu_count()} cores, load average "
      f"{os.getloadavg()[0]:.1f} at the start. Caches: "
      + ", ".join(f"{k} {sizes[k] / GB:.2f} GB ({when[k]})" for k in folders)
      + f"; each opened in a fresh child process, median of {REPEATS}.", ""])
  results, rows = {}, []
  for kind, folder in folders.items():
    _sync(folder)
    for cold in (True, False):
      got = {check: _open_times(kind, folder, check, cold, os.path.join(work, "logs", f"{kind}-{check}-{cold}"))
             for check in (False, True)}
      results[f"{kind}_{'cold' if cold else 'warm'}"] = {"size_only": got[False], "checked": got[True]}
      (plain, _), (checked, again) = got[False], got[True]
      rows.append([kind, f"{sizes[kind] / GB:.2f}", "cold" if cold else "warm", f"{plain:.3f}", f"{checked:.3f}",
                   f"{checked - plain:+.3f}", f"{sizes[kind] / GB / max(checked, 1e-9):.2f}", f"{again:.4f}"])
  progress.lines += table(["cache", "GB", "page cache", "open, size-only s", "open, checked s", "added s",
                           "checked GB/s", "second open s"], rows) + [""]
  added = {c: statistics.mean(r["checked"][0] - r["size_only"][0] for k, r in results.items() if k.endswith(c))
           for c in ("cold", "warm")}
  progress.lines += [
      "The check adds " + " and ".join(f"{a / gb:.2f} s per GB {c}" for c, a in added.items())
      + " to a process's first open of a cache (one sha256 pass over its token files, on one core); a second open in "
        f"the same process, its files unchanged, took at most {max(r['checked'][1] for r in results.values()):.4f} s.",
      ""]
  progress.emit()
  return {"sizes": sizes, "build_s": built, "opens": results}
