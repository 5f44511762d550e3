"""The timing helpers every benchmark shares: the real train step built as the trainer builds it
(`build_train_step`), timed (`time_train_step`), and a matmul rate split over several devices
(`concurrent_matmul_flops`, for MFU on a mesh)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import Transformer, TransformerConfig, count_params, flops_per_token
from research.data import get_batch
from research.train.config import TrainConfig
from research.train.setup.build import make_optimizer, model_config, optimizer_needs, step_options
from research.train.setup.plan import Plan
from research.train.steps import train_state
from research.train.steps.step import make_steps
from sharding import batch_sharding, devices_for, make_mesh, mesh_spec


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


def trainer_plan(cfg: TrainConfig, mcfg: TransformerConfig | None = None, mesh: Mesh | None = None) -> Plan:
  """The run's plan (research/train/setup/plan.py) as the trainer resolves it, for a benchmark or a test that builds
  the trainer's pieces one by one.

  Args:
    cfg: the run's config.
    mcfg: the model config, when not the flags' (a benchmark's shape); None: the flags'.
    mesh: the mesh, when not --mesh's first devices; None: those.

  Returns:
    The `Plan`.
  """
  needs = optimizer_needs(cfg.optim)
  mesh = mesh if mesh is not None else make_mesh(cfg.mesh.spec, devices=devices_for(cfg.mesh.spec))
  mcfg = mcfg if mcfg is not None else model_config(cfg.model, cfg.moe, cfg.weights.init_from, needs)
  return Plan.of(cfg.optim, needs, mcfg, mesh, cfg.trains, cfg.weights.init_from, cfg.sync, cfg.features(),
                 cfg.training.seed, cfg.mesh.zero1)


def trainer_optimizer(cfg: TrainConfig, freeze: bool = True):
  """(optimizer, schedule) as the trainer builds them (`build.make_optimizer`); `freeze`: with --freeze applied."""
  needs = optimizer_needs(cfg.optim)
  return make_optimizer(cfg.optim, cfg.training.steps, needs, cfg.trains.freeze if freeze else None)


class TrainStep(NamedTuple):
  """A train step as research/train/ builds it, not yet compiled."""
  cfg: TrainConfig
  mcfg: TransformerConfig
  mesh: Mesh
  state: dict  # created sharded on `mesh`
  step: Callable  # make_steps' jitted train step (donates the state)
  batch_sh: NamedSharding


def build_train_step(preset_name: str, spec: str, batch_size: int, seq_len: int, **flags) -> TrainStep:
  """The real train step (research/train/: `model_config`, `make_optimizer`, `init_train_state`, `make_steps`) of a
  preset on the mesh `spec`; `flags` are further TrainConfig fields (e.g. attention="flash", n_layers=2)."""
  cfg = TrainConfig(model=preset_name, batch_size=batch_size, seq_len=seq_len, mesh=spec, **flags)
  plan = trainer_plan(cfg)
  mcfg, mesh = plan.model, plan.mesh
  tx, _ = trainer_optimizer(cfg)
  graphdef, state, shardings = train_state.create(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.training.seed)), tx,
                                                  mesh)
  batch_sh = batch_sharding(mesh, (batch_size, seq_len))
  train_step, _ = make_steps(graphdef, tx, shardings, batch_sh, **step_options(plan))
  return TrainStep(cfg, mcfg, mesh, state, train_step, batch_sh)


def time_train_step(preset_name: str, spec: str, batch_size: int, seq_len: int, warmup: int, steps: int, corpus,
                    max_bytes: float | None = None, **flags) -> dict:
  """Compile times, median step time, tokens/s and model FLOP/s of `build_train_step(...)` over `warmup` untimed and
  `steps` timed steps on the corpus's first batches; with the compiled step's temp and argument bytes per device.
  A step whose temp + argument + output bytes exceed `max_bytes` is not run: the row then has "skipped" (why)."""
  cfg, mcfg, mesh, state, train_step, batch_sh = build_train_step(preset_name, spec, batch_size, seq_len, **flags)
  batches = [tuple(jax.device_put(a, batch_sh) for a in get_batch(corpus.train, cfg.training.seed, s, batch_size,
                                                                   seq_len)) for s in range(warmup + steps)]
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
