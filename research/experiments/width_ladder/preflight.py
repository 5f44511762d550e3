"""The width ladder's memory on paper: for each rung and optimizer, one run's bytes per device as the train CLI's own
pre-flight computes them (`python -m research.bench.preflight TRAIN-FLAGS`: the abstract state, the train step
compiled on XLA:CPU, its `memory_analysis`; nothing allocated), against an 80 GB device.

  python -m research.experiments.width_ladder --shapes gpu --preflight   # writes OUT/preflight_gpu.md
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

from research.bench.report import run_child
from research.experiments import common

DEVICE_BYTES = 80 * 10 ** 9  # an 80 GB accelerator (GB = 10^9 bytes; less what the runtime keeps)
OPTIMIZERS = ("adamw", "muon", "normuon")


def _argv(train) -> list[str]:
  """The train CLI's flags for `train` (a width ladder run's TrainConfig) on one device."""
  m, t, o = train.model, train.training, train.optim
  argv = ["--model", "small", "--d-model", str(m.d_model), "--n-layers", str(m.n_layers), "--n-heads", str(m.n_heads),
          "--d-ff", str(m.d_ff), "--optimizer", o.optimizer, "--batch-size", str(t.batch_size), "--seq-len",
          str(t.seq_len), "--steps", str(t.steps), "--mesh", "data=1", "--devices", "1", "--no-compile-cache"]
  if m.compute_dtype:
    argv += ["--compute-dtype", m.compute_dtype]
  if m.remat:
    argv += ["--remat", "True"]
  return argv


def preflight(cfg, run_at: Callable) -> dict:
  """Per rung (`cfg.widths`) and optimizer: parameters, train state, temporaries and the step's peak per device, and
  whether it fits `DEVICE_BYTES`; written to `cfg.out`/preflight_<shapes>.md.

  Args:
    cfg: the ladder's (sized) `study.Config`.
    run_at: `run_at(width, contender, out)` -> a full-length run's TrainConfig at that rung (`study.train_config`).

  Returns:
    {"rows": one dict per (width, optimizer)}.
  """
  rows, tmp = [], tempfile.mkdtemp(prefix="ladder-preflight-")
  for width in cfg.widths:
    for name in OPTIMIZERS:
      contender = {"adamw": "adamw", "muon": "muon-moonlight", "normuon": "normuon"}[name]
      train = run_at(width, contender, os.path.join(tmp, "run"))
      code, rss, out, err, wall = run_child([sys.executable, "-m", "research.bench.preflight", *_argv(train)],
                                            os.path.join(tmp, f"{width}-{name}"))
      if code:
        raise RuntimeError(f"pre-flight of d_model {width} {name} failed: {err.strip().splitlines()[-1]}")
      got = json.loads(out.strip().splitlines()[-1])
      rows.append({"width": width, "optimizer": name, **{k: got[k] for k in ("params", "state", "temp", "peak")},
                   "fits": got["peak"] <= DEVICE_BYTES, "child_rss": rss, "compile_s": got["compile_s"],
                   "command": "python -m research.train " + " ".join(_argv(train))})
      print(json.dumps(rows[-1]), flush=True)
  gb = lambda n: f"{n / 1e9:.2f}"
  lines = [f"# The width ladder's memory on one 80 GB device (--shapes {cfg.shapes})", "",
           f"Command: `{common.command()}` (commit {common.commit()}, {time.strftime('%Y-%m-%d')})", "",
           "Each run's bytes per device from the train CLI's own pre-flight (research/bench/preflight.py "
           "`step_estimate`: the train step compiled on XLA:CPU against abstract arrays, its `memory_analysis`; "
           "nothing allocated). XLA:GPU schedules and fuses differently, so these are estimates, not measurements; "
           "not counted: the runtime's own reservation, the held-out evaluation, the checkpoint writer.", "",
           f"Settings: batch {cfg.batch_size} × {cfg.seq_len} tokens, {cfg.layers} layers, compute dtype "
           f"{cfg.compute_dtype or 'float32'}, remat {cfg.remat}; GB = 10^9 bytes.", "",
           "| d_model | optimizer | parameters | train state GB | temporaries GB | step peak GB | fits 80 GB |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['width']} | {r['optimizer']} | {r['params']:,} | {gb(r['state'])} | {gb(r['temp'])} | "
            f"{gb(r['peak'])} | {'yes' if r['fits'] else '**no**'} |" for r in rows]
  lines += ["", "Each row's command (what the pre-flight built; `--mesh data=-1` over more devices splits the batch):",
            ""] + [f"- d_model {r['width']}, {r['optimizer']}: `{r['command']}`" for r in rows]
  os.makedirs(cfg.out, exist_ok=True)
  with open(os.path.join(cfg.out, f"preflight_{cfg.shapes}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return {"rows": rows}
