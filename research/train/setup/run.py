"""A run built before its first step (`start`): its plan (plan.py, resolved once by `programs`), the mesh, data and
model (startup.py), the optimizer, the compiled steps of what trains, the memory pre-flight, the state (new, or
restored from the newest readable checkpoint), the feed, and every object the loop's hooks call; config.json written.
`Run` is what the loop carries from step to step."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
from flax import nnx

from models import Transformer, flops_per_token
from research.data import Corpus
from research.train.config import TrainConfig, paths
from research.train.config.observe import ObserveSection
from research.train.config.sections import CheckpointSection, LoggingSection, TrainingSection
from research.train.feed import Feed
from research.train.hooks.profiler import Profiler
from research.train.hooks.progress import Progress
from research.train.hooks.source_weights import Mixing
from research.train.hooks.throughput import Meter, Peak
from research.train.hooks.trackers import Trackers
from research.train.hooks.watchdog import Watchdog
from research.train.runtime.processes import is_primary
from research.train.setup import blockwise, memory, padnet, startup
from research.train.setup.build import make_optimizer, model_config, optimizer_needs, step_options
from research.train.setup.initial_state import abstract_initial_state, initial_state, sync_steps
from research.train.setup.plan import Plan
from research.train.setup.resume import newest_readable
from research.train.setup.startup import run_meta
from research.train.setup.switch import Layout, switch_layout
from research.train.steps import blockstep, layerfreeze, observed, sync
from research.train.steps.health import Monitor
from research.train.steps.step import make_steps
from research.train.steps.train_state import TrainState
from research.train.store import rundir
from research.train.store.checkpoint import Checkpointer
from sharding import logical_names, make_mesh


@dataclasses.dataclass
class Run:
  """What the loop carries from step to step (of the config, the sections its hooks read)."""
  plan: Plan
  training: TrainingSection  # --steps, --stop-at
  logging: LoggingSection  # --log-every, --eval-every
  checkpoint: CheckpointSection  # --out, --ckpt-every
  observe: ObserveSection  # the observers' cadences
  corpus: Corpus
  feed: Feed  # the training batches (this process's rows), from the grain loader
  layout: Layout  # the mesh trained on now: its shardings, held-out batches and compiled steps
  switches: list[tuple[int, Layout]]  # --switch-at's layouts still to come
  syncer: sync.Steps  # the step programs of --sync (allreduce: the plain train step)
  state: TrainState
  start: int  # the step this session started from (0, or the checkpoint it resumed)
  schedule: Callable  # the learning rate at an update count
  meta: dict  # config.json; each checkpoint's metadata
  ckpt: Checkpointer
  metrics: rundir.MetricsLog
  records: list[dict]  # the records of the steps before this session (metrics.jsonl's, up to `start`)
  trackers: Trackers  # TensorBoard, W&B, MLflow: views of metrics.jsonl
  mixing: Mixing  # --mix: the sources' weights, their held-out losses, the dynamic rule (inactive for one corpus)
  monitor: Monitor  # non-finite steps and loss spikes
  peak: Peak  # MFU's denominator
  meter: Meter  # tokens/s and MFU
  progress: Progress  # the console
  watchdog: Watchdog  # dead peers of a multi-process run
  profiler: Profiler  # --profile's trace
  model_flops_per_token: float
  estimate: memory.Estimate  # the memory pre-flight's, compared with the measured peak at the end
  step: int = dataclasses.field(init=False)  # steps done so far
  end: int = dataclasses.field(init=False)  # the step this session stops after (--steps, or --stop-at)
  in_mesh: contextlib.ExitStack | None = None  # the mesh context the steps run in (--switch-at replaces it)

  def __post_init__(self):
    self.step = self.start
    self.end = min(self.training.steps, self.training.stop_at or self.training.steps)


class Programs(NamedTuple):
  """A run's pieces before its state exists (nothing allocated): what the memory pre-flight compiles against."""
  plan: Plan  # the run's decisions, resolved once
  corpus: Corpus
  batch_sh: Any  # a batch's sharding
  switches: list  # --switch-at's [(step, mesh)]
  pipe: dict | None  # the GPipe pipeline plan
  val_host: list  # the held-out batches on the host
  val: list  # and on the mesh
  loader: Any  # the training batches (a calibrating adapter's first batch, PAD-Net's scoring batches)
  tx: Any
  plain: Any  # the optimizer without --freeze (--freeze's report), or None
  schedule: Callable  # the learning rate at each step
  parts: Any  # a block-coordinate optimizer's blockwise step, or None
  graphdef: nnx.GraphDef
  abstract: TrainState
  shardings: TrainState
  report: dict
  train_step: Callable
  eval_step: Callable
  syncer: sync.Steps


