"""`python -m research.bench ckpt`: what the checkpoint checksums (research/train/store/integrity.py) cost next to the
save and restore they guard.

For each preset, in one process: the AdamW train state of research/train/ on `mesh`, then, per round,
  checksums:  integrity.fingerprints(state): two 32-bit words per array, computed where the shards live, read back;
  one pass:   the floor of any checksum that reads every byte once: a jitted sum of every array's 32-bit words
              (the same reads, the least arithmetic), read back;
  crc32:      zlib.crc32 over every array's bytes already on the host (the peer: a file-level checksum of what was
              written; the device-to-host copy is not counted, in its favour);
  save:       research.train.store.checkpoint.Checkpointer.save (its checksums included) until the async write is
              committed;
  restore:    Checkpointer.restore onto the same shardings (its verification included).
Reported: medians over the rounds (after one warm-up round), and the checksums' share of the save and of the
restore. On the CPU the 8 devices are simulated and share the cores, and orbax writes to the local disk.
"""

from __future__ import annotations

import sys
import tempfile
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import Transformer, count_params
from research.bench.report import machine, publish, table
from research.train.config import TrainConfig
from research.train.hooks.throughput import median_seconds
from research.train.setup.build import make_optimizer, model_config, optimizer_needs
from research.train.store import integrity
from research.train.store.checkpoint import Checkpointer
from sharding import devices_for, init_train_state, make_mesh, mesh_spec


@jax.jit
def _one_pass(leaves):
  return [jnp.sum(integrity._words(x), dtype=jnp.uint32) for x in leaves]


def _time_preset(name: str, mesh_spec_: str, rounds: int, tmp_root: str) -> dict:
  cfg = TrainConfig(model=name)
  needs = optimizer_needs(cfg.optim)
  mcfg = model_config(cfg.model, cfg.moe, cfg.weights.init_from, needs)
  tx, _ = make_optimizer(cfg.optim, cfg.training.steps, needs)
  mesh = make_mesh(mesh_spec_, devices=devices_for(mesh_spec_))
  _, state, shardings = init_train_state(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)), tx, mesh)
  leaves = jax.tree.leaves(state)
  host = [np.asarray(x) for x in leaves]
  row = {"preset": name, "params": count_params(mcfg), "mesh": mesh_spec(mesh), "arrays": len(leaves),
         "state_bytes": sum(h.nbytes for h in host)}
  row["checksums_s"] = median_seconds(lambda: integrity.fingerprints(state), rounds)
  row["one_pass_s"] = median_seconds(lambda: jax.device_get(_one_pass(leaves)), rounds)
  row["crc32_s"] = median_seconds(lambda: [zlib.crc32(memoryview(np.ascontiguousarray(h)).cast("B")) for h in host],
                                  rounds)
  counter = iter(range(10**6))

  def save():
    ckpt = Checkpointer(f"{tmp_root}/{name}-{next(counter)}", keep=1, every=1)
    ckpt.save(1, state, {"preset": name}, force=True)
    ckpt.close()
    return ckpt
  row["save_s"] = median_seconds(save, rounds)
  ckpt = Checkpointer(f"{tmp_root}/{name}-restore", keep=1, every=1)
  ckpt.save(1, state, {"preset": name}, force=True)
  ckpt.manager.wait_until_finished()
  row["restore_s"] = median_seconds(lambda: ckpt.restore(1, state, shardings), rounds)
  restored = ckpt.restore(1, state, shardings)
  ckpt.close()
  if not all(np.array_equal(np.asarray(x), h) for x, h in zip(jax.tree.leaves(restored), host)):
    raise SystemExit("error: the restored state differs from the saved one")
  return row


def ckpt_bench(presets: tuple[str, ...] = ("small", "base"), mesh: str = "fsdp=8", rounds: int = 3,
               tmp_dir: str | None = None, out: str | None = None) -> list[dict]:
  """Checkpoint checksums against save, restore, one pass over the state and host crc32, AdamW train state.

  Args:
    presets: model presets (research/train/'s AdamW state: fp32 params and two moments).
    mesh: the mesh the state is sharded over.
    rounds: timed rounds (medians reported) after one warm-up round.
    tmp_dir: where orbax writes (default: the system temp dir).
    out: also write the table (markdown) to this file.
  """
  t_start = time.perf_counter()
  make_mesh(mesh, devices=devices_for(mesh))  # a bad spec fails before minutes of measuring
  rows = []
  with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="bench_ckpt-") as tmp_root:
    for name in presets:
      r = _time_preset(name, mesh, rounds, tmp_root)
      rows.append(r)
      print(f"  {name}: checksums {r['checksums_s'] * 1e3:.0f} ms, save {r['save_s'] * 1e3:.0f} ms, restore "
            f"{r['restore_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
  header = (f"{machine()}; AdamW train state on {rows[0]['mesh']}; medians of {rounds} rounds after 1 warm-up; "
            f"orbax writes under {tmp_dir or tempfile.gettempdir()}")
  cols = ["preset", "params", "arrays", "state MB", "checksums ms", "one pass (floor) ms", "checksums / floor",
          "host crc32 ms", "save ms", "checksums / save", "restore ms", "checksums / restore"]
  lines = [header, ""] + table(cols, [[
        r["preset"], f"{r['params'] / 1e6:.1f}M", str(r["arrays"]), f"{r['state_bytes'] / 1e6:.0f}",
        f"{r['checksums_s'] * 1e3:.0f}", f"{r['one_pass_s'] * 1e3:.0f}", f"{r['checksums_s'] / r['one_pass_s']:.1f}x",
        f"{r['crc32_s'] * 1e3:.0f}", f"{r['save_s'] * 1e3:.0f}", f"{r['checksums_s'] / r['save_s']:.1%}",
        f"{r['restore_s'] * 1e3:.0f}", f"{r['checksums_s'] / r['restore_s']:.1%}"] for r in rows])
  lines += ["", f"save and restore include the checksums (computed on save, verified on restore); total wall time "
            f"{time.perf_counter() - t_start:.0f} s"]
  publish(lines, out)
  return rows
