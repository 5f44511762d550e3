"""The training loop: `run(cfg)` trains (or resumes) a run directory and returns its metrics records.

`_train` is the story: build the run (mesh, data, state, compiled steps, resumed if it can be), then step until the
end, a signal or too many bad steps, each step logged, evaluated and checkpointed on its schedule. Every concern it
calls lives in its own module of this package (the step in `step.py`, the state in `state.py`, resuming in
`resume.py`, checkpoints in `checkpoint.py`, the batches in `feed.py`, ...). The batch at step s is a pure function of
(seed, s), and the loader's state is checkpointed: a resumed run continues exactly where the interrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

from models import Transformer, flops_per_token
from research.data import Corpus
from research.train import blockstep, frozen, layerfreeze, memory, preflight, rundir, sync
from research.train.mixing import Mixing
from research.train.build import make_optimizer, step_options
from research.train.checkpoint import Checkpointer, CheckpointSaveError
from research.train.config import TrainConfig
from research.train.distributed import initialize as init_distributed, is_primary
from research.train.feed import Feed
from research.train.health import BadStepsError, Monitor
from research.train.profile import Profiler
from research.train.progress import Progress
from research.train.resume import newest_readable
from research.train.runtime import setup_jax
from research.train.signals import Stop
from research.train.startup import run_meta, setup
from research.train.state import abstract_initial_state, initial_state, sync_steps
from research.train.step import make_steps, router_metrics
from research.train.switch import Layout, switch_layout
from research.train.throughput import Meter, Peak
from research.train.trainable import Trainable
from research.train.trackers import Trackers
from research.train.watchdog import Watchdog
from sharding import logical_names, mesh_spec, reshard


def run(cfg: TrainConfig) -> list[dict]:
  """Trains (or resumes) and returns the metrics records of the whole run: the flags checked before anything starts,
  the run directory locked for the run (and removed again if this run created it and failed before its first
  checkpoint)."""
  preflight.check(cfg)
  cfg = frozen.resolved(cfg)  # the dtypes left unset, as config.json records them
  with Stop() as stop:  # from here on SIGINT/SIGTERM stop the run cleanly, during start-up too
    init_distributed(cfg.distributed.coordinator, cfg.distributed.num_processes, cfg.distributed.process_id, cfg.distributed.mode,  # before any JAX use
                     heartbeat_timeout=cfg.distributed.peer_timeout + 60)  # JAX's abort comes after ours, if ours is armed
    setup_jax(cfg.runtime.devices, cfg.runtime.compile_cache)
    with rundir.claim(cfg.checkpoint.out, lock=is_primary(), keep_on=(BadStepsError, CheckpointSaveError)):
      return _train(cfg, stop)


def _train(cfg: TrainConfig, stop: Stop) -> list[dict]:
  r = _start(cfg)  # mesh, data, state and compiled steps; resumed from the newest readable checkpoint if any
  try:
    with _watchdog(r), contextlib.ExitStack() as in_mesh:
      in_mesh.enter_context(jax.set_mesh(r.layout.mesh))
      while r.step < r.end and stop.signum is None:
        if r.switches and r.switches[0][0] == r.step:  # --switch-at: the new steps are compiled, only the state moves
          _switch(r, in_mesh)
        out = _advance(r)  # one optimizer step (and --sync's outer step when due)
        r.mixing.update(r)  # --mix dynamic: new source weights from the next batch, every `every` steps
        logged = _logged(r, r.step)
        if logged or _saves(r, r.step, stop):
          r.monitor.flush()  # the loss and finite flag of every step since the last flush, in one transfer
        else:  # the previous step's (done by now, this one queued behind it): every step is counted in time
          r.monitor.flush(keep=1)
        r.watchdog.beat(r.step - 1)  # every process took part in the steps read back so far
        if logged:
          _log(r, out)
        if r.monitor.failed:  # stop before saving: the newest checkpoint stays the last one before the bad steps
          break
        _checkpoint(r, stop)
        r.progress.advance()
    r.progress.close()
    r.ckpt.close()
    if is_primary() and r.step > r.start:
      print(memory.measured(r.estimate, r.layout.mesh), flush=True)
  except CheckpointSaveError:  # nothing past the newest committed checkpoint stays logged
    r.metrics.cut(r.ckpt.latest_step())
    raise
  finally:
    r.profiler.close(r.step)  # a run stopped inside the --profile window keeps what was traced
    r.metrics.close()
    r.trackers.close()
    r.feed.close()
  _finish(r, stop)
  return r.records


@dataclasses.dataclass
class _Run:
  """What the loop carries from step to step."""
  cfg: TrainConfig
  corpus: Corpus
  feed: Feed  # the training batches (this process's rows), from the grain loader
  layout: Layout  # the mesh trained on now: its shardings, held-out batches and compiled steps
  switches: list[tuple[int, Layout]]  # --switch-at's layouts still to come
  syncer: sync.Steps  # the step programs of --sync (allreduce: the plain train step)
  state: dict
  start: int  # the step this session started from (0, or the checkpoint it resumed)
  schedule: Callable
  meta: dict  # config.json; each checkpoint's metadata
  ckpt: Checkpointer
  metrics: rundir.MetricsLog
  trackers: Trackers  # TensorBoard, W&B, MLflow: views of metrics.jsonl
  mixing: Mixing  # --mix: the sources' weights, their held-out losses, the dynamic rule (inactive for one corpus)
  monitor: Monitor
  records: list[dict]
  peak: Peak
  meter: Meter
  progress: Progress
  watchdog: Watchdog
  profiler: Profiler  # --profile's trace
  model_flops_per_token: float
  estimate: memory.Estimate  # the memory pre-flight's, compared with the measured peak at the end
  step: int = dataclasses.field(init=False)  # steps done so far
  end: int = dataclasses.field(init=False)  # the step this session stops after (--steps, or --stop-at)

  def __post_init__(self):
    self.step = self.start
    self.end = min(self.cfg.training.steps, self.cfg.training.stop_at or self.cfg.training.steps)


def _start(cfg: TrainConfig) -> _Run:
  """The run built and, when it has a readable checkpoint, resumed; config.json written."""
  mesh, mcfg, corpus, batch_sh, plan, pipe, val_host, val = setup(cfg)
  tx, schedule = make_optimizer(cfg)
  parts = blockstep.blockwise_parts(cfg, mcfg, mesh, schedule)  # a block-coordinate optimizer's blockwise step, or None
  graphdef, abstract, shardings, report = abstract_initial_state(cfg, mcfg, mesh, tx, corpus, parts)
  train_step, eval_step = train_programs(cfg, graphdef, tx, parts, shardings, batch_sh)
  syncer = sync_steps(cfg, graphdef, tx, shardings, batch_sh, train_step)
  estimate = _memory(cfg, syncer.train, abstract, batch_sh, mesh)  # compiled before anything is allocated; may refuse
  names = logical_names(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.training.seed)))[2]
  switches = [(at, switch_layout(m, abstract, names, graphdef, tx, cfg, val_host)) for at, m in plan]
  layout = Layout(mesh, shardings, batch_sh, val, train_step, eval_step)
  state = None
  if not rundir.has_checkpoint(cfg.checkpoint.out):  # a new run's state, created sharded (--init-from read here)
    state, report = initial_state(cfg, mcfg, mesh, tx, corpus, parts, shardings)
  meta = run_meta(cfg, mcfg, mesh, corpus, pipe, report)
  ckpt = Checkpointer(os.path.join(cfg.checkpoint.out, "ckpt"), keep=cfg.checkpoint.keep, every=cfg.checkpoint.ckpt_every,
                      save_concurrent_gb=estimate.writer_gb)  # bounded where it shares the devices' memory
  metrics = rundir.MetricsLog(os.path.join(cfg.checkpoint.out, "metrics.jsonl"), enabled=is_primary())
  monitor = Monitor(cfg.health.max_bad_steps, cfg.health.spike_factor, cfg.health.spike_window)
  start, restored, saved = newest_readable(ckpt, meta, abstract, shardings, switches, cfg.checkpoint.out)
  if start is not None:  # restored into the abstract state's shapes and shardings
    while switches and switches[0][0] <= start:  # resume on the mesh the run had switched to by then
      layout = switches.pop(0)[1]
      syncer.switched(layout.train_step)
    state = restored
    if "peft" in saved:  # the adapters' report as the run measured it (a sparse adapter's count after pruning)
      meta["peft"] = saved["peft"]
    monitor.load(saved.get("health"))
    print(f"resuming {cfg.checkpoint.out} from step {start}", file=sys.stderr)
  start = start or 0
  feed = Feed(cfg, corpus, layout.mesh, start, saved.get("loader") if saved else None)
  peak = Peak(cfg.logging.peak_flops, mcfg.compute_dtype, layout.mesh.size)  # MFU's denominator (research/train/throughput.py)
  meta["peak_flops"] = {"flops": peak.flops, "source": peak.source}
  records = metrics.open(start)  # what the interrupted run logged past its checkpoint is dropped
  trackers = Trackers.open(cfg, meta, start)  # research/train/trackers.py; only process 0 writes
  if is_primary():  # one writer for the run's own files; orbax coordinates the checkpoint writes
    rundir.write_json_lines(os.path.join(cfg.checkpoint.out, "config.json"), [meta], indent=2)
  watchdog = Watchdog(cfg.distributed.peer_timeout, f"after step {{step}} of a {jax.process_count()}-process run: a peer "
                      f"process probably died; restart every process with the same command to resume")
  return _Run(cfg=cfg, corpus=corpus, feed=feed, layout=layout, switches=switches, syncer=syncer, state=state, start=start,
              schedule=schedule, meta=meta, ckpt=ckpt, metrics=metrics, monitor=monitor, records=records, peak=peak,
              meter=Meter(cfg.training.batch_size * cfg.training.seq_len), trackers=trackers,
              mixing=Mixing(cfg, corpus, graphdef, layout.val),
              progress=Progress(cfg.training.steps, start, enabled=cfg.logging.progress and is_primary()), watchdog=watchdog,
              profiler=Profiler(cfg.logging.profile, cfg.checkpoint.out, show=is_primary()),
              model_flops_per_token=flops_per_token(mcfg, cfg.training.seq_len), estimate=estimate)


def train_programs(cfg: TrainConfig, graphdef, tx, parts, shardings, batch_sh):
  """The jitted (train_step, eval_step) of this run's state, by what trains (`Trainable.step`): a blockwise
  optimizer's step (`parts`), the --freeze-layers step, or the plain one."""
  step = Trainable.of_run(cfg, parts is not None).step
  if step == "blockwise":
    return blockstep.make_block_steps(graphdef, parts, shardings, batch_sh)
  if step == "layers":
    return layerfreeze.make_layer_steps(graphdef, tx, shardings, batch_sh, cfg.finetune.freeze_layers)
  return make_steps(graphdef, tx, shardings, batch_sh, **step_options(cfg))


