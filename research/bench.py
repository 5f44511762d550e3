"""Benchmarks, one function per benchmark, chosen by name.

  python -m research.bench train                            # small and base, 1 device and 8 simulated ones
  python -m research.bench train --presets base --meshes data=1 fsdp=8 --steps 10 --out runs/bench_train.md
  python -m research.bench optim --out research/results/bench_optim.md     # research/bench_optim.py
  python -m research.bench comm --out research/results/bench_comm.md       # research/bench_comm.py
  python -m research.bench reshard --out research/results/bench_reshard.md # research/bench_reshard.py
  python -m research.bench moe --out research/results/bench_moe.md         # research/bench_moe.py
  python -m research.bench ckpt --out research/results/bench_ckpt.md       # research/bench_ckpt.py
  python -m research.bench dion --out research/results/bench_dion_comm.md  # research/bench_dion_comm.py
  python -m research.bench attention --out research/results/bench_attention.md  # research/bench_attention.py

`train` times the real train step of research/train.py (AdamW, grad clipping, fp32) and reports
compile time, steady step time, tokens/s, model FLOP/s and MFU against a matmul rate measured in
the same run. On the CPU the 8 "devices" are simulated (`jax_num_cpu_devices`) and share the
machine's cores, so the 8-device rows measure partitioning overhead, not scaling.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import ConfigError, Transformer, TransformerConfig, count_params, flops_per_token, preset
from models.attention import AttentionError
from research.bench_attention import attention
from research.bench_ckpt import ckpt_bench
from research.bench_dion_comm import dion_comm
from research.bench_report import machine, publish, table
from research.bench_comm import comm
from research.bench_moe import moe
from research.bench_optim import optim_step
from research.bench_reshard import reshard_bench
from research.data import get_batch, load_corpus
from research.throughput import measure_matmul_flops
from research.train import TrainConfig, _model_config, _optimizer, make_steps
from sharding import (MeshError, ShardingError, batch_sharding, devices_for, init_train_state, make_mesh,
                      mesh_spec)

NUM_CPU_DEVICES = 8
MATMUL_TRIALS = 5
# (batch, seq) per preset when --batch-size / --seq-len are not given.
DEFAULT_SHAPES = {"tiny": (16, 128), "small": (16, 128), "base": (8, 256)}


def concurrent_matmul_flops(n: int, devices, repeats: int = 5) -> float:
  """FLOP/s of one m x n x n fp32 matmul (m = n rounded down to a multiple of k = len(devices)) split by
  rows over `devices`: each runs an (m/k) x n x n piece at once."""
  k = len(devices)
  m = n // k * k
  mesh = jax.make_mesh((k,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
  rows, full = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  a = jax.device_put(jnp.ones((m, n), jnp.float32), rows)
  b = jax.device_put(jnp.ones((n, n), jnp.float32), full)
  f = jax.jit(lambda x, y: x @ y, out_shardings=rows)  # no communication: each device keeps its rows
  f(a, b).block_until_ready()
  t = time.perf_counter()
  for _ in range(repeats):
    f(a, b).block_until_ready()
  return 2 * m * n * n * repeats / (time.perf_counter() - t)


class TrainStep(NamedTuple):
  """A train step as research/train.py builds it, not yet compiled."""
  cfg: TrainConfig
  mcfg: TransformerConfig
  mesh: Mesh
  state: dict  # created sharded on `mesh`
  step: Callable  # make_steps' jitted train step (donates the state)
  batch_sh: NamedSharding


def build_train_step(preset_name: str, spec: str, batch_size: int, seq_len: int, **flags) -> TrainStep:
  """The real train step (research/train.py: `_model_config`, `_optimizer`, `init_train_state`, `make_steps`) of a
  preset on the mesh `spec`; `flags` are further TrainConfig fields (e.g. attention="flash", n_layers=2)."""
  cfg = TrainConfig(model=preset_name, batch_size=batch_size, seq_len=seq_len, mesh=spec, **flags)
  mcfg = _model_config(cfg)
  mesh = make_mesh(spec, devices=devices_for(spec))
  tx, _ = _optimizer(cfg)
  graphdef, state, shardings = init_train_state(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)), tx, mesh)
  batch_sh = batch_sharding(mesh, (batch_size, seq_len))
  train_step, _ = make_steps(graphdef, tx, shardings, batch_sh)
  return TrainStep(cfg, mcfg, mesh, state, train_step, batch_sh)


def time_train_step(preset_name: str, spec: str, batch_size: int, seq_len: int, warmup: int, steps: int, corpus,
                    max_bytes: float | None = None, **flags) -> dict:
  """Compile times, median step time, tokens/s and model FLOP/s of `build_train_step(...)` over `warmup` untimed and
  `steps` timed steps on the corpus's first batches; with the compiled step's temp and argument bytes per device.
  A step whose temp + argument + output bytes exceed `max_bytes` is not run: the row then has "skipped" (why)."""
  cfg, mcfg, mesh, state, train_step, batch_sh = build_train_step(preset_name, spec, batch_size, seq_len, **flags)
  batches = [tuple(jax.device_put(a, batch_sh) for a in get_batch(corpus.train, cfg.seed, s, batch_size, seq_len))
             for s in range(warmup + steps)]
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    lowered = train_step.lower(state, *batches[0])
    t1 = time.perf_counter()
    step = lowered.compile()
    t2 = time.perf_counter()
    mem = step.memory_analysis()
    row = {"preset": preset_name, "params": count_params(mcfg), "mesh": mesh_spec(mesh), "devices": mesh.size,
           "batch": batch_size, "seq": seq_len, "lower_s": t1 - t0, "compile_s": t2 - t1,
           "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes}
    need = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    if max_bytes is not None and need > max_bytes:
      return {**row, "skipped": f"needs {need / 2 ** 30:.1f} GiB > budget {max_bytes / 2 ** 30:.1f} GiB"}
    times, cpu = [], 0.0
    for i, (x, y) in enumerate(batches):
      t, c = time.perf_counter(), time.process_time()
      state, metrics = step(state, x, y)
      jax.block_until_ready((state, metrics))
      if i >= warmup:
        times.append(time.perf_counter() - t)
        cpu += time.process_time() - c
  loss = float(metrics["loss"])
  if not np.isfinite(loss):
    raise SystemExit(f"error: {preset_name} on {spec} gave a non-finite loss {loss}")
  step_s = statistics.median(times)
  tokens_per_s = batch_size * seq_len / step_s
  return {**row, "step_s": step_s, "step_min_s": min(times), "step_max_s": max(times), "tokens_per_s": tokens_per_s,
          "cpu_busy": cpu / sum(times) / os.cpu_count(),
          "model_flops": flops_per_token(mcfg, seq_len) * tokens_per_s, "loss": loss}


def train(presets: tuple[str, ...] = ("small", "base"),
          meshes: tuple[str, ...] = ("data=1", "data=2,fsdp=2,tensor=2"),
          batch_size: int | None = None, seq_len: int | None = None, warmup: int = 3, steps: int = 5,
          matmul_n: int = 2048, out: str | None = None) -> list[dict]:
  """Train-step speed and MFU of each preset on each mesh, fp32, AdamW with clipping (research/train.py).

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


BENCHMARKS = {"train": train, "optim": optim_step, "comm": comm, "reshard": reshard_bench, "moe": moe,
              "ckpt": ckpt_bench, "dion": dion_comm, "attention": attention}


def main(argv=None):
  try:
    jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)  # before any device use
  except RuntimeError:  # backend already up (a test or notebook set it): keep what is there
    pass
  try:
    tyro.extras.subcommand_cli_from_dict(BENCHMARKS, args=argv)
  except (ConfigError, MeshError, ShardingError, AttentionError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


if __name__ == "__main__":
  main()
