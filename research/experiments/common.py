"""What the experiments share: an in-process single-device training loop for models that surgery changes
between phases (upcycling, depth expansion, MoE-DisCo, ...), held-out evaluation, and result writing.

`research.train` is the CLI for whole runs on meshes; the experiments here need to train a `Transformer`
they hold, change it, and go on, so they use `fit` on one device. `fit` steps with the trainer's own pieces
(`research.train.steps.step`: the loss, cross entropy + the MoE aux losses, and the update path with the optimizer's
extra arguments and the aux-loss-free router-bias update) and the same data functions.

Beside it, one concern each (their names re-exported here): base.py, the flags every experiment's Config shares;
compare.py, the reports' statistics (each arm against a baseline) and markdown tables; partial.py, the resume file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import nnx

from models import Transformer
from optim import get_optimizer, make_schedule
from research import entry, flags
from research.data import eval_batches, get_batch, load_corpus
from research.experiments.base import Base
from research.experiments.compare import (
  Versus,
  against,
  band,
  curves_plot,
  delta_cell,
  lr_grid_table,
  mean_std,
  pm,
  resolved,
  seed_paired,
  seed_stat,
  table,
  timing_lines,
  versus,
)
from research.experiments.partial import PARTIAL, drop_partial, kept_after_interrupt, load_partial, save_partial
from research.train.steps.contract import outputs
from research.train.steps.step import eval_loss, lm_loss, make_update


@dataclasses.dataclass
class Fit:
  """A training phase's result: the trained model, its optimizer state and one record per logged step."""
  model: Transformer
  opt_state: object
  records: list[dict]

  @property
  def final_val(self) -> float:
    return [r["val_loss"] for r in self.records if "val_loss" in r][-1]

  def curve(self, key: str = "val_loss") -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in self.records if key in r]


def optimizer(name: str, lr: float, steps: int, *, warmup: int | None = None, clip: float = 1.0,
              schedule: str = "cosine", **hparams) -> optax.GradientTransformation:
  """A registered optimizer on the CLI's schedule (linear warmup, default 10% of steps, cosine to 0.1×) and clip."""
  warmup = min(100, steps // 10) if warmup is None else warmup
  tx = get_optimizer(name, make_schedule(schedule, lr, steps, warmup=warmup, min_ratio=0.1), **hparams)
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip > 0 else tx


def phase_schedule(count, peak, warmup, steps, min_ratio: float = 0.1):
  """`optim.make_schedule("cosine", peak, steps, warmup=warmup)` as a jnp function of possibly traced arguments:
  lr(t) = peak·t/w for t < w, else peak·(r + (1 − r)·(1 + cos(π·min((t − w)/max(S − w, 1), 1)))/2), r = min_ratio."""
  t = jnp.asarray(count)
  frac = jnp.clip((t - warmup) / jnp.maximum(steps - warmup, 1), 0, 1)
  decay = peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
  return jnp.where(t < warmup, peak * t / jnp.maximum(warmup, 1), decay)


def phase_optimizer(lr: float, steps: int, warmup: int | None = None) -> optax.GradientTransformation:
  """`common.optimizer("adamw", lr, steps)` (clip 1, AdamW, warmup + cosine to 0.1x) with lr, warmup and steps held
  in the optimizer state (`optax.inject_hyperparams`), not in the program: every phase and lr of one architecture
  compiles to the same train step, so `common.fit` compiles it once (the persistent cache serves the rest)."""
  warmup = min(100, steps // 10) if warmup is None else warmup

  def make(peak, warmup, steps):
    schedule = lambda count: phase_schedule(count, peak, warmup, steps)
    return optax.chain(optax.clip_by_global_norm(1.0), get_optimizer("adamw", schedule))

  return optax.inject_hyperparams(make)(peak=float(lr), warmup=float(warmup), steps=float(steps))


def compile_cache(prefix: str, min_entry_bytes: int | None = 0):
  """A persistent compilation cache in a fresh temporary folder (unless one is configured), caching every program:
  each `fit` compiles its own step, and phases with identical programs then hit the cache."""
  import tempfile
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix=prefix))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if min_entry_bytes is not None:
      jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry_bytes)


@contextlib.contextmanager
def quick_compile(enabled: bool = True):
  """Compile without LLVM's expensive passes (`jax_disable_most_optimizations`) inside the block: the same XLA
  programs, about half the compile time, which is nearly all the cost of a smoke-size run."""
  previous = jax.config.values["jax_disable_most_optimizations"]
  if enabled:
    jax.config.update("jax_disable_most_optimizations", True)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", previous)