def _memory(cfg: TrainConfig, train_step, abstract, batch_sh, mesh):
  """The memory pre-flight (research/train/memory.py): the step's bytes per device printed, a run that cannot fit
  refused (RunError) before its state exists; the estimate returned."""
  est = memory.estimate(train_step, abstract, (cfg.training.batch_size, cfg.training.seq_len), batch_sh, mesh)
  memory.check(est, cfg.runtime.memory_limit, cfg)
  if is_primary():  # on stdout with the run's other lines: stderr is for what went wrong
    print(est.line(), flush=True)
  return est


def _watchdog(r: _Run):
  """The peer watchdog of a multi-process run (a no-op context in a single process)."""
  return r.watchdog if jax.process_count() > 1 else contextlib.nullcontext()


def _switch(r: _Run, in_mesh: contextlib.ExitStack):
  """Moves the live state onto the next --switch-at layout, whose steps are already compiled."""
  t = time.perf_counter()
  r.layout = r.switches.pop(0)[1]
  r.syncer.switched(r.layout.train_step)
  r.feed.switched(r.layout.mesh)
  r.state = jax.block_until_ready(reshard(r.state, shardings=r.layout.shardings, donate=True))
  in_mesh.close()
  in_mesh.enter_context(jax.set_mesh(r.layout.mesh))
  r.meter.compiled(r.step)  # a new program: its first steps are not steady, the switch itself not training
  print(f"step {r.step}: switched to mesh {mesh_spec(r.layout.mesh)} in {time.perf_counter() - t:.2f} s",
        file=sys.stderr)


