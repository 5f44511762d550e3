"""`python -m research.bench reshard`: an in-process mesh switch against a save + restore through orbax.

Question (DynaTrain, arXiv 2605.18815, §4 of shared/reference/methods.md): how much faster is moving a live
train state to a new layout in memory (`sharding.reshard`, one `jax.device_put` of every leaf) than the
checkpoint path a restart would take (orbax save to disk, then restore with the new mesh's shardings)?

For each preset, in one process and one run: the AdamW train state of research/train/ (fp32 params, two
moments, counters) is created on mesh `src`, then, alternately in each round,
  switch:  reshard(state, dst) with donate=True, until every leaf is ready; then back to `src` (untimed);
  orbax:   research.train.store.checkpoint.Checkpointer save (async write, waited for) + restore onto `dst`'s shardings,
           in a fresh temporary directory each round (so no old step is deleted during the timing).
The ratio is median(orbax) / median(switch). Also reported: the state's bytes, the bytes the switch must move
between devices (`sharding.moved_bytes`, the box-intersection lower bound) and the lower+compile time of the
train step for `dst`, which --switch-at pays before the switch (ahead of time) instead of at it.
On the CPU the "devices" are simulated and share host memory: a device-to-device move is a memcpy, so the
absolute times are not those of accelerators; the orbax side writes to the local disk.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from models import Transformer, count_params
from research.bench.report import machine, publish, table
from research.train.config import TrainConfig
from research.train.setup.build import make_optimizer, model_config, optimizer_needs
from research.train.steps.step import make_steps
from research.train.steps.train_state import TrainState
from research.train.store.checkpoint import Checkpointer
from sharding import (
  abstract_state,
  batch_sharding,
  devices_for,
  init_train_state,
  logical_names,
  make_mesh,
  mesh_spec,
  moved_bytes,
  reshard,
  state_shardings,
)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _check(state, host, shardings, what: str):
  if not all(np.array_equal(np.asarray(x), h) and x.sharding == s for x, h, s in
             zip(jax.tree.leaves(state), jax.tree.leaves(host), jax.tree.leaves(shardings))):
    raise SystemExit(f"error: {what} did not reproduce the state bit for bit")


def _time_preset(name: str, src: str, dst: str, rounds: int, compile_step: bool, tmp_root: str) -> dict:
  cfg = TrainConfig(model=name)
  needs = optimizer_needs(cfg.optim)
  mcfg = model_config(cfg.model, cfg.moe, cfg.weights.init_from, needs)
  tx, _ = make_optimizer(cfg.optim, cfg.training.steps, needs)
  model_fn = lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.training.seed))
  mesh_a = make_mesh(src, devices=devices_for(src))
  mesh_b = make_mesh(dst, devices=devices_for(dst))
  graphdef, state, sh_a = init_train_state(model_fn, tx, mesh_a)
  names = logical_names(model_fn)[2]
  sh_b = state_shardings(state, names, mesh_b)
  host = jax.tree.map(np.asarray, state)  # the values every path must reproduce
  row = {"preset": name, "params": count_params(mcfg), "src": mesh_spec(mesh_a), "dst": mesh_spec(mesh_b),
         "state_bytes": _nbytes(state), "moved_bytes": moved_bytes(state, sh_a, sh_b)}

  switch, save, restore = [], [], []
  for i in range(rounds + 1):  # round 0 warms up both paths (first transfers, orbax's thread pools)
    t = time.perf_counter()
    state = jax.block_until_ready(reshard(state, shardings=sh_b, donate=True))
    dt = time.perf_counter() - t
    state = jax.block_until_ready(reshard(state, shardings=sh_a, donate=True))  # back, untimed
    ckpt = Checkpointer(f"{tmp_root}/{name}-{i}", keep=1, every=1)
    t = time.perf_counter()
    ckpt.save(1, state, {"preset": name}, force=True)
    ckpt.manager.wait_until_finished()
    t1 = time.perf_counter()
    restored = jax.block_until_ready(ckpt.restore(1, state, sh_b))
    t2 = time.perf_counter()
    ckpt.close()
    if i == 0:
      _check(restored, host, sh_b, "orbax restore")
    else:
      switch.append(dt)
      save.append(t1 - t)
      restore.append(t2 - t1)
    del restored
  state = reshard(state, shardings=sh_b, donate=True)
  _check(state, host, sh_b, f"{2 * rounds + 3} switches")
  row.update(switch_s=statistics.median(switch), save_s=statistics.median(save),
             restore_s=statistics.median(restore), switch_all=switch,
             orbax_all=[s + r for s, r in zip(save, restore)])
  row["orbax_s"] = row["save_s"] + row["restore_s"]
  row["ratio"] = statistics.median(row["orbax_all"]) / row["switch_s"]
  if compile_step:
    batch_sh = batch_sharding(mesh_b, (cfg.training.batch_size, cfg.training.seq_len))
    train_step, _ = make_steps(graphdef, tx, TrainState.of(sh_b), batch_sh)
    x = jax.ShapeDtypeStruct((cfg.training.batch_size, cfg.training.seq_len), np.int32, sharding=batch_sh)
    t = time.perf_counter()
    with jax.set_mesh(mesh_b):
      train_step.lower(TrainState.of(abstract_state(state, sh_b)), x, x).compile()
    row["compile_s"] = time.perf_counter() - t
  return row


def reshard_bench(presets: tuple[str, ...] = ("small", "base"), src: str = "fsdp=8", dst: str = "data=2,tensor=4",
                  rounds: int = 5, compile_step: bool = True, tmp_dir: str | None = None,
                  out: str | None = None) -> list[dict]:
  """In-process switch (sharding.reshard) vs orbax save + restore onto the new mesh, AdamW train state.

  Args:
    presets: model presets (research/train/'s AdamW with clipping; its default batch 16 x 128 for the compile).
    src: mesh the state starts on.
    dst: mesh it moves to; a spec with fixed sizes uses the first devices it needs (e.g. fsdp=4: 4 of 8).
    rounds: timed rounds (medians reported) after one warm-up round.
    compile_step: also time lower + compile of the train step for `dst` (what --switch-at does ahead of time).
    tmp_dir: where orbax writes (default: the system temp dir); each round uses a fresh subdirectory.
    out: also write the table (markdown) to this file.
  """
  t_start = time.perf_counter()
  for spec in (src, dst):
    make_mesh(spec, devices=devices_for(spec))  # a bad spec fails before minutes of measuring
  rows = []
  with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="bench_reshard-") as tmp_root:
    for name in presets:
      r = _time_preset(name, src, dst, rounds, compile_step, tmp_root)
      rows.append(r)
      print(f"  {name}: switch {r['switch_s'] * 1e3:.0f} ms, orbax {r['orbax_s'] * 1e3:.0f} ms "
            f"(x{r['ratio']:.0f})", file=sys.stderr, flush=True)
  header = (f"{machine()}; AdamW train state moved {rows[0]['src']} -> {rows[0]['dst']}; medians of {rounds} rounds "
            f"after 1 warm-up; orbax writes under {tmp_dir or tempfile.gettempdir()}")
  cols = ["preset", "params", "state MB", "moved MB", "switch ms", "orbax save ms", "orbax restore ms",
          "orbax / switch", "compile new step s"]
  lines = [header, ""] + table(cols, [[
        r["preset"], f"{r['params'] / 1e6:.1f}M", f"{r['state_bytes'] / 1e6:.1f}", f"{r['moved_bytes'] / 1e6:.1f}",
        f"{r['switch_s'] * 1e3:.1f} ({min(r['switch_all']) * 1e3:.1f}-{max(r['switch_all']) * 1e3:.1f})",
        f"{r['save_s'] * 1e3:.0f}", f"{r['restore_s'] * 1e3:.0f}", f"{r['ratio']:.0f}x",
        f"{r['compile_s']:.1f}" if "compile_s" in r else "-"] for r in rows])
  lines += ["", f"switch = sharding.reshard(donate=True) until ready (min-max over rounds); orbax = save (async, "
            f"waited for) + restore with the new shardings; values checked bit-exact after the switches; total "
            f"wall time {time.perf_counter() - t_start:.0f} s"]
  publish(lines, out)
  return rows