def smoke_compiles_quickly(main: Callable) -> Callable:
  """Decorates an experiment's `main(cfg)`: when `cfg.smoke`, it runs under `quick_compile`."""
  @functools.wraps(main)
  def wrapped(cfg, *args, **kwargs):
    with quick_compile(cfg.smoke):
      return main(cfg, *args, **kwargs)
  return wrapped


def split(model: Transformer):
  """(graphdef, params, buffers) as pure dicts; `join` inverts it."""
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)


def join(graphdef, params, buffers) -> Transformer:
  return nnx.merge(graphdef, params, buffers)


def loss_fn(graphdef, params, buffers, x, y):
  """(cross entropy + weighted MoE aux losses, (cross entropy, router aux)): the trainer's loss (`lm_loss`) in the
  argument order the experiments use."""
  return lm_loss(graphdef)(params, x, y, buffers)


def evaluate(model: Transformer, batches) -> float:
  """Mean held-out cross entropy (nats/token) over fixed batches."""
  graphdef, params, buffers = split(model)
  f = _held_out_loss(graphdef)
  return float(np.mean([float(f(params, buffers, x, y)) for x, y in batches]))


@functools.lru_cache(maxsize=64)
def _held_out_loss(graphdef):
  """The jitted cross entropy (the trainer's `eval_loss`) of one model structure: every `evaluate` and `fit` of it
  shares one compiled program per shape."""
  eval_fn = eval_loss(graphdef)
  return jax.jit(lambda p, b, x, y: eval_fn(p, x, y, b))


def fit(model: Transformer, tx: optax.GradientTransformation, tokens: np.ndarray, *, steps: int,
        batch_size: int = 16, seq_len: int = 128, seed: int = 0, val=None, eval_every: int | None = None,
        start: int = 0, opt_state=None, log_every: int = 1, metrics: Callable | None = None,
        batch_fn: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
        update_args: Iterable[str] = ()) -> Fit:
  """Trains `model` for `steps` steps of `get_batch(tokens, seed, start + i, ...)` with `tx`.

  Args:
    val: held-out batches (`eval_batches`), evaluated every `eval_every` steps and after the last step.
    start: the first data step (continuing a run on fresh batches); records count steps from `start`.
    opt_state: the optimizer state to continue from (default `tx.init`).
    metrics: optional `f(grads, updates, params, aux) -> dict` of arrays, computed inside the step.
    batch_fn: optional `f(data_step) -> (x, y)` replacing `get_batch(tokens, seed, data_step, ...)` (e.g. windows
      drawn from one cluster); `tokens` is then unused.
    update_args: the extra `tx.update` arguments the optimizer declares (`optim.Needs.update_args`), supplied as the
      trainer's step supplies them (research/train/steps/update_args.py; the model must compute what they read).

  Returns `Fit(model, opt_state, records)`; records hold "step" and the step's outputs (the trainer's step contract,
  research/train/steps/contract.py: "loss", "grad_norm", "finite", an MoE's router metrics, `metrics`') every
  `log_every` steps and "val_loss" at evaluations (step = number of updates done, `start` included).
  """
  graphdef, params, buffers = split(model)
  opt_state = tx.init(params) if opt_state is None else opt_state
  update = make_update(graphdef, tx, update_args=update_args)

  # the trainer's step contract: `metrics` reads the result (the parameters the gradients were taken at)
  observe = None if metrics is None else lambda r, held: metrics(r.grads, r.updates, r.params, r.aux)

  @jax.jit
  def step(params, buffers, opt_state, x, y):
    u = update(params, buffers, opt_state, x, y)
    out = outputs(u.result, observe)
    return u.params, u.buffers, u.result.opt_state, out

  eval_step = _held_out_loss(graphdef)
  records = []
  for i in range(steps):
    x, y = batch_fn(start + i) if batch_fn else get_batch(tokens, seed, start + i, batch_size, seq_len)
    params, buffers, opt_state, out = step(params, buffers, opt_state, x, y)
    rec = {"step": start + i + 1}
    last = i == steps - 1
    if (i + 1) % log_every == 0 or last:
      rec.update({k: np.asarray(v).tolist() if np.ndim(v) or np.asarray(v).dtype == bool else float(v)
                  for k, v in jax.device_get(out).items()})
    if val is not None and ((eval_every and (i + 1) % eval_every == 0) or last):
      rec["val_loss"] = float(np.mean([float(eval_step(params, buffers, vx, vy)) for vx, vy in val]))
    if len(rec) > 1:
      records.append(rec)
  return Fit(join(graphdef, params, buffers), opt_state, records)


def corpus_and_val(batch_size: int, seq_len: int, eval_batches_n: int = 8):
  """(train tokens, fixed held-out batches) of the built-in corpus."""
  corpus = load_corpus()
  return corpus.train, eval_batches(corpus.val, batch_size, seq_len, eval_batches_n)


