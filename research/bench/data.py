"""`python -m research.bench data`: a token corpus larger than a third of this machine's RAM, trained on through the
memory-mapped grain loader, against the same run on a small corpus.

Question: does a corpus that cannot sit in memory cost the trainer memory, and does the loader keep ahead of the step?
  1. A synthetic corpus of `gb` GB of uint16 tokens (uniform over the byte vocabulary: the presets' 256 ids) is written
     once to `work/` in chunks (never whole in memory), and a small one of `small_mb` MB (its first tokens).
  2. The loader alone (research/data/loader.py, this process, the run's sampling, batch and sequence length) reads
     `loader_batches` batches of the big corpus through its prefetching iterator: tokens/s, with `workers` threads and
     with none.
  3. The train CLI trains `steps` steps on each corpus in a fresh child process (same model, batch, mesh): each child's
     peak RSS (`os.wait4`'s ru_maxrss) and the run's tokens/s (metrics.jsonl's `run_tokens_per_s`, compilation
     excluded). The small corpus's run is the model's own needs; the difference is what the big corpus costs.
     (Linux carries a process's RSS high-water mark across exec, so a child's ru_maxrss is at least this process's
     peak when it was started: this process stays small — the loader reads with pread, never through a map.)
Finished parts are kept in `work/results.json`, so a rerun continues.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated

import numpy as np

from research import flags
from research.bench.report import Progress, call_command, machine, run_child, table
from research.data.loader import SAMPLINGS, Loader

GB, GIB = 10 ** 9, 2 ** 30


def write_tokens(path: str, n_bytes: int, seed: int = 0, chunk: int = 1 << 27) -> float:
  """`n_bytes` of uniform uint16 tokens in [0, 256) at `path` (kept when already that size); the seconds it took."""
  if os.path.exists(path) and os.path.getsize(path) == n_bytes:
    return 0.0
  t, rng = time.perf_counter(), np.random.default_rng(seed)
  with open(path + ".partial", "wb") as f:
    for start in range(0, n_bytes, chunk):
      rng.integers(0, 256, size=min(chunk, n_bytes - start) // 2, dtype=np.uint16).tofile(f)
  os.replace(path + ".partial", path)
  return time.perf_counter() - t


def loader_rate(path: str, batch_size: int, seq_len: int, sampling: str, workers: int, batches: int) -> float:
  """Tokens per second the loader delivers over the corpus at `path` (the first batch, which starts the threads, not
  timed)."""
  it = Loader(np.memmap(path, dtype=np.uint16, mode="r"), batch_size=batch_size, seq_len=seq_len, seed=0,
              sampling=sampling, workers=workers).iterator()
  next(it)
  t = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches * batch_size * seq_len / (time.perf_counter() - t)


def train_run(path: str, run_dir: str, flags: list[str]) -> dict:
  """The train CLI on the corpus at `path` in a fresh child: exit status, peak RSS, tokens/s, losses."""
  cmd = [sys.executable, "-m", "research.train", "--data", path, "--out", run_dir, *flags]
  code, rss, _, stderr, wall = run_child(cmd, run_dir)
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))] if code == 0 else []
  return {"command": " ".join(["python", "-m", "research.train"] + cmd[3:]), "exit": code, "peak_rss": rss,
          "wall_s": wall, "tokens_per_s": records[-1].get("run_tokens_per_s") if records else None,
          "losses": [r["loss"] for r in records], "error": stderr.strip().splitlines()[-1] if code else None}


def data(gb: float = 8.0, small_mb: int = 64, model: str = "small", batch_size: int = 16, seq_len: int = 128,
         steps: int = 30, sampling: Annotated[str, flags.one_of(*SAMPLINGS)] = "shuffle", workers: int = 2,
         loader_batches: int = 2000,
         mesh: str = "data=2,fsdp=2,tensor=2", devices: int = 8, work: str = "runs/bench-data",
         out: str | None = None) -> dict:
  """Trains on a `gb`-GB token corpus and on a `small_mb`-MB one; tabulates the loader's and the step's tokens/s and
  each run's peak RSS (see the module docstring)."""
  os.makedirs(work, exist_ok=True)
  big, small = (os.path.join(work, f"tokens-{n}.bin") for n in (f"{gb:g}gb", f"{small_mb}mb"))
  saved = os.path.join(work, "results.json")
  done = json.load(open(saved)) if os.path.exists(saved) else {}
  args = {k: v for k, v in locals().items() if k in ("gb", "small_mb", "model", "batch_size", "seq_len", "steps",
                                                     "sampling", "workers", "loader_batches", "mesh", "devices",
                                                     "work")}

  def keep(key, fn):
    if key not in done:
      print(f"[data] {key} ...", file=sys.stderr, flush=True)
      done[key] = fn()
      json.dump(done, open(saved + ".tmp", "w"), indent=1)
      os.replace(saved + ".tmp", saved)
    return done[key]

  written = write_tokens(big, int(gb * GB) // 2 * 2) + write_tokens(small, small_mb * 2 ** 20)
  flags = ["--model", model, "--steps", str(steps), "--batch-size", str(batch_size), "--seq-len", str(seq_len),
           "--mesh", mesh, "--devices", str(devices), "--sampling", sampling, "--data.workers", str(workers),
           "--eval-every", str(steps),
           "--eval-batches", "2", "--log-every", str(steps), "--ckpt-every", str(steps), "--keep", "1",
           "--no-progress", "--no-compile-cache", "--tracker", "none"]  # both compile: like for like
  rates = {w: keep(f"loader_{w}_threads", lambda w=w: loader_rate(big, batch_size, seq_len, sampling, w,
                                                                   loader_batches)) for w in (workers, 0)}
  runs = {k: keep(f"train_{k}", lambda p=p, k=k: train_run(p, os.path.join(work, "runs", k), flags))
          for k, p in (("small", small), ("big", big))}
  progress = Progress(call_command("data", data, args), out, [
      f"{machine()}; {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.1f} GiB "
      f"RAM. Corpus: {os.path.getsize(big) / GB:.2f} GB of uint16 tokens (written in {written:.0f} s this run, or "
      f"earlier) vs {small_mb} MiB. Train: `--model {model}`, {steps} steps of {batch_size} x {seq_len}, mesh {mesh}, "
      f"--sampling {sampling}, fresh child process per run.", ""])
  rows = [[k, "trained" if r["exit"] == 0 else f"exit {r['exit']}: {r['error']}", f"{r['peak_rss'] / GIB:.2f}",
           f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-", f"{r['wall_s']:.0f}"] for k, r in runs.items()]
  progress.lines += table(["corpus", "outcome", "peak RSS GiB", "train tokens/s", "wall s"], rows) + [""]
  step_rate = runs["big"]["tokens_per_s"]
  extra = (runs["big"]["peak_rss"] - runs["small"]["peak_rss"]) / GIB
  progress.lines += table(["measure", "value"], [
      ["peak RSS, big corpus − small corpus", f"{extra:+.2f} GiB (target < 2 GiB)"],
      [f"loader alone, {workers} threads", f"{rates[workers]:,.0f} tokens/s"],
      ["loader alone, no threads", f"{rates[0]:,.0f} tokens/s"],
      ["loader / train step (big corpus)",
       f"{rates[workers] / step_rate:.0f}x (target ≥ 10x)" if step_rate else "-"]]) + [""]
  progress.lines += [f"- `{k}`: `{r['command']}`" for k, r in runs.items()] + [""]
  progress.emit()
  return {"runs": runs, "loader_tokens_per_s": rates, "extra_rss_gib": extra}
