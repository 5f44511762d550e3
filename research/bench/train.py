"""`python -m research.bench train`: speed and MFU of the real train step of each preset on each mesh.

`train` times the real train step of the trainer (research/train/steps/step.py: AdamW, grad clipping, fp32) and reports
compile time, steady step time, tokens/s, model FLOP/s and MFU against a matmul rate measured in
the same run. On the CPU the 8 "devices" are simulated (`jax_num_cpu_devices`) and share the
machine's cores, so the 8-device rows measure partitioning overhead, not scaling.
"""

from __future__ import annotations

import statistics
import sys
import time

from models import preset
from research.bench.report import machine, publish, table
from research.bench.timing import concurrent_matmul_flops, time_train_step
from research.data import load_corpus
from research.train.hooks.throughput import measure_matmul_flops
from sharding import devices_for, make_mesh

MATMUL_TRIALS = 5
# (batch, seq) per preset when --batch-size / --seq-len are not given.
DEFAULT_SHAPES = {"tiny": (16, 128), "small": (16, 128), "base": (8, 256)}


def train(presets: tuple[str, ...] = ("small", "base"),
          meshes: tuple[str, ...] = ("data=1", "data=2,fsdp=2,tensor=2"),
          batch_size: int | None = None, seq_len: int | None = None, warmup: int = 3, steps: int = 5,
          matmul_n: int = 2048, out: str | None = None) -> list[dict]:
  """Train-step speed and MFU of each preset on each mesh, fp32, AdamW with clipping (research/train/).

  Compile time is lower + compile wall time of the jitted step (`.lower(...).compile()`); the step
  time is the median of `steps` timed calls after `warmup` untimed ones, each ended by
  block_until_ready. Model FLOP/s = models.flops_per_token x tokens/s. MFU is relative to an
  n^3 fp32 matmul on device 0 (`MFU`) and, for multi-device meshes, to the same matmul split by
  rows over the mesh's devices and run concurrently (`MFU mesh`). `CPU busy` is this process's
  CPU time over wall time x cores during the timed steps: low values mean idle cores or other
  processes taking them.

  Args:
    presets: model presets to run.
    meshes: mesh specs; each uses the first prod(sizes) devices ("data=1" = one device).
    batch_size: global batch for every preset (default per preset: small 16, base 8).
    seq_len: sequence length for every preset (default per preset: small 128, base 256).
    warmup: untimed steps after compilation.
    steps: timed steps (the median is reported).
    matmul_n: size of the reference matmul.
    out: also write the table (markdown) to this file.
  """
  t_start = time.perf_counter()
  for name in presets:  # fail on a bad preset or mesh before spending minutes measuring
    preset(name)
  for spec in meshes:
    make_mesh(spec, devices=devices_for(spec))
  # Median of several timings: on a shared VM one timing of a ~50 ms matmul varies by up to +-25%.
  peak = statistics.median(measure_matmul_flops(matmul_n, repeats=5) for _ in range(MATMUL_TRIALS))
  peak_mesh = {}
  for spec in meshes:
    devs = devices_for(spec)
    if len(devs) > 1 and len(devs) not in peak_mesh:
      peak_mesh[len(devs)] = statistics.median(concurrent_matmul_flops(matmul_n, devs) for _ in range(MATMUL_TRIALS))
  header = (f"{machine()}; fp32 {matmul_n}^3 matmul on device 0: {peak / 1e9:.1f} GFLOP/s"
            + "".join(f"; split over {k} devices concurrently: {r / 1e9:.1f} GFLOP/s" for k, r in peak_mesh.items()))
  print(header, file=sys.stderr, flush=True)

  corpus = load_corpus()
  rows = []
  for name in presets:
    b, t = DEFAULT_SHAPES.get(name, (16, 128))
    b, t = batch_size or b, seq_len or t
    for spec in meshes:
      r = time_train_step(name, spec, b, t, warmup, steps, corpus)
      r["mfu"] = r["model_flops"] / peak
      r["mfu_mesh"] = r["model_flops"] / peak_mesh[r["devices"]] if r["devices"] > 1 else r["mfu"]
      rows.append(r)
      print(f"  {name} on {r['mesh']}: step {r['step_s'] * 1e3:.0f} ms, MFU {r['mfu']:.1%}", file=sys.stderr,
            flush=True)

  cols = ["preset", "params", "mesh", "batch x seq", "lower+compile s", "step ms (min-max)", "tokens/s",
          "model GFLOP/s", "MFU", "MFU mesh", "CPU busy"]
  lines = [header, ""] + table(cols, [[
        r["preset"], f"{r['params'] / 1e6:.1f}M", r["mesh"], f"{r['batch']} x {r['seq']}",
        f"{r['lower_s'] + r['compile_s']:.1f}",
        f"{r['step_s'] * 1e3:.0f} ({r['step_min_s'] * 1e3:.0f}-{r['step_max_s'] * 1e3:.0f})",
        f"{r['tokens_per_s']:.0f}", f"{r['model_flops'] / 1e9:.1f}", f"{r['mfu']:.1%}", f"{r['mfu_mesh']:.1%}",
        f"{r['cpu_busy']:.0%}"] for r in rows])
  # The same matmul again: other processes on a shared machine show up as a drift between the two.
  peak_end = statistics.median(measure_matmul_flops(matmul_n, repeats=5) for _ in range(MATMUL_TRIALS))
  lines += ["", f"warmup {warmup}, timed {steps} (median); device-0 matmul re-measured at end: "
            f"{peak_end / 1e9:.1f} GFLOP/s; total wall time {time.perf_counter() - t_start:.0f} s"]
  publish(lines, out)
  return rows
