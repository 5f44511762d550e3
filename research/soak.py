"""Kill-anywhere soak: a `tiny` training run stopped by a signal at random instants, restarted each time, and at the
end compared with an uninterrupted run.

  python -m research.soak                          # 50 SIGKILLs at random instants (~15 min on 2 CPU cores)
  python -m research.soak --signal term --kills 30 # SIGTERM: every stop must exit 143 with its checkpoint
  python -m research.soak --kills 3 --steps 12     # a short version (the test suite runs one)

Each round trains `--steps` steps in a fresh run directory. A life of the run is started, and after a delay drawn
uniformly from [0, T] (T: the wall time of one uninterrupted run, start-up included; seeded) it gets the signal,
wherever it is: importing, compiling, restoring, stepping, writing metrics.jsonl, saving a checkpoint in the
background, renaming one into place, collecting old ones. It is restarted with the same command until a life
finishes; then the round is judged, and rounds go on until `--kills` signals were delivered.

What is checked (every violation is listed in the report, and the exit status is 1 if there is any):
  * exact: the finished round's metrics.jsonl, every logged step's loss, gradient norm, learning rate and held-out
    loss, equals the uninterrupted run's bit for bit, and lists each step once, in order;
  * intact: no life reported a damaged checkpoint (a `warning:` line) and nothing was moved to ckpt.corrupt;
  * bounded: after every stop, at most `keep` + 1 committed steps (orbax retires the oldest after the next commit)
    and at most one unfinished temporary directory;
  * SIGTERM only: every signalled life exits 128 + 15 and says at which step it stopped; that step is committed.
Where each signal landed is classified from outside: before the life logged a step (start-up: imports, compilation,
restore), while a checkpoint's temporary directory existed (a save), or between (steps, logging).

Each finished round is appended to OUT/rounds_<signal>_<steps>steps_seed<seed>.jsonl at once: rerunning the same
command continues from the rounds on disk (an unfinished round is redone from its start, with its own seed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Annotated, Literal

import numpy as np
import tyro

from research import entry, flags

ORBAX_TMP = ".orbax-checkpoint-tmp"


@dataclasses.dataclass
class Config:
  """Stop a training run at random instants, restart it, and compare it with an uninterrupted one."""
  kills: int = 50
  """Signals to deliver in all (over as many rounds as that takes)."""
  signal: Literal["kill", "term"] = "kill"
  """SIGKILL (nothing runs after it) or SIGTERM (the run saves and exits 143)."""
  steps: int = 40
  """Training steps per round."""
  ckpt_every: int = 2
  keep: int = 2
  seed: int = 0
  """Seeds the instants (round r uses seed + r)."""
  out: Annotated[str, flags.OUT_DIR] = "runs/soak"
  """Work directory: the reference run, one directory per round, the finished rounds."""
  report: Annotated[str | None, flags.Rule(path="out-file")] = None
  """Also write the report (markdown) to this file."""


def train_command(cfg: Config, out: str) -> list[str]:
  flags = dict(model="tiny", n_layers=1, steps=cfg.steps, batch_size=8, seq_len=32, log_every=1, eval_every=10,
               ckpt_every=cfg.ckpt_every, keep=cfg.keep, warmup_steps=2, eval_batches=1, mesh="data=2,fsdp=2,tensor=2",
               peak_flops=1e12)
  return [sys.executable, "-m", "research.train", *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()],
          "--no-progress", f"--out={out}"]


def trace(path: str) -> list[tuple]:
  with open(path) as f:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("val_loss")) for r in map(json.loads, f)]


def _ckpt_listing(run_dir: str) -> tuple[list[int], list[str]]:
  """(committed steps, temporary directories) of a run's ckpt/."""
  ckpt = os.path.join(run_dir, "ckpt")
  names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
  return sorted(int(n) for n in names if n.isdigit()), [n for n in names if ORBAX_TMP in n]


def _logged_steps(run_dir: str) -> int:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.endswith("\n"))