def programs(cfg: TrainConfig) -> Programs:
  """The plan, data, optimizer, abstract state and step programs of a run, built as `start` builds them.

  The plan (research/train/setup/plan.py) is resolved here, once, and every check that needs it done; each part below
  receives it and the config section it reads.

  Args:
    cfg: the run's config (checked by `research.train.setup.checks`).

  Returns:
    The `Programs`; the train step is compiled by the pre-flight (`memory.estimate`), not here.
  """
  needs = optimizer_needs(cfg.optim)  # once per run
  mesh = make_mesh(cfg.mesh.spec)
  mcfg = model_config(cfg.model, cfg.moe, cfg.weights.init_from, needs)
  plan = Plan.of(cfg.optim, needs, mcfg, mesh, cfg.trains, cfg.weights.init_from, cfg.sync, cfg.features(),
                 cfg.training.seed, cfg.mesh.zero1)
  startup.check(plan, cfg.observe, cfg.training.batch_size, cfg.model.preset)
  corpus, loader, batch_sh, val_host, val = startup.data(plan, cfg.training, cfg.data, cfg.data_options,
                                                         cfg.logging.eval_batches)
  switches, pipe = startup.meshes(plan, cfg.mesh, cfg.training)
  tx, schedule = make_optimizer(cfg.optim, cfg.training.steps, plan.needs, plan.trains.freeze)
  plain = make_optimizer(cfg.optim, cfg.training.steps, plan.needs)[0] if plan.trains.freeze else None
  parts = blockwise.blockwise_parts(plan, schedule, cfg.optim.grad_clip)
  graphdef, abstract, shardings, report = abstract_initial_state(plan, tx, plain, parts, loader, cfg.peft_options)
  train_step, eval_step = train_programs(plan, graphdef, tx, parts, shardings, batch_sh)
  build = lambda observe, held_sh: train_programs(plan, graphdef, tx, parts, shardings, batch_sh, observe, held_sh)[0]
  train_step = observed.wrap(cfg.observe, train_step, build, val)
  syncer = sync_steps(plan.sync, graphdef, tx, shardings, batch_sh, train_step, plan.needs.update_args)
  return Programs(plan, corpus, batch_sh, switches, pipe, val_host, val, loader, tx, plain, schedule, parts, graphdef,
                  abstract, shardings, report, train_step, eval_step, syncer)


