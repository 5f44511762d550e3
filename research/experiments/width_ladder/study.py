"""Does an optimizer's win over AdamW survive scale? A width ladder, each contender tuned at each width on its own with
the same budget, compared at the end of training on held-out data over seeds, the way "Fantastic Pretraining
Optimizers" (Wen, Hall, Ma, Liang 2025, arXiv 2509.02046) and "Benchmarking Optimizers for LLM Pretraining" (Semenov,
Pagliardini, Jaggi 2025, arXiv 2509.01440) compare them.

Ladder: `small` at d_model W (`research.bench.coordcheck.width_config`: its 4 layers, 64-wide heads (one head below
64), d_ff = 3·W), the built-in byte corpus (its train split; validation on 8 fixed batches of its held-out split),
batch 16 × 128 bytes, a cosine schedule with 10% warmup to 0.1× and clip 1.0 (the train CLI's), tokens = R × the
model's parameters (embeddings included) with R per width (`tokens_per_param`: Chinchilla's 20 where the CPU allows,
less above; results.md states each).

Contenders (`CONTENDERS`), each in its paper's regime:
  adamw            AdamW (weight decay 0.1, β = (0.9, 0.95) before tuning)
  muon-moonlight   Muon with Moonlight's scale 0.2·√max(m, n) (update RMS matched to AdamW's, its AdamW group on the
                   same lr: "Muon is Scalable", arXiv 2502.16982)
  muon-keller      Muon with Keller Jordan's √max(1, fan_out/fan_in) (µP-like fan ratio), its AdamW group on its own lr
                   (`adam_learning_rate`, tuned too)
  normuon          NorMuon (arXiv 2510.05491: Muon with per-neuron second-moment normalisation), Moonlight's scale

Protocol per width and contender (every run a member of a vmapped group, research/train/vmapped.py; all seed 0 until
the last stage):
  A. lr scan: `scan` learning rates 2× apart around the family's centre, other knobs at their defaults; where the best
     is an end of the scan, one more lr past it, up to `extend` times (a best still at an end is flagged). The lr
     optimum per width (`research.verdicts.lr_optimum`, a parabola in log lr) comes from this scan: the transfer plot.
  B. quasi-random trials (`research.search.quasi_random`, scrambled Halton): `trials` points over lr ∈ best_A × [½, 2]
     and the contender's own knobs (`Contender.space`: weight decay, β2 or momentum, Keller's AdamW lr); best values in
     the outer tenth of a range flagged.
  C. seeds: the best of A ∪ B (lowest final held-out loss) with seeds 1 .. seeds−1 beside its seed-0 run.
  So every contender gets the same budget per width: `scan` (+ at most `extend`) + `trials` runs to tune, `seeds` at
  its optimum.
  D. AdamW at its optimum with `budgets` × the tokens (each its own cosine schedule), `seeds` seeds each: the points
     of AdamW's L(D) = α·D^(−B) + β per width (`research.verdicts.fit_power_law`). With `controls` (the default),
     every other contender too, at its own optimum: its speedup at a shorter budget reads AdamW's fit inside the data
     it was fitted on, and puts speedups at equal tokens per parameter side by side across widths (along the ladder,
     width and tokens per parameter move together).
  E. AdamW at its optimum with `longer` × the tokens, `seeds` seeds each: more points of its L(D), past the full
     budget, so that the contenders' full-budget losses fall inside the data the fit read instead of past it.
Verdicts (research/experiments/width_ladder/report.py, by `research.verdicts`): each contender's data-matched speedup
(the data AdamW's fit needs to reach the contender's mean final loss, over the data used) with a 95% interval over
seeds, and the same read between AdamW's measured runs with no law assumed; the fit's lack-of-fit test against AdamW's
own runs; Welch t-tests per width, one-sided against AdamW and two-sided between every pair (Holm); performance profiles
across widths (cost = 1 / speedup between AdamW's runs); the lr optimum per width and the slope of log lr* on log width.

Runs resume: a finished run is skipped (the ledger, OUT/ledger.jsonl, tracked: `ledger.py`), an interrupted group
continues from its saved state under OUT/runs/ (untracked; rerun the command).

  python -m research.experiments.width_ladder            # full size: writes research/results/width_ladder/
  python -m research.experiments.width_ladder --plan     # the groups and their steps, nothing run
  python -m research.experiments.width_ladder --smoke    # a minute: 2 tiny widths, 2 contenders; writes nothing
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import tempfile
from typing import Annotated

import jax
import numpy as np
from jax.experimental import multihost_utils

from models import count_params
from research import flags
from research.bench.coordcheck import width_config
from research.experiments import common
from research.experiments.width_ladder import ledger
from research.search import Dim, edge_flags, grid_edge, quasi_random
from research.train import TrainConfig, run
from research.train.vmapped import build, run_group

NAME = "width_ladder"
# the code this process runs: HEAD when it imported the code, not when a group ends (commits made while a long ladder
# runs change HEAD, not the code in memory)
CODE = common.commit()


@dataclasses.dataclass(frozen=True)
class Contender:
  """A contender: its registered optimizer, fixed --opt values, lr scan centre and the knobs stage B searches."""
  optimizer: str
  fixed: tuple[str, ...]
  centre: float
  space: tuple[Dim, ...]


WD = Dim("weight_decay", "linear", 0.0, 0.2)
CONTENDERS = {
    "adamw": Contender("adamw", (), 2e-3, (WD, Dim("b2", "beta", 0.9, 0.999))),
    "muon-moonlight": Contender("muon", ("scale=moonlight",), 1e-2, (WD, Dim("beta", "beta", 0.8, 0.98))),
    "muon-keller": Contender("muon", ("scale=keller", "adam_learning_rate=0.003"), 3e-2,
                             (WD, Dim("adam_learning_rate", "log", 5e-4, 2e-2))),
    "normuon": Contender("normuon", (), 5e-3, (WD, Dim("beta", "beta", 0.8, 0.98))),
}


SHAPES = {
    "cpu": {},
    # 12 layers at d_model 768 .. 2048 (92M .. 0.65B parameters with the byte vocabulary), sequences of 1024, batch 32:
    # the ladder of "Fantastic Pretraining Optimizers" (130M-1.2B) in this codebase's model, at Chinchilla's 20
    "gpu": dict(widths=(768, 1024, 1536, 2048), tokens_per_param=(20.0, 20.0, 20.0, 20.0), layers=12, batch_size=32,
                seq_len=1024, runner="trainer", compute_dtype="bfloat16", remat=True),
}

@dataclasses.dataclass
class Config(common.Base):
  """The width ladder: widths × contenders, each tuned per width with the same budget, then seeds."""
  widths: Annotated[tuple[int, ...], flags.COUNT] = (32, 64, 128, 256)
  """d_model of each rung (`small`'s depth, head size and d_ff / d_model)."""
  tokens_per_param: Annotated[tuple[float, ...], flags.POSITIVE] = (20.0, 10.0, 2.5, 0.5)
  """Training tokens per parameter at each width (Chinchilla's 20 where the 2-core CPU allows)."""
  contenders: Annotated[tuple[str, ...], flags.one_of(*CONTENDERS)] = tuple(CONTENDERS)
  scan: int = 5
  """Learning rates in stage A's scan (2× apart, centred on the contender's centre)."""
  extend: int = 2
  """Learning rates stage A may add past an end of its scan where the best sits (one at a time)."""
  trials: int = 4
  """Quasi-random trials in stage B."""
  seeds: int = 3
  """Seeds at each optimum (seed 0 is the tuning run's)."""
  budgets: Annotated[tuple[float, ...], flags.FRACTION] = (0.125, 0.25, 0.5)
  """Stage D's shorter runs (fractions of the tokens): AdamW's for its L(D) fit, beside the full one."""
  longer: Annotated[tuple[float, ...], flags.Rule(lo=1, open_lo=True)] = (2.0, 4.0)
  """Stage E's longer runs (multiples of the tokens, above 1): AdamW's only, for its L(D) fit past the full budget."""
  controls: bool = True
  """Stage D for every contender, not only AdamW: each at its optimum at the same shorter budgets, every seed."""
  layers: int = 4
  batch_size: int = 16
  seq_len: int = 128
  shapes: Annotated[str, flags.one_of(*SHAPES)] = "cpu"
  """"cpu": the fields above; "gpu": the same protocol at GPT-2-small-to-1B shapes (`SHAPES`), every run the train
  CLI's on --mesh instead of a vmapped group (one run per device set; multi-host as docs/reliability.md says)."""
  runner: Annotated[str, flags.one_of("vmapped", "trainer")] = "vmapped"
  """How a group's runs train: side by side in one vmapped program (one device), or one after another as train-CLI
  runs (`research.train.run`, sharded over --mesh)."""
  mesh: str = "data=-1"
  """The trainer runner's mesh (a train-CLI --mesh spec)."""
  compute_dtype: str | None = None
  """The runs' --compute-dtype (unset: the model's own, float32); "gpu" shapes: bfloat16."""
  remat: bool = False
  """The runs' --remat (activations recomputed in the backward); "gpu" shapes: on."""
  preflight: bool = False
  """Only the memory pre-flight of one run per rung and optimizer on one device (the train CLI's own, compiled on
  XLA:CPU against abstract arrays, nothing allocated): preflight_<shapes>.md beside results.md."""
  coordinator: Annotated[str | None, flags.Rule()] = None
  """The trainer runner on several hosts: the train CLI's --coordinator HOST:PORT (under SLURM, unset: JAX reads it)."""
  num_processes: int | None = None
  process_id: int | None = None
  out: str = "research/results/width_ladder"
  """Where results.md, results.json, the plots, ledger.jsonl (the finished runs, tracked) and runs/ (untracked) go."""
  plan: bool = False
  """Print the groups to run (stage, members, steps) and stop."""
  report: bool = False
  """Run nothing: write the record (results.md, results.json, plots) from the runs that finished, marking the rest as
  running; what a session that stops before the ladder ends commits."""
  smoke: bool = False
  """Two tiny widths, AdamW and Muon, a few steps, into a temporary directory: what the tests run."""


SMOKE = dict(widths=(16, 32), tokens_per_param=(0.5, 0.125), contenders=("adamw", "muon-moonlight"), scan=3, extend=1,
             trials=2, seeds=2, budgets=(0.25, 0.5), longer=(2.0,), layers=1, batch_size=4, seq_len=32)


def sized(cfg: Config) -> Config:
  """`cfg` at smoke size when --smoke (its out a temporary directory), else as given; UsageError-worthy mismatches
  raised as ValueError."""
  cfg = dataclasses.replace(cfg, **SHAPES[cfg.shapes])
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, **SMOKE, out=tempfile.mkdtemp(prefix="width-ladder-"))
  if len(cfg.tokens_per_param) != len(cfg.widths):
    raise ValueError(f"--tokens-per-param gives {len(cfg.tokens_per_param)} values for {len(cfg.widths)} widths")
  return cfg


