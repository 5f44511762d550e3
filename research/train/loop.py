"""The training loop: `run(cfg)` trains (or resumes) a run directory and returns its metrics records.

`run` builds the run (research/train/setup/: its plan, mesh, data, state, compiled steps, resumed if it can be), and
`_train` is the story: step until the end, a signal or too many bad steps; around each step the hooks (`_hooks`, one
line each, each concern a room of research/train/) run at their cadence: --switch-at, the profiler, --sync's outer
step, the throughput meter, the bad-step monitor, dynamic data weights, the peer watchdog, the metrics processor
(with the held-out evaluation), checkpoints and the console. The batch at step s is a pure function of (seed, s),
and the loader's state is checkpointed: a resumed run continues exactly where the interrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import jax
import numpy as np

from research.train.config import TrainConfig
from research.train.hooks.cadence import Hooks, StepInfo
from research.train.hooks.metrics import MetricsProcessor
from research.train.observers import active
from research.train.runtime.devices import setup_jax
from research.train.runtime.processes import initialize as init_distributed
from research.train.runtime.processes import is_primary
from research.train.runtime.signals import Stop
from research.train.setup import checks, memory
from research.train.setup.build import resolved_peft
from research.train.setup.run import Run, start
from research.train.steps import observed
from research.train.steps.health import BadStepsError
from research.train.steps.step import router_metrics
from research.train.store import rundir
from research.train.store.checkpoint import CheckpointSaveError
from sharding import mesh_spec, reshard


def run(cfg: TrainConfig) -> list[dict]:
  """Trains (or resumes) a run directory.

  The flags are checked before anything starts; the run directory is locked for the run (and removed again if this
  run created it and failed before its first checkpoint).

  Args:
    cfg: the run's config.

  Returns:
    The metrics records of the whole run (those of an interrupted session before this one included).
  """
  checks.check(cfg)
  cfg = dataclasses.replace(  # the dtype left unset, as config.json records it
      cfg, peft_options=resolved_peft(cfg.peft_options, cfg.trains, cfg.weights.init_from))
  with Stop() as stop:  # from here on SIGINT/SIGTERM stop the run cleanly, during start-up too
    d = cfg.distributed
    init_distributed(d.coordinator, d.num_processes, d.process_id, d.mode,  # before any JAX use
                     heartbeat_timeout=d.peer_timeout + 60)  # JAX's abort comes after ours, if ours is armed
    setup_jax(cfg.runtime.devices, cfg.runtime.compile_cache)
    with rundir.claim(cfg.checkpoint.out, lock=is_primary(), keep_on=(BadStepsError, CheckpointSaveError)):
      return _train(start(cfg), stop)  # plan, data, state and compiled steps; resumed from its newest checkpoint


def _train(r: Run, stop: Stop) -> list[dict]:
  hooks, processor = _hooks(r, stop)
  try:
    with _watchdog(r), contextlib.ExitStack() as r.in_mesh:
      r.in_mesh.enter_context(jax.set_mesh(r.layout.mesh))
      info = None
      while r.step < r.end and stop.signum is None:
        hooks.run_before(r.step + 1)
        r.state, out = r.syncer.step(r.state, *r.feed.next())  # one optimizer step on the loader's next batch
        r.step += 1
        info = StepInfo(r.step, out, r.end, r.training.steps, stop.signum is not None)
        hooks.run_after(info)
        if r.monitor.failed:  # stopped before saving: the newest checkpoint is the last one before the bad steps
          break
      if stop.signum is not None and info is not None and not _due(r, info) and not r.monitor.failed:
        _checkpoint(r, dataclasses.replace(info, stopping=True))  # the signal came after this step's hooks ran
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
  return r.records + processor.records


def _hooks(r: Run, stop: Stop) -> tuple[Hooks, MetricsProcessor]:
  """The loop's hooks and the metrics processor's sources, in the order they run: a new concern is one line here."""
  hooks = Hooks()
  processor = MetricsProcessor(r.logging.log_every, r.logging.eval_every, r.metrics, r.trackers.log,
                               r.progress.log, lambda step, e: r.ckpt.write_error(
                                   f"step {step}'s metrics in {r.checkpoint.out}", e), r.meter.restart,
                               also_every=tuple(a.every for a in active(r.observe)))
  hooks.before("switch", lambda step: _switch(r) if r.switches and r.switches[0][0] == step - 1 else None)
  hooks.before("profiler", r.profiler.before)  # --profile: the trace starts before its first step is dispatched
  hooks.before("observers", lambda step: observed.arm(r.syncer.train, step))  # the program with the due observers
  hooks.add("sync", lambda i: setattr(r, "state", r.syncer.after(r.state, i.step, i.last)))  # --sync local:H
  hooks.add("profiler", lambda i: r.profiler.after(i.step, (i.out, r.state)) and r.meter.restart())
  hooks.add("throughput", lambda i: _compiled(r, i))
  hooks.add("health", lambda i: r.monitor.push(i.step, i.out))
  hooks.add("checkpoint-health", lambda i: r.ckpt.check())  # a failed background save stops the run here
  hooks.add("mixing", lambda i: r.mixing.update(r))  # --mix dynamic: new source weights, every `every` steps
  hooks.add("read-back", lambda i: r.monitor.flush(keep=0 if processor.due(i) or _may_save(r, i) else 1))
  hooks.add("watchdog", lambda i: r.watchdog.beat(i.step - 1))  # every process took part in the steps read back
  hooks.add("metrics", processor.on_step)
  hooks.add("checkpoint", lambda i: None if r.monitor.failed else _checkpoint(r, i))
  hooks.add("console", lambda i: None if r.monitor.failed else r.progress.advance())
  processor.add("loss", lambda i: {"loss": float(i.out["loss"]), "grad_norm": float(i.out["grad_norm"]),
                                   "lr": float(r.schedule(i.step - 1)), **r.monitor.take()})
  processor.add("throughput", lambda i: r.meter.record(i.step, i.step == r.end, r.model_flops_per_token, r.peak))
  processor.add("evaluation", lambda i: _evaluate(r, i), every=r.logging.eval_every, at_end=True)
  processor.add("mixing", lambda i: r.mixing.record(r.feed, i.step, i.shared.get("held_out")))
  processor.add("router", lambda i: router_metrics(i.out))
  processor.add("observers", lambda i: observed.records(r.syncer.train, i.out))  # --watch, --sharpness-every, ...
  processor.add("sync", lambda i: r.syncer.metrics(r.state, i.step, i.out, i.last))
  return hooks, processor


def _watchdog(r: Run):
  """The peer watchdog of a multi-process run (a no-op context in a single process)."""
  return r.watchdog if jax.process_count() > 1 else contextlib.nullcontext()


def _switch(r: Run):
  """Moves the live state onto the next --switch-at layout, whose steps are already compiled."""
  assert r.in_mesh is not None  # set by `_train` before its loop runs the hooks
  t = time.perf_counter()
  r.layout = r.switches.pop(0)[1]
  r.syncer.switched(r.layout.train_step)
  r.feed.switched(r.layout.mesh)
  r.state = jax.block_until_ready(reshard(r.state, shardings=r.layout.shardings, donate=True))
  r.in_mesh.close()
  r.in_mesh.enter_context(jax.set_mesh(r.layout.mesh))
  r.meter.compiled(r.step)  # a new program: its first steps are not steady, the switch itself not training
  print(f"step {r.step}: switched to mesh {mesh_spec(r.layout.mesh)} in {time.perf_counter() - t:.2f} s",
        file=sys.stderr)


def _compiled(r: Run, info: StepInfo):
  """The first step compiles (and the first of each observed program): throughput is timed from its end."""
  if info.step == r.start + 1 or observed.compiled(r.syncer.train):  # an observed program's first step compiles too
    jax.block_until_ready(info.out)
    r.meter.compiled(info.step)


def _may_save(r: Run, info: StepInfo) -> bool:
  """Whether this step may save a checkpoint (so the health of every step up to it is read back first)."""
  return info.step % r.checkpoint.ckpt_every == 0 or info.final


def _evaluate(r: Run, info: StepInfo) -> dict:
  """The held-out loss of the model (--sync gossip's: the replicas' mean) on each fixed held-out batch.

  The losses are left for the mixture's per-source record.
  """
  params = r.syncer.model(r.state).params
  losses = [r.layout.eval_step(params, x, y, r.state.model_buffers) for x, y in r.layout.val]
  info.shared["held_out"] = losses
  return {"val_loss": float(np.mean(losses))}


def _checkpoint(r: Run, info: StepInfo):
  """Saves every --ckpt-every steps (not amid bad steps) and at the end or a stop.

  Deciding here, not in orbax, keeps orbax from also saving the first step it sees (a step-1 checkpoint nobody asked
  for).
  """
  if _due(r, info):
    r.state = r.syncer.model(r.state)  # gossip: "params" (what export and sampling read) = the replicas' mean
    r.ckpt.save(info.step, r.state.as_dict(), {**r.meta, "health": r.monitor.state(), "loader": r.feed.state()},
                force=True)


def _due(r: Run, info: StepInfo) -> bool:
  """Whether `_checkpoint` saves after this step."""
  return (r.monitor.bad_run == 0 and info.step % r.checkpoint.ckpt_every == 0) or info.final


def _finish(r: Run, stop: Stop):
  """Raises what ended the run early: too many bad steps (exit 3), or a signal (a checkpoint saved, exit 128 + n)."""
  if r.monitor.failed:
    raise r.monitor.error(r.step, r.ckpt.manager.latest_step())
  if stop.signum is not None:
    saved = ("checkpoint saved" if r.step > r.start else
             "the checkpoint it resumed from is kept" if r.start else "nothing was saved")
    print(f"stopped by signal {stop.signum} at step {r.step}; {saved}, rerun the same command to resume",
          file=sys.stderr)
    raise SystemExit(128 + stop.signum)