def start(cfg: TrainConfig) -> Run:
  """The run built and, when it has a readable checkpoint, resumed; config.json written.

  Args:
    cfg: the run's config (checked by `research.train.setup.checks`).

  Returns:
    The `Run` at its first step to take.
  """
  p = programs(cfg)
  plan, mesh, out = p.plan, p.plan.mesh, cfg.checkpoint.out
  estimate = _memory(p, cfg.runtime.memory_limit, cfg.training)  # compiled before anything is allocated; may refuse
  names = logical_names(lambda: Transformer(plan.model, rngs=nnx.Rngs(plan.seed)))[2]
  switches = [(at, switch_layout(m, p.abstract, names, p.graphdef, p.tx, plan, cfg.training, cfg.observe, p.val_host))
              for at, m in p.switches]
  layout, syncer = Layout(mesh, p.shardings, p.batch_sh, p.val, p.train_step, p.eval_step), p.syncer
  state, report = None, p.report
  if not rundir.has_checkpoint(out):  # a new run's state, created sharded (--init-from read here)
    state, report = _new_state(p, cfg.peft_options, cfg.moe.partition())
  meta = run_meta(dataclasses.asdict(cfg), plan.model, mesh, p.corpus, p.pipe, report,
                  paths.fingerprints(cfg.data.tokenizer, plan.init_from))
  ckpt = Checkpointer(os.path.join(out, "ckpt"), keep=cfg.checkpoint.keep, every=cfg.checkpoint.ckpt_every,
                      save_concurrent_gb=estimate.writer_gb)  # bounded where it shares the devices' memory
  monitor = Monitor(cfg.health.max_bad_steps, cfg.health.spike_factor, cfg.health.spike_window)
  begin, restored, saved = newest_readable(ckpt, meta, p.abstract, p.shardings, switches, out)
  if begin is not None:  # restored into the abstract state's shapes and shardings
    while switches and switches[0][0] <= begin:  # resume on the mesh the run had switched to by then
      layout = switches.pop(0)[1]
      syncer.switched(layout.train_step)
    state = restored
    # the reports as the run measured them at step 0: a sparse adapter's count after pruning, PAD-Net's partition
    meta.update({k: saved[k] for k in ("peft", "pad_net") if k in saved})
    monitor.load(saved.get("health"))
    print(f"resuming {out} from step {begin}", file=sys.stderr)
  begin = begin or 0
  feed = Feed(p.corpus, cfg.training, cfg.data, cfg.data_options, layout.mesh, begin,
              saved.get("loader") if saved else None)
  peak = Peak(cfg.logging.peak_flops, plan.model.compute_dtype, layout.mesh.size)  # MFU's denominator
  meta["peak_flops"] = {"flops": peak.flops, "source": peak.source}
  metrics = rundir.MetricsLog(os.path.join(out, "metrics.jsonl"), enabled=is_primary())
  records = metrics.open(begin)  # what the interrupted run logged past its checkpoint is dropped
  if isinstance(p.train_step, observed.ObservedSteps):  # an EMA over the observed steps continues from the logged ones
    p.train_step.replay(records)
  trackers = Trackers.open(cfg.logging.tracker, out, cfg.training.steps, meta, begin)  # only process 0 writes
  if is_primary():  # one writer for the run's own files; orbax coordinates the checkpoint writes
    rundir.write_json_lines(os.path.join(out, "config.json"), [meta], indent=2)
  watchdog = Watchdog(cfg.distributed.peer_timeout, f"after step {{step}} of a {jax.process_count()}-process run: a "
                      f"peer process probably died; restart every process with the same command to resume")
  return Run(plan=plan, training=cfg.training, logging=cfg.logging, checkpoint=cfg.checkpoint, observe=cfg.observe,
             corpus=p.corpus, feed=feed, layout=layout, switches=switches, syncer=syncer,
             state=cast(TrainState, state),  # a new run's, or the restored checkpoint's
             start=begin, schedule=p.schedule, meta=meta, ckpt=ckpt, metrics=metrics, records=records,
             trackers=trackers, mixing=Mixing(p.corpus, p.graphdef, layout.val), monitor=monitor, peak=peak,
             meter=Meter(cfg.training.batch_size * cfg.training.seq_len),
             progress=Progress(cfg.training.steps, begin, enabled=cfg.logging.progress and is_primary()),
             watchdog=watchdog, profiler=Profiler(cfg.logging.profile, out, show=is_primary()),
             model_flops_per_token=flops_per_token(plan.model, cfg.training.seq_len), estimate=estimate)


def _new_state(p: Programs, peft_options, partition: dict | None):
  """A new run's state and report (`initial_state`), with PAD-Net's mode partition before the first update when
  --moe.pad-ratio < 1 asks for one (`partition`: `MoEFlags.partition()`)."""
  state, report = initial_state(p.plan, p.tx, p.plain, p.parts, p.shardings, p.loader, peft_options)
  if partition:
    state, report["pad_net"], line = padnet.partition(partition, p.loader, p.graphdef, state, p.plan.mesh)
    if is_primary():
      print(line, file=sys.stderr)
  return state, report


def train_programs(plan: Plan, graphdef, tx, parts, shardings, batch_sh, observe=None, held_sh=()):
  """The compiled programs of this run's state, by what trains (`Trainable.step`).

  Args:
    plan: the run's plan (what trains, the step's options).
    graphdef: the model's structure.
    tx: the optimizer.
    parts: a blockwise optimizer's `Parts`, or None.
    shardings: the state's shardings.
    batch_sh: a batch's sharding.
    observe: the observers this program runs (`contract.outputs`); None: the plain program.
    held_sh: the shardings of the observers' extra inputs (the held batch).

  Returns:
    The jitted (train_step, eval_step): the blockwise step, the --freeze-layers step, or the plain one.
  """
  step = plan.trains.step
  if step == "blockwise":
    return blockstep.make_block_steps(graphdef, parts, shardings, batch_sh, observe=observe, held_sh=held_sh)
  if step == "layers":
    return layerfreeze.make_layer_steps(graphdef, tx, shardings, batch_sh, plan.trains.layers, observe=observe,
                                        held_sh=held_sh)
  return make_steps(graphdef, tx, shardings, batch_sh, **step_options(plan), observe=observe, held_sh=held_sh)


def _memory(p: Programs, override: float | None, training):
  """The memory pre-flight (research/train/setup/memory.py): the step's bytes per device printed, a run that cannot
  fit refused (RunError) before its state exists; the estimate returned. `override`: --memory-limit."""
  est = memory.estimate(p.syncer.train, p.abstract, (training.batch_size, training.seq_len), p.batch_sh, p.plan.mesh)
  memory.check(est, override, p.plan.trains, p.plan.model, training.seq_len)
  if is_primary():  # on stdout with the run's other lines: stderr is for what went wrong
    print(est.line(), flush=True)
  return est