def _advance(r: _Run) -> dict:
  """One step on the loader's next batch; returns the step's outputs (still on the device)."""
  r.profiler.before(r.step + 1)  # --profile: the trace starts before its first step is dispatched
  r.state, out = r.syncer.step(r.state, *r.feed.next())
  r.step += 1
  r.state = r.syncer.after(r.state, r.step, r.step == r.cfg.training.steps)  # --sync local:H: the outer step every H steps
  if r.profiler.after(r.step, (out, r.state)):  # the trace written and read: not training time
    r.meter.restart()
  if r.step == r.start + 1:  # the first step compiles: throughput is timed from its end
    jax.block_until_ready(out)
    r.meter.compiled(r.step)
  r.monitor.push(r.step, out)
  r.ckpt.check()  # a failed background save stops the run here
  return out


def _logged(r: _Run, step: int) -> bool:
  """Whether `step` writes a metrics record (every --log-every and --eval-every steps, and the last)."""
  return step % r.cfg.logging.log_every == 0 or step == r.cfg.training.steps or step % r.cfg.logging.eval_every == 0


def _saves(r: _Run, step: int, stop: Stop) -> bool:
  """Whether `step` may save a checkpoint (so the health of every step up to it is read back first)."""
  return step % r.cfg.checkpoint.ckpt_every == 0 or step == r.end or stop.signum is not None


