"""A run built before its first step (`start`): the mesh, data and model (startup.py), the optimizer, the compiled
steps of what trains, the memory pre-flight, the state (new, or restored from the newest readable checkpoint), the
feed, and every object the loop's hooks call; config.json written. `Run` is what the loop carries from step to
step."""

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
from optim import Needs
from research.data import Corpus
from research.train.config import TrainConfig
from research.train.config.trainable import Trainable
from research.train.feed import Feed
from research.train.hooks.profiler import Profiler
from research.train.hooks.progress import Progress
from research.train.hooks.source_weights import Mixing
from research.train.hooks.throughput import Meter, Peak
from research.train.hooks.trackers import Trackers
from research.train.hooks.watchdog import Watchdog
from research.train.runtime.processes import is_primary
from research.train.setup import memory
from research.train.setup.blockwise import blockwise_parts
from research.train.setup.build import make_optimizer, optimizer_needs, step_options
from research.train.setup.initial_state import abstract_initial_state, initial_state, sync_steps
from research.train.setup.resume import newest_readable
from research.train.setup.startup import run_meta, setup
from research.train.setup.switch import Layout, switch_layout
from research.train.steps import blockstep, layerfreeze, observed, sync
from research.train.steps.health import Monitor
from research.train.steps.step import make_steps
from research.train.steps.train_state import TrainState
from research.train.store import rundir
from research.train.store.checkpoint import Checkpointer
from sharding import logical_names


@dataclasses.dataclass
class Run:
  """What the loop carries from step to step."""
  cfg: TrainConfig
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
    self.end = min(self.cfg.training.steps, self.cfg.training.stop_at or self.cfg.training.steps)


class Programs(NamedTuple):
  """A run's pieces before its state exists (nothing allocated): what the memory pre-flight compiles against."""
  setup: tuple  # `startup.setup`'s (mesh, model config, corpus, batch sharding, plan, pipeline, held-out batches)
  tx: Any
  schedule: Callable  # the learning rate at each step
  parts: Any  # a block-coordinate optimizer's blockwise step, or None
  graphdef: nnx.GraphDef
  abstract: TrainState
  shardings: TrainState
  report: dict
  train_step: Callable
  eval_step: Callable
  syncer: sync.Steps
  needs: Needs  # the optimizer's declared needs, computed once here and handed to every part that acts on them


def programs(cfg: TrainConfig) -> Programs:
  """The mesh, data, optimizer, abstract state and step programs of a run, built as `start` builds them.

  Args:
    cfg: the run's config (checked by `research.train.setup.checks`).

  Returns:
    The `Programs`; the train step is compiled by the pre-flight (`memory.estimate`), not here.
  """
  needs = optimizer_needs(cfg.optim)  # once per run
  built = setup(cfg, needs)
  mesh, mcfg, corpus, batch_sh = built[:4]
  tx, schedule = make_optimizer(cfg, needs=needs)
  parts = blockwise_parts(cfg, mcfg, mesh, schedule, needs)
  graphdef, abstract, shardings, report = abstract_initial_state(cfg, mcfg, mesh, tx, corpus, parts, needs)
  train_step, eval_step = train_programs(cfg, graphdef, tx, parts, shardings, batch_sh, needs=needs)
  build = lambda observe, held_sh: train_programs(cfg, graphdef, tx, parts, shardings, batch_sh, observe, held_sh,
                                                 needs)[0]
  train_step = observed.wrap(cfg.observe, train_step, build, built[-1])
  syncer = sync_steps(cfg.sync, graphdef, tx, shardings, batch_sh, train_step, needs.update_args)
  return Programs(built, tx, schedule, parts, graphdef, abstract, shardings, report, train_step, eval_step, syncer,
                  needs)