def pretrained_run(out: str, train, lr: float, seed: int = 0) -> str:
  """The directory of an AdamW run of the train CLI (`train`: a `TrainConfig`, its optimizer, lr and seed replaced)
  under `out`, trained here unless a finished one is there (the sweep's skip and resume)."""
  from research.sweep import Run, SweepConfig, run_grid  # the sweep imports the train CLI
  run_grid(SweepConfig(grid=(f"adamw={lr:g}",), seeds=(seed,), baseline="adamw", out=out, train=train))
  return os.path.join(out, "runs", Run("adamw", "adamw", (), lr, seed).name)


def commit() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=here).stdout.strip() or "unknown"


def command() -> str:
  """The command line that is running, as a reader would retype it."""
  mod = sys.modules["__main__"].__spec__.name if getattr(sys.modules["__main__"], "__spec__", None) else sys.argv[0]
  return " ".join(["python -m", mod.removesuffix(".__main__"), *sys.argv[1:]])  # a package runs as its __main__


def write_results(out: str, name: str, question: str, table: list[str], *, findings: list[str] = (),
                  settings: dict | None = None, data: dict | None = None, cmd: str | None = None):
  """OUT/results.md (question, command, commit, settings, table, findings) and OUT/results.json (`data`)."""
  os.makedirs(out, exist_ok=True)
  lines = [f"# {name}", "", question.strip(), "",
           f"Command: `{cmd or command()}` (commit {commit()}, jax {jax.__version__}, "
           f"{jax.devices()[0].platform.upper()}, {os.cpu_count()} cores)", ""]
  if settings:
    lines += [f"Settings: `{json.dumps(settings)}`", ""]
  lines += list(table)
  if findings:
    lines += ["", *findings]
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  if data is not None:
    with open(os.path.join(out, "results.json"), "w") as f:
      json.dump(data, f, indent=1, default=float)


def full_results(name: str) -> str:
  """research/results/<name>/results.md as committed (the notebooks show it beside their smoke run), or how to make
  it when this checkout has none."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", name, "results.md")
  if not os.path.exists(path):
    return f"No full-size results yet: run `python -m research.experiments.{name}`."
  with open(path) as f:
    return f.read()


def tree_bytes(tree) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree)
                 if hasattr(x, "shape")))


@dataclasses.dataclass
class Seeds:
  """What `run_seeds` returns: each seed's run, the lr grid (arm -> {lr: final val loss}) and each arm's lr."""
  runs: dict
  tune: dict
  chosen: dict
  wall_s: float


def run_seeds(cfg, one_seed: Callable[[int, dict, dict], dict]) -> Seeds:
  """`one_seed(seed, tune, chosen)` -> {"arms": {arm: {"final": ..., ...}}} for each of cfg.seeds, the first seed
  tuning each arm's lr (`tuned_fit`); a full-size run resumes from what an interrupted one saved (partial.json after
  every seed) and skips the seeds it finished; each seed's final losses printed."""
  done = load_partial(cfg) or {"runs": {}, "tune": {}, "chosen": {}}
  runs = {int(s): r for s, r in done["runs"].items()}
  tune = {a: {float(lr): v for lr, v in t.items()} for a, t in done["tune"].items()}
  chosen, t0 = done["chosen"], time.perf_counter()
  for seed in cfg.seeds:
    if seed in runs:
      continue
    runs[seed] = run = one_seed(seed, tune, chosen)
    if not cfg.smoke:
      save_partial(cfg, runs=runs, tune=tune, chosen=chosen)
    print(f"seed {seed}: " + ", ".join(f"{a} {r['final']:.4f}" for a, r in run["arms"].items())
          + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
  return Seeds(runs, tune, chosen, time.perf_counter() - t0)


def tuned_fit(arm: str, fit_at: Callable[[float], Fit], lrs, tuning: bool, tune: dict, chosen: dict) -> Fit:
  """An arm's run at its lr. On the tuning seed (`tuning`) every lr of `lrs` is run (`fit_at(lr)`), tune[arm] gets
  {lr: final val loss} and chosen[arm] the best; on the other seeds only chosen[arm] is run."""
  fits = {lr: fit_at(lr) for lr in (lrs if tuning else (chosen[arm],))}
  if tuning:
    tune[arm] = {lr: f.final_val for lr, f in fits.items()}
    chosen[arm] = min(tune[arm], key=tune[arm].get)
  return fits[chosen[arm]]


def write_experiment(cfg, name: str, question: str, result: dict, tables: Callable[[dict], list[str]],
                     findings: Callable[[dict], list[str]], plot: Callable[[dict], object]):
  """An experiment's full-size outputs in cfg.out: results.json (first: the raw numbers whatever the formatting
  does), results.md (the settings, `tables(result)`, `findings(result)`) and the figure `plot(result)` as
  val_loss.png."""
  settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("smoke", "out")}
  os.makedirs(cfg.out, exist_ok=True)
  with open(os.path.join(cfg.out, "results.json"), "w") as f:
    json.dump(result, f, indent=1, default=float)
  write_results(cfg.out, name, question, tables(result), findings=findings(result), settings=settings, data=result,
                cmd=f"python -m research.experiments.{name}")
  plot(result).savefig(os.path.join(cfg.out, "val_loss.png"), dpi=110, bbox_inches="tight")