def reference(cfg: Config) -> tuple[str, float]:
  """The uninterrupted run (made once) and the wall time of one run, start-up included."""
  ref = os.path.join(cfg.out, f"reference_{cfg.steps}steps")
  timing = ref + ".seconds.json"
  if not os.path.exists(timing):
    shutil.rmtree(ref, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(train_command(cfg, ref), check=True, capture_output=True, text=True)
    with open(timing, "w") as f:
      json.dump({"seconds": time.perf_counter() - t}, f)
  with open(timing) as f:
    return ref, json.load(f)["seconds"]


def one_round(cfg: Config, index: int, period: float, want: list[tuple], budget: int) -> dict:
  """Signals one run until a life finishes (at most `budget` signals; then it runs to the end unsignalled)."""
  run_dir = os.path.join(cfg.out, f"round_{index}")
  shutil.rmtree(run_dir, ignore_errors=True)
  rng = np.random.default_rng(cfg.seed + index)
  signum = signal.SIGKILL if cfg.signal == "kill" else signal.SIGTERM
  stops, problems, lives = [], [], 0
  while True:
    lives += 1
    before = _logged_steps(run_dir)
    log = os.path.join(cfg.out, f"round_{index}.life_{lives}.err")
    with open(log, "w") as err:
      proc = subprocess.Popen(train_command(cfg, run_dir), stdout=subprocess.DEVNULL, stderr=err)
      delay = float(rng.uniform(0, period)) if len(stops) < budget else None
      try:
        proc.wait(timeout=delay)
        signalled = False
      except subprocess.TimeoutExpired:
        proc.send_signal(signum)
        signalled = True
        committed_now, tmp_now = _ckpt_listing(run_dir)
        proc.wait(timeout=600)
    with open(log) as f:
      text = f.read()
    os.remove(log)
    if any(line.startswith("warning") for line in text.splitlines()):
      problems.append(f"life {lives}: {[line for line in text.splitlines() if line.startswith('warning')]}")
    if not signalled:
      if proc.returncode != 0:
        problems.append(f"life {lives} failed with exit status {proc.returncode}: {text.strip()[-300:]}")
      break
    where = ("start-up" if _logged_steps(run_dir) == before else "checkpoint save" if tmp_now else "steps")
    committed, tmp = _ckpt_listing(run_dir)
    stop = {"life": lives, "delay_s": round(delay, 3), "where": where, "exit": proc.returncode,
            "committed": committed, "tmp": len(tmp)}
    stops.append(stop)
    if len(committed) > cfg.keep + 1 or len(tmp) > 1:
      problems.append(f"life {lives}: {len(committed)} committed steps and {len(tmp)} temporary directories")
    if cfg.signal == "term":
      said = [line for line in text.splitlines() if line.startswith("stopped by signal 15 at step ")]
      if proc.returncode == 0:  # it finished before the signal was handled: a clean end, judged below
        stops.pop()
        break
      if proc.returncode != 128 + signal.SIGTERM or not said:
        problems.append(f"life {lives}: SIGTERM gave exit status {proc.returncode}: {text.strip()[-300:]}")
      else:
        at = int(said[0].split("at step ")[1].split(";")[0])
        stop["stopped_at"] = at
        if at and at not in committed:
          problems.append(f"life {lives}: stopped at step {at} but its checkpoint is not committed ({committed})")
  if os.path.exists(os.path.join(run_dir, "ckpt.corrupt")):
    problems.append("a checkpoint was moved to ckpt.corrupt")
  got = trace(os.path.join(run_dir, "metrics.jsonl")) if lives and os.path.exists(run_dir) else []
  exact = got == want
  if not exact:
    steps = [s for s, *_ in got]
    problems.append(f"metrics differ from the uninterrupted run (steps logged: {len(steps)}, distinct "
                    f"{len(set(steps))}, first difference at step "
                    f"{next((a[0] for a, b in zip(got, want) if a != b), min(len(got), len(want)) + 1)})")
  shutil.rmtree(run_dir, ignore_errors=True)
  return {"round": index, "lives": lives, "stops": stops, "exact": exact, "problems": problems}


def report(cfg: Config, rounds: list[dict], period: float) -> str:
  stops = [s for r in rounds for s in r["stops"]]
  where = {w: sum(s["where"] == w for s in stops) for w in ("start-up", "steps", "checkpoint save")}
  problems = [f"round {r['round']}: {p}" for r in rounds for p in r["problems"]]
  name = {"kill": "SIGKILL", "term": "SIGTERM"}[cfg.signal]
  lines = [f"# Kill-anywhere soak: {name}", "",
           f"`python -m research.soak --signal {cfg.signal} --kills {cfg.kills} --steps {cfg.steps} --seed {cfg.seed}`"
           f" (tiny, 1 layer, {cfg.steps} steps, a checkpoint every {cfg.ckpt_every}, keep {cfg.keep}; instants "
           f"uniform in [0, {period:.1f} s], one uninterrupted run's wall time)", "",
           "| signals | rounds | rounds bit-exact | landed in start-up | in steps | during a checkpoint save | "
           "max committed steps seen | problems |", "|---|---|---|---|---|---|---|---|",
           f"| {len(stops)} | {len(rounds)} | {sum(r['exact'] for r in rounds)}/{len(rounds)} | {where['start-up']} | "
           f"{where['steps']} | {where['checkpoint save']} | "
           f"{max((len(s['committed']) for s in stops), default=0)} (keep {cfg.keep}) | {len(problems)} |", ""]
  if cfg.signal == "term":
    codes = sorted({s["exit"] for s in stops})
    lines += [f"Exit statuses of the signalled lives: {codes} (143 = 128 + SIGTERM).", ""]
  lines += [f"- {p}" for p in problems] or ["No problems: every round ended with the uninterrupted run's losses, "
                                           "each step logged once, no damaged checkpoint, disk use within keep + 1."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  cfg = tyro.cli(Config, args=argv, prog="python -m research.soak", description=__doc__.split("\n\n")[0])
  with entry.one_line_errors(OSError):
    flags.check_config(cfg)  # counts, the work directory and --report writable
    os.makedirs(cfg.out, exist_ok=True)
  ref, period = reference(cfg)
  want = trace(os.path.join(ref, "metrics.jsonl"))
  done_path = os.path.join(cfg.out, f"rounds_{cfg.signal}_{cfg.steps}steps_seed{cfg.seed}.jsonl")
  rounds = []
  if os.path.exists(done_path):  # rounds a previous invocation finished
    with open(done_path) as f:
      rounds = [json.loads(line) for line in f if line.endswith("\n")]
  while sum(len(r["stops"]) for r in rounds) < cfg.kills:
    budget = cfg.kills - sum(len(r["stops"]) for r in rounds)
    rounds.append(one_round(cfg, len(rounds), period, want, budget))
    with open(done_path, "a") as f:
      f.write(json.dumps(rounds[-1]) + "\n")
    r = rounds[-1]
    print(f"round {r['round']}: {len(r['stops'])} signals, {r['lives']} lives, "
          f"{'exact' if r['exact'] else 'NOT exact'}, {len(r['problems'])} problems", file=sys.stderr)
  text = report(cfg, rounds, period)
  print(text)
  if cfg.report:
    with open(entry.parent_made(cfg.report), "w") as f:
      f.write(text)
  return 1 if any(r["problems"] for r in rounds) else 0


if __name__ == "__main__":
  entry.command(main, interrupted="the rounds that finished are kept; rerun the same command to go on")