def start(cfg: TrainConfig) -> Run:
  """The run built and, when it has a readable checkpoint, resumed; config.json written.

  Args:
    cfg: the run's config (checked by `research.train.setup.checks`).

  Returns:
    The `Run` at its first step to take.
  """
  built, tx, schedule, parts, graphdef, abstract, shardings, report, train_step, eval_step, syncer, needs = \
      programs(cfg)
  mesh, mcfg, corpus, batch_sh, plan, pipe, val_host, val = built
  # compiled before anything is allocated; may refuse
  estimate = _memory(cfg, syncer.train, abstract, batch_sh, mesh, needs, mcfg)
  names = logical_names(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.training.seed)))[2]
  switches = [(at, switch_layout(m, abstract, names, graphdef, tx, cfg, val_host, needs)) for at, m in plan]
  layout = Layout(mesh, shardings, batch_sh, val, train_step, eval_step)
  out = cfg.checkpoint.out
  state = None
  if not rundir.has_checkpoint(out):  # a new run's state, created sharded (--init-from read here)
    state, report = initial_state(cfg, mcfg, mesh, tx, corpus, parts, shardings, needs)
  meta = run_meta(cfg, mcfg, mesh, corpus, pipe, report)
  ckpt = Checkpointer(os.path.join(out, "ckpt"), keep=cfg.checkpoint.keep, every=cfg.checkpoint.ckpt_every,
                      save_concurrent_gb=estimate.writer_gb)  # bounded where it shares the devices' memory
  monitor = Monitor(cfg.health.max_bad_steps, cfg.health.spike_factor, cfg.health.spike_window)
  begin, restored, saved = newest_readable(ckpt, meta, abstract, shardings, switches, out)
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
  feed = Feed(corpus, cfg.training, cfg.data, cfg.data_options, layout.mesh, begin,
              saved.get("loader") if saved else None)
  peak = Peak(cfg.logging.peak_flops, mcfg.compute_dtype, layout.mesh.size)  # MFU's denominator (hooks/throughput.py)
  meta["peak_flops"] = {"flops": peak.flops, "source": peak.source}
  metrics = rundir.MetricsLog(os.path.join(out, "metrics.jsonl"), enabled=is_primary())
  records = metrics.open(begin)  # what the interrupted run logged past its checkpoint is dropped
  if isinstance(train_step, observed.ObservedSteps):  # an EMA over the observed steps continues from the logged ones
    train_step.replay(records)
  trackers = Trackers.open(cfg.logging.tracker, out, cfg.training.steps, meta, begin)  # only process 0 writes
  if is_primary():  # one writer for the run's own files; orbax coordinates the checkpoint writes
    rundir.write_json_lines(os.path.join(out, "config.json"), [meta], indent=2)
  watchdog = Watchdog(cfg.distributed.peer_timeout, f"after step {{step}} of a {jax.process_count()}-process run: a "
                      f"peer process probably died; restart every process with the same command to resume")
  return Run(cfg=cfg, corpus=corpus, feed=feed, layout=layout, switches=switches, syncer=syncer,
             state=cast(TrainState, state),  # a new run's, or the restored checkpoint's

             start=begin, schedule=schedule, meta=meta, ckpt=ckpt, metrics=metrics, records=records,
             trackers=trackers, mixing=Mixing(corpus, graphdef, layout.val), monitor=monitor, peak=peak,
             meter=Meter(cfg.training.batch_size * cfg.training.seq_len),
             progress=Progress(cfg.training.steps, begin, enabled=cfg.logging.progress and is_primary()),
             watchdog=watchdog, profiler=Profiler(cfg.logging.profile, out, show=is_primary()),
             model_flops_per_token=flops_per_token(mcfg, cfg.training.seq_len), estimate=estimate)


def train_programs(cfg: TrainConfig, graphdef, tx, parts, shardings, batch_sh, observe=None, held_sh=(),
                   needs: Needs | None = None):
  """The compiled programs of this run's state, by what trains (`Trainable.step`).

  Args:
    cfg: the run's config.
    graphdef: the model's structure.
    tx: the optimizer.
    parts: a blockwise optimizer's `Parts`, or None.
    shardings: the state's shardings.
    batch_sh: a batch's sharding.
    observe: the observers this program runs (`contract.outputs`); None: the plain program.
    held_sh: the shardings of the observers' extra inputs (the held batch).
    needs: the run's optimizer needs (None: computed from the config).

  Returns:
    The jitted (train_step, eval_step): the blockwise step, the --freeze-layers step, or the plain one.
  """
  step = Trainable.of_run(cfg.finetune, parts is not None).step
  if step == "blockwise":
    return blockstep.make_block_steps(graphdef, parts, shardings, batch_sh, observe=observe, held_sh=held_sh)
  if step == "layers":
    return layerfreeze.make_layer_steps(graphdef, tx, shardings, batch_sh, cfg.finetune.freeze_layers,
                                        observe=observe, held_sh=held_sh)
  return make_steps(graphdef, tx, shardings, batch_sh, **step_options(cfg, needs), observe=observe, held_sh=held_sh)


def _memory(cfg: TrainConfig, train_step, abstract, batch_sh, mesh, needs: Needs, mcfg):
  """The memory pre-flight (research/train/setup/memory.py): the step's bytes per device printed, a run that cannot
  fit refused (RunError) before its state exists; the estimate returned."""
  est = memory.estimate(train_step, abstract, (cfg.training.batch_size, cfg.training.seq_len), batch_sh, mesh)
  memory.check(est, cfg.runtime.memory_limit, cfg, needs, mcfg)
  if is_primary():  # on stdout with the run's other lines: stderr is for what went wrong
    print(est.line(), flush=True)
  return est