def steps_at(cfg: Config, width: int, fraction: float = 1.0) -> int:
  """Steps of a run at `width`: tokens_per_param × parameters × fraction, in batches of batch_size × seq_len."""
  r = cfg.tokens_per_param[cfg.widths.index(width)]
  return max(1, round(fraction * r * params_at(cfg, width) / (cfg.batch_size * cfg.seq_len)))


def params_at(cfg: Config, width: int) -> int:
  return count_params(dataclasses.replace(width_config(width, 256), n_layers=cfg.layers))


def train_config(cfg: Config, width: int, contender: str, values: dict, seed: int, steps: int,
                 out: str) -> TrainConfig:
  """One member's run: the rung's model, the contender's optimizer with its fixed and searched values."""
  c, m = CONTENDERS[contender], width_config(width, 256)
  flat = {k: v for k, v in values.items() if k in ("lr", "weight_decay", "b1", "b2")}
  opt = [i for i in c.fixed if i.partition("=")[0] not in values]
  opt += [f"{k}={v!r}" for k, v in values.items() if k not in flat]
  return TrainConfig(model="small", d_model=width, n_layers=cfg.layers, n_heads=m.n_heads, d_ff=m.d_ff,
                     optimizer=c.optimizer, opt=tuple(opt), **flat, seed=seed, steps=steps,
                     batch_size=cfg.batch_size, seq_len=cfg.seq_len, warmup_steps=steps // 10,
                     log_every=log_every(steps), eval_every=max(1, steps // 10), eval_batches=8 if not cfg.smoke
                     else 1, ckpt_every=max(1, steps // 4), progress=False, tracker=("none",), out=out,
                     compute_dtype=cfg.compute_dtype, remat=cfg.remat or None,
                     **(dict(mesh="data=1", devices=1) if cfg.runner == "vmapped" else dict(
                         mesh=cfg.mesh, coordinator=cfg.coordinator, num_processes=cfg.num_processes,
                         process_id=cfg.process_id)))


def log_every(steps: int) -> int:
  """How often a run of `steps` steps logs its training loss and time."""
  return max(1, steps // 20)


def member_name(values: dict, seed: int) -> str:
  return "_".join(f"{k}{v:.4g}" for k, v in sorted(values.items())) + f"_s{seed}"


class Ladder:
  """Runs the protocol's groups in order, skipping what finished; `plan` lists them instead of running."""

  def __init__(self, cfg: Config):
    self.cfg, self.planned = cfg, []
    self.runs_dir = os.path.join(cfg.out, "runs")
    self.ledger = ledger.load(cfg.out)
    # finished runs the ledger lacks (in runs/; with no ledger, a record's too): `save` writes them after the first
    # run, for JAX is not touched before it (a multi-host runner starts jax.distributed there)
    found = [p for p in sorted(glob.glob(os.path.join(self.runs_dir, "w*", "*", "*", "*_s*")))
             if ledger.key(p, self.runs_dir) not in self.ledger]
    self.unsaved = ledger.from_dirs(self.runs_dir, found, cfg.batch_size * cfg.seq_len)
    record = os.path.join(cfg.out, "results.json")
    if not self.ledger and os.path.exists(record):
      seen = {e["run"] for e in self.unsaved}
      with open(record) as f:
        self.unsaved = [e for e in ledger.from_record(json.load(f), log_every) if e["run"] not in seen] + self.unsaved
    self.ledger.update({e["run"]: e for e in self.unsaved})

  def save(self, entries: list[dict] = ()):
    """Adds `entries` (finished runs) and those found at the start to the ledger; process 0 writes them."""
    entries, self.unsaved = [*self.unsaved, *entries], []
    self.ledger.update({e["run"]: e for e in entries})
    if entries and jax.process_index() == 0:
      ledger.append(self.cfg.out, entries)

  def final(self, path: str, steps: int) -> float | None:
    """A run's final held-out loss: the ledger's, else its directory's (`ledger.final_val`)."""
    entry = self.ledger.get(ledger.key(path, self.runs_dir))
    return entry["final_val_loss"] if entry and entry["steps"] == steps else ledger.final_val(path, steps)

  def group(self, width: int, contender: str, stage: str, members: list[tuple[dict, int]],
            steps: int) -> list[float | None]:
    """Trains the members (values, seed) that have not finished as one vmapped group; their final held-out losses
    (None for a member not run: --plan)."""
    where = os.path.join(self.runs_dir, f"w{width}", contender, stage)
    dirs = [os.path.join(where, member_name(v, s)) for v, s in members]
    todo = [(m, d) for m, d in zip(members, dirs) if self.final(d, steps) is None]
    if todo and (self.cfg.plan or self.cfg.report):  # what is left; a group trained here is not
      self.planned.append({"width": width, "contender": contender, "stage": stage, "members": len(todo),
                           "steps": steps})
    elif todo:
      self._train([train_config(self.cfg, width, contender, v, s, steps, d) for (v, s), d in todo], where)
    return [self.final(d, steps) for d in dirs]

  def _train(self, cfgs: list[TrainConfig], where: str):
    """The runs, by the configured runner; then each run's `commit` file: the code it finished with, the one this
    process imported (`CODE`; config.json beside it holds its flags)."""
    commit = CODE
    if self.cfg.runner == "trainer":
      for c in cfgs:  # each resumes from its own checkpoints
        run(c)
        if jax.process_count() > 1:  # every host reads the run's metrics after process 0 has written them
          multihost_utils.sync_global_devices(f"width-ladder {c.checkpoint.out}")
    else:
      key = hashlib.sha1("|".join(c.checkpoint.out for c in cfgs).encode()).hexdigest()[:10]
      run_group(build(cfgs), os.path.join(where, f"group-{key}"))
    if jax.process_index() == 0:
      for c in cfgs:
        with open(os.path.join(c.checkpoint.out, "commit"), "w") as f:
          f.write(commit + "\n")
    if jax.process_count() > 1:  # every host reads the commit files after process 0 has written them
      multihost_utils.sync_global_devices(f"width-ladder commit {where}")
    groups = [[c.checkpoint.out for c in cfgs]] if self.cfg.runner == "vmapped" else [[c.checkpoint.out] for c in cfgs]
    self.save([e for g in groups for e in ledger.from_dirs(self.runs_dir, g, self.cfg.batch_size * self.cfg.seq_len)])

  def runs(self) -> list[dict]:
    """Every finished run of the ladder, from the ledger: its directory (under runs/), steps, final held-out loss and
    the commit it finished at (results.json lists them: each run's flags are the config.json its directory had)."""
    return [{k: e[k] for k in ("run", "steps", "final_val_loss", "commit")}
            for _, e in sorted(self.ledger.items())]

  def compute(self, runs: list[dict]) -> dict:
    """The machine time the finished runs took, from the ledger (`ledger.from_dirs`: read from the runs' records):
    {width: {stage: {"runs", "member_steps", "hours", "quiet"}}}, stage A, B, C, D or E. hours: the groups' wall time
    shared among their members, compile, evaluation and any pause or contention included; quiet: member-steps × the
    width's 10th-percentile seconds per member-step over every logging interval, what the stage costs on a quiet
    machine (a vmapped group's time per member-step hardly depends on its size: research/results/bench_vmap.md).
    `runs`: `runs()`'s list."""
    out, rates = {}, {}
    for r in runs:
      entry = self.ledger[r["run"]]
      width, _, stage = r["run"].split("/")[:3]
      cell = out.setdefault(int(width[1:]), {}).setdefault(stage[0], {"runs": 0, "member_steps": 0, "hours": 0.0})
      cell["runs"] += 1
      cell["member_steps"] += r["steps"]
      cell["hours"] += entry["seconds"] / 3600
      rates.setdefault(int(width[1:]), []).extend(entry["rates"])
    for width, rs in rates.items():
      for cell in out[width].values():
        cell["quiet"] = cell["member_steps"] * float(np.quantile(rs, 0.1)) / 3600
    return out

  def contender(self, width: int, name: str) -> dict:
    """Stages A, B and C of one contender at one width (module docstring); what finished, as a dict."""
    cfg, c = self.cfg, CONTENDERS[name]
    steps = steps_at(cfg, width)
    half = cfg.scan // 2
    lrs = [float(f"{c.centre * 2.0 ** k:.4g}") for k in range(-half, cfg.scan - half)]
    scan = dict(zip(lrs, self.group(width, name, "A", [({"lr": lr}, 0) for lr in lrs], steps)))
    if None in scan.values():
      return {"scan": scan}
    best_lr = min(scan, key=lambda lr: scan[lr])
    for _ in range(cfg.extend):  # past the end where the best sits, one lr at a time
      edge = grid_edge(list(scan), best_lr)
      if not edge:
        break
      extra = float(f"{best_lr * (2.0 if edge == 'high' else 0.5):.4g}")
      scan[extra] = self.group(width, name, "A", [({"lr": extra}, 0)], steps)[0]
      if scan[extra] is None:
        return {"scan": scan}
      best_lr = min(scan, key=lambda lr: scan[lr])
    box = [Dim("lr", "log", best_lr / 2, best_lr * 2), *c.space]
    points = quasi_random(box, cfg.trials, seed=width)
    trials = self.group(width, name, "B", [(p, 0) for p in points], steps)
    if None in trials:
      return {"scan": scan, "trials": list(zip(points, trials))}
    candidates = [({"lr": lr}, v) for lr, v in scan.items()] + list(zip(points, trials))
    best, loss = min(candidates, key=lambda t: t[1])
    seeds = self.group(width, name, "C", [(best, s) for s in range(1, cfg.seeds)], steps)
    return {"scan": scan, "scan_edge": grid_edge(list(scan), best_lr), "trials": list(zip(points, trials)),
            "best": best, "best_edges": edge_flags(box, best) if "weight_decay" in best else [],
            "finals": [loss, *seeds], "steps": steps}

  def budgets(self, width: int, name: str, best: dict, fractions: tuple[float, ...], stage: str = "D") -> dict:
    """Stage D (or E): a contender at its optimum at each budget in `fractions` of the tokens, every seed."""
    out = {}
    for fraction in fractions:
      steps = steps_at(self.cfg, width, fraction)
      out[fraction] = {"steps": steps, "finals": self.group(width, name, f"{stage}{fraction:g}",
                                                            [(best, s) for s in range(self.cfg.seeds)], steps)}
    return out

  def run(self) -> dict:
    """Every stage of every width, narrowest first; {width: {contender: ..., "budgets": ...}}."""
    done: dict = {}
    for width in self.cfg.widths:
      rung = done[width] = {"params": params_at(self.cfg, width), "steps": steps_at(self.cfg, width),
                            "tokens_per_param": self.cfg.tokens_per_param[self.cfg.widths.index(width)]}
      for name in self.cfg.contenders:
        rung[name] = self.contender(width, name)
      if "adamw" in self.cfg.contenders and "best" in rung["adamw"]:
        best = rung["adamw"]["best"]
        rung["budgets"] = self.budgets(width, "adamw", best, self.cfg.budgets) | self.budgets(
            width, "adamw", best, self.cfg.longer, "E")
      for name in self.cfg.contenders if self.cfg.controls else ():
        if name != "adamw" and "best" in rung[name]:
          rung[name]["budgets"] = self.budgets(width, name, rung[name]["best"], self.cfg.budgets)
    return done


def main(cfg: Config) -> dict:
  """Runs (or, with --plan, lists; with --report, skips) what is missing, then writes the record from what finished."""
  from research.experiments.width_ladder import papers, report
  from research.experiments.width_ladder import plots as plotting
  from research.experiments.width_ladder import tables as tabling
  cfg = sized(cfg)
  if cfg.preflight:
    from research.experiments.width_ladder.preflight import preflight
    return preflight(cfg, lambda w, name, out: train_config(cfg, w, name, {"lr": 1e-3}, 0, steps_at(cfg, w), out))
  ladder = Ladder(cfg)
  done = ladder.run()
  if cfg.plan:
    for g in ladder.planned:
      print(f"w{g['width']} {g['contender']} {g['stage']}: {g['members']} runs of {g['steps']} steps")
    return {"planned": ladder.planned}
  ladder.save()  # what was found at the start (the record's runs, or run directories the ledger lacked)
  v = report.verdicts(done, cfg.batch_size * cfg.seq_len)
  runs = ladder.runs()
  result = {"done": done, "verdicts": v, "missing": ladder.planned, "runs": runs, "compute": ladder.compute(runs)}
  if cfg.smoke:
    return result
  plots = plotting.plots(cfg, done, v, cfg.out)
  state = ([f"**In progress**: {len(ladder.planned)} group(s) of runs are next (the protocol's later stages follow "
            "from their results); rerun the command to go on. Every number below is from runs that finished.", ""]
           if ladder.planned else [])
  common.write_results(cfg.out, "Does the win survive scale? A width ladder", __doc__.split("\n\n")[0],
                       state + tabling.tables(cfg, done, v) + tabling.compute_table(
                           result["compute"], sum(bool(e.get("restored")) for e in ladder.ledger.values())),
                       findings=["## Findings", "", *report.findings(v), "", *papers.reading(done, v)],
                       settings={k: getattr(cfg, k) for k in ("widths", "tokens_per_param", "scan", "trials", "seeds",
                                                              "budgets", "longer", "controls", "layers", "batch_size",
                                                              "seq_len")},
                       data={**result, "plots": [os.path.basename(p) for p in plots]})
  return result