def _log(r: _Run, out: dict):
  """The step's metrics record: loss, grad norm, lr, health, throughput (once a whole step has run after
  compilation), the held-out loss when due, router and --sync metrics; written and shown."""
  cfg, step, last = r.cfg, r.step, r.step == r.cfg.training.steps
  loss = float(out["loss"])  # waits for the step
  rec = {"step": step, "loss": loss, "grad_norm": float(out["grad_norm"]), "lr": float(r.schedule(step - 1)),
         **r.monitor.take()}
  rec.update(r.meter.record(step, step == r.end, r.model_flops_per_token, r.peak))  # research/train/throughput.py
  losses = _evaluate(r) if step % cfg.logging.eval_every == 0 or last else None
  if losses is not None:
    rec["val_loss"] = float(np.mean(losses))
  rec.update(r.mixing.record(r.feed, step, losses))
  rec.update(router_metrics(out))
  rec.update(r.syncer.metrics(r.state, step, out, last))
  r.records.append(rec)
  try:
    r.metrics.write(rec)
    r.trackers.log(rec)
  except OSError as e:
    if not rundir.refused(e):
      raise
    raise r.ckpt.write_error(f"step {step}'s metrics in {cfg.checkpoint.out}", e) from None  # cut back like a failed save
  r.progress.log(rec)
  r.meter.restart()  # evaluation and logging are not training time


def _evaluate(r: _Run) -> list:
  """The held-out loss of the model (--sync gossip's: the replicas' mean) on each fixed held-out batch."""
  params = r.syncer.model(r.state)["params"]
  return [r.layout.eval_step(params, x, y, r.state.get("buffers", {})) for x, y in r.layout.val]


def _checkpoint(r: _Run, stop: Stop):
  """Saves every --ckpt-every steps (not amid bad steps) and at the end or a stop. Deciding here, not in orbax,
  keeps orbax from also saving the first step it sees (a step-1 checkpoint nobody asked for)."""
  final = r.step == r.end or stop.signum is not None
  if (r.monitor.bad_run == 0 and r.step % r.cfg.checkpoint.ckpt_every == 0) or final:
    r.state = r.syncer.model(r.state)  # gossip: "params" (what export and sampling read) = the replicas' mean
    r.ckpt.save(r.step, r.state, {**r.meta, "health": r.monitor.state(), "loader": r.feed.state()}, force=True)


def _finish(r: _Run, stop: Stop):
  """Raises what ended the run early: too many bad steps (exit 3), or a signal (a checkpoint saved, exit 128 + n)."""
  if r.monitor.failed:
    raise r.monitor.error(r.step, r.ckpt.manager.latest_step())
  if stop.signum is not None:
    saved = ("checkpoint saved" if r.step > r.start else
             "the checkpoint it resumed from is kept" if r.start else "nothing was saved")
    print(f"stopped by signal {stop.signum} at step {r.step}; {saved}, rerun the same command to resume",
          file=sys.stderr)
    raise SystemExit(128 + stop.signum)