def train_tail(records, n: int = 10) -> float:
  """Mean training loss of the last n logged steps of `fit` records."""
  return float(np.mean([r["loss"] for r in records if "loss" in r][-n:]))


def cli(main: Callable, config: type, cache: str | None = None, kept: Callable[..., str] | None = None,
        **cache_kwargs):
  """An experiment's command line (`python -m research.experiments.NAME [FLAGS]`): the flags parsed and checked
  before any work (`check_config`; a full run's --out writable), the compilation cache (`compile_cache(cache)`),
  then `main(cfg)` under the command-line error discipline (`research.entry`). A full run stopped by Ctrl-C says what
  it kept: `kept(cfg)` (an experiment that resumes from something else), else `kept_after_interrupt` (partial.json)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  cfg = tyro.cli(config, prog=f"python -m {spec.name.removesuffix('.__main__')}" if spec else None)

  def checked():
    with entry.one_line_errors(OSError):  # a path that cannot be read or written: bad input, before the work
      check_config(cfg)
      if not getattr(cfg, "smoke", False):
        entry.writable_dir(cfg.out)
      if cache:
        compile_cache(cache, **cache_kwargs)
    # the work's own refusals (UsageError) and the library's of the user's values; anything else is a bug: its traceback
    with entry.one_line_errors(library=True):
      main(cfg)
  said = kept or kept_after_interrupt
  entry.command(checked, interrupted=lambda: "" if getattr(cfg, "smoke", False) else said(cfg))


def check_config(cfg):
  """Refuses (entry.UsageError) what an experiment's flags cannot mean, before its work: no seeds or no lrs (`seeds`,
  `lrs`, every `*_lrs` but `also_lrs`, which adds lrs to a tuned grid), an lr that is not a positive finite number
  (`lr`, `*_lr`, and every value of `lrs`/`*_lrs`); then every field's rule (`research.flags`: an integer a count >= 1
  unless it is a seed, a process index or another shared flag that may be 0, a float finite and >= 0, a string in its
  choice set, a mesh spec, a path of the right kind), --out excepted (a full run's own check: `cli`)."""
  for field in dataclasses.fields(cfg):
    name, value, flag = field.name, getattr(cfg, field.name), "--" + field.name.replace("_", "-")
    if (name in ("seeds", "lrs") or name.endswith("_lrs") and name != "also_lrs") and not value:
      raise entry.UsageError(f"{flag}: give at least one value")
    lrs = (value,) if name == "lr" or name.endswith("_lr") else value if name.endswith("lrs") else ()
    bad = [lr for lr in lrs or () if isinstance(lr, (int, float)) and not (lr > 0 and np.isfinite(lr))]
    if bad:
      raise entry.UsageError(f"{flag}: a learning rate must be a positive finite number, got {bad[0]}")
  flags.check_config(cfg, skip=("out",))


__all__ = ["Fit", "optimizer", "phase_schedule", "phase_optimizer", "compile_cache", "band", "split", "join",
           "loss_fn", "evaluate", "fit", "corpus_and_val", "commit", "command", "write_results", "full_results",
           "tree_bytes", "mean_std", "pm", "train_tail", "lr_grid_table", "seed_stat", "seed_paired", "resolved",
           "timing_lines", "Seeds", "run_seeds", "tuned_fit", "curves_plot", "write_experiment", "PARTIAL",
           "load_partial", "save_partial", "drop_partial", "cli", "kept_after_interrupt", "check_config",
           "quick_compile", "smoke_compiles_quickly", "past_edge", "Base", "Versus", "versus", "against",
           "delta_cell", "table"]


def past_edge(val_by_lr: dict, factor: float = 3.0) -> float | None:
  """The lr to add when the best of ≥ 2 tried lrs (lr -> val loss, inf if diverged) is the largest (×factor) or
  the smallest (÷factor); None when it is interior, or nothing converged."""
  finite = {lr: v for lr, v in val_by_lr.items() if np.isfinite(v)}
  if len(val_by_lr) < 2 or not finite:
    return None
  best = min(finite, key=finite.get)
  edge = best * factor if best == max(val_by_lr) else best / factor if best == min(val_by_lr) else None
  return None if edge is None else float(f"{edge:.3g}")
