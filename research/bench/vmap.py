"""`python -m research.bench vmap`: K runs of one rung side by side in one vmapped program
(research/train/vmapped.py) against the same K runs one at a time, per width.

For each width of the coordinate check's ladder (`small` at d_model W: its depth, head size and d_ff / d_model), the
bench trains K members (K learning rates of one optimizer, seed 0) for --steps steps three ways, one after another,
each in a child process with one CPU device (a process with the bench's 8 simulated devices ran the same program
~25-30% slower):
  - trainer: one member as a train-CLI run, `python -m research.train --devices 1` (what `research.sweep` runs);
  - alone:   one member as a vmapped group of one (the vmapped runner's loop, without the vmap's sharing);
  - vmapped: the K members as one group.
Per way it reports the steady time per step (the median over the logged intervals after the first, which holds the
compilation) and the wall time of the whole run, compilation and the process's start included; the speedup is K runs
one at a time (K x the single run's time) over the group's time. The FLOPs of one member's step come from the compiled
program's `cost_analysis`, so the achieved FLOP/s is beside them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Annotated

import jax
import jax.numpy as jnp

from models import count_params
from research import flags
from research.bench.coordcheck import width_config
from research.bench.report import call_command, git_commit, machine, publish, run_child, table
from research.data import load_corpus
from research.train import TrainConfig
from research.train.store.rundir import read_records
from research.train.vmapped import build, run_group


def _steady(records: list[dict], tokens: int) -> float:
  """Seconds per step: the median of the logged intervals after the first (which holds the compilation)."""
  rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
  return tokens / statistics.median(rates) if rates else float("nan")


def _argv(cfg: TrainConfig) -> list[str]:
  """The train CLI's flags for `cfg`'s run (the fields `_config` sets)."""
  m, t, o = cfg.model, cfg.training, cfg.optim
  return ["--model", "small", "--d-model", str(m.d_model), "--n-heads", str(m.n_heads), "--d-ff", str(m.d_ff),
          "--optimizer", o.optimizer, "--lr", str(o.lr), "--steps", str(t.steps), "--batch-size", str(t.batch_size),
          "--seq-len", str(t.seq_len), "--log-every", str(cfg.logging.log_every), "--eval-every", str(t.steps),
          "--eval-batches", "1", "--ckpt-every", str(t.steps), "--warmup-steps", str(o.warmup_steps),
          "--mesh", "data=1", "--devices", "1", "--no-progress", "--tracker", "none", "--out", cfg.checkpoint.out]


def _config(width: int, vocab: int, lr: float, steps: int, out: str, optimizer: str, batch_size: int,
            seq_len: int) -> TrainConfig:
  m = width_config(width, vocab)
  return TrainConfig(model="small", d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff, optimizer=optimizer, lr=lr,
                     steps=steps, batch_size=batch_size, seq_len=seq_len, log_every=max(1, steps // 6),
                     eval_every=steps, eval_batches=1, ckpt_every=steps, warmup_steps=steps // 10, mesh="data=1",
                     devices=1, progress=False, tracker=("none",), out=out)


def _child(spec: dict) -> dict:
  """One group's run in this (child) process on one CPU device: its wall time, member 0's records, one member's step
  FLOPs."""
  mk = lambda k: _config(spec["width"], spec["vocab"], 1e-3 * 2 ** k, spec["steps"], os.path.join(spec["out"], str(k)),
                         spec["optimizer"], spec["batch_size"], spec["seq_len"])
  t = time.perf_counter()
  recs = run_group(build([mk(k) for k in range(spec["members"])]), os.path.join(spec["out"], "state"))[0]
  return {"wall": time.perf_counter() - t, "records": recs, "flops": _flops([mk(0)])}


def _flops(cfgs: list[TrainConfig]) -> float:
  """One member's step FLOPs (XLA's cost_analysis of a group of one)."""
  g = build(cfgs[:1])
  batch = jax.ShapeDtypeStruct((1, cfgs[0].training.batch_size, cfgs[0].training.seq_len), jnp.int32)
  cost = g.step.lower(g.values, *g.state, batch, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost.get("flops", float("nan")))


def vmap(widths: tuple[int, ...] = (64, 128, 256), members: Annotated[int, flags.COUNT] = 4,
         steps: Annotated[int, flags.COUNT] = 60, optimizer: Annotated[str, flags.OPTIMIZER] = "adamw",
         batch_size: int = 16, seq_len: int = 128,
         trainer: bool = True, out: Annotated[str, flags.OUT_FILE] = "research/results/bench_vmap.md") -> dict:
  """Vmapped groups vs one-at-a-time runs, per width: time per step, wall time, speedup, FLOP/s.

  Args:
    widths: the d_model ladder (`research.bench.coordcheck.width_config`).
    members: K, the runs in a group (learning rates 1e-3 x 2^k).
    steps: steps per run.
    optimizer: the registered optimizer every member uses.
    batch_size: sequences per batch.
    seq_len: tokens per sequence.
    trainer: also time one run of the trainer itself (`research.train.run`, one device).
    out: the markdown file written.

  Returns:
    {"rows": one dict per width with the measured numbers, "command": the command line}.
  """
  cmd = call_command("vmap", vmap, dict(widths=widths, members=members, steps=steps, optimizer=optimizer,
                                        batch_size=batch_size, seq_len=seq_len, trainer=trainer, out=out))
  vocab = load_corpus().vocab_size
  tokens = batch_size * seq_len
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for w in widths:
      mk = lambda k, name: _config(w, vocab, 1e-3 * 2 ** k, steps, os.path.join(tmp, f"{w}-{name}-{k}"), optimizer,
                                   batch_size, seq_len)
      row = {"width": w, "params": count_params(width_config(w, vocab))}
      if trainer:  # a child process: this one's backend has the bench's 8 devices, a sweep's run has one
        cfg = mk(0, "trainer")
        code, _, _, err, row["trainer_wall"] = run_child(
            [sys.executable, "-m", "research.train", *_argv(cfg)], os.path.join(tmp, f"{w}-trainer"))
        if code:
          raise RuntimeError(f"the trainer's run failed: {err[-2000:]}")
        row["trainer_step"] = _steady(read_records(os.path.join(cfg.checkpoint.out, "metrics.jsonl"))[0], tokens)
      for way, k in (("alone", 1), ("group", members)):  # a child with one device each, as the trainer's
        spec = dict(width=w, vocab=vocab, members=k, steps=steps, optimizer=optimizer, batch_size=batch_size,
                    seq_len=seq_len, out=os.path.join(tmp, f"{w}-{way}"))
        code, _, out_text, err, _ = run_child([sys.executable, "-m", "research.bench.vmap", json.dumps(spec)],
                                              os.path.join(tmp, f"{w}-{way}-log"))
        if code:
          raise RuntimeError(f"the {way} group failed: {err[-2000:]}")
        got = json.loads(out_text.strip().splitlines()[-1])
        row[f"{way}_wall"], row[f"{way}_step"] = got["wall"], _steady(got["records"], tokens)
        row["flops_per_member_step"] = got["flops"]
      row["speedup_steady"] = members * row["alone_step"] / row["group_step"]
      row["speedup_wall"] = members * row["alone_wall"] / row["group_wall"]
      if trainer:
        row["speedup_vs_trainer_steady"] = members * row["trainer_step"] / row["group_step"]
        row["speedup_vs_trainer_wall"] = members * row["trainer_wall"] / row["group_wall"]
      rows.append(row)
      print(json.dumps(row), flush=True)
  return _report(rows, cmd, members, steps, optimizer, tokens, trainer, out)


def _report(rows, cmd, members, steps, optimizer, tokens, trainer, out) -> dict:
  f = lambda x, spec=".3g": format(x, spec)
  cols = ["d_model", "FLOPs / member step", "alone: s / step", "vmapped K: s / step", "K one at a time / vmapped "
          "(steady)", "(wall, compile included)", "vmapped GFLOP/s"]
  if trainer:
    cols[2:2] = ["trainer: s / step"]
    cols += ["vs the trainer (steady)", "(wall)"]
  body = []
  for r in rows:
    cells = [str(r["width"]), f(r["flops_per_member_step"]), f(r["alone_step"]), f(r["group_step"]),
             f(r["speedup_steady"], ".2f") + "×", f(r["speedup_wall"], ".2f") + "×",
             f(members * r["flops_per_member_step"] / r["group_step"] / 1e9)]
    if trainer:
      cells[2:2] = [f(r["trainer_step"])]
      cells += [f(r["speedup_vs_trainer_steady"], ".2f") + "×", f(r["speedup_vs_trainer_wall"], ".2f") + "×"]
    body.append(cells)
  lines = [f"# Vmapped groups vs one-at-a-time runs ({members} members of {optimizer}, {steps} steps, {tokens} "
           f"tokens a step)", "", f"Command: `{cmd}` (commit {git_commit()}; {machine()}; "
           f"{time.strftime('%Y-%m-%d')})", "", *table(cols, body)]
  publish(lines, out)
  with open(os.path.splitext(out)[0] + ".json", "w") as fh:
    json.dump({"rows": rows, "command": cmd}, fh, indent=1)
  return {"rows": rows, "command": cmd}




if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 1)  # the trainer's --devices 1: the same XLA:CPU as a sweep's run
  print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
