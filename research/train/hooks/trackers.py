"""Experiment trackers: each metrics record also sent to TensorBoard (the default), Weights & Biases or MLflow.

metrics.jsonl (rundir.MetricsLog) stays the run's record; a tracker is a view of it, to watch a live run and compare
runs. `Trackers.open(tracker, out, steps, meta, start)` starts the ones --tracker names (none given: TensorBoard;
`none`: metrics.jsonl only), `log(record)` sends one record, `close()` ends them. Only process 0 writes; the others get
no trackers. A tracker that fails, at its start or later (a server down), is reported in one line on stderr and dropped;
the run and metrics.jsonl go on. But the run directory's disk refusing TensorBoard's event files (full, read-only:
rundir.refused) is raised: the run stops in one line as when a save fails (research/train/loop.py).

Each tracker gets every number of a record at the record's step, by flat name (nested dicts and lists joined with
"/": moe/load/3; bools, strings, None and step-number lists left out), and the config (config.json) per session.

  tensorboard  event files directly in --out (`tensorboard --logdir runs` lists each run by its directory), written
               synchronously with tensorboardX's EventsWriter and flushed per record. Not SummaryWriter: its writer
               thread dies silently on a write error (a full disk) and its queue then blocks the loop for good. The
               config goes in as text and as hparams (train/*, model_config/*). Each session starts with the purge
               marker SummaryWriter's `purge_step` writes (SessionLog START), at step start + 1 (start would hide the
               checkpoint's own step): `tensorboard --load_fast=false` then hides all an interrupted session logged
               past the checkpoint, as metrics.jsonl drops it; the default fast loader ignores the marker and drops a
               series' later points only where the resumed session logs that series again.
  wandb        wandb.init(dir=--out, project $WANDB_PROJECT or optlab, name = --out's basename, config = config.json),
               offline (<out>/wandb/offline-run-*, `wandb sync` uploads them) unless $WANDB_MODE or $WANDB_API_KEY is
               set. W&B keeps the steps it holds (rewinding a run is a private preview), so a resumed online run sends
               the steps from its starting step on; offline, each session is its own directory of the same run id.
  mlflow       MlflowClient (no global fluent run) on $MLFLOW_TRACKING_URI, else ./mlruns/mlflow.db (SQLite: MLflow 3
               refuses its ./mlruns file store); experiment $MLFLOW_EXPERIMENT_NAME or optlab. The flattened config as
               params (cut to MLflow's length limit), metrics by log_batch. MLflow appends every point it is sent, so
               a resumed run skips the steps the run already holds. Unless set, $MLFLOW_HTTP_REQUEST_MAX_RETRIES is 2
               in this process: a server that went down costs seconds per call before the tracker is dropped, not
               the ~4 minutes of MLflow's default retries.

<out>/trackers.json keeps the W&B and MLflow run ids (and MLflow's store): a resumed run (start > 0) continues the same
tracker runs, a run that starts at step 0 starts new ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time

from research.train.config import RunError, flat_meta
from research.train.hooks._tbimport import tensorboardx
from research.train.runtime.processes import is_primary
from research.train.store import rundir

# tracker -> (the package it needs, how to install it)
PACKAGES = {"tensorboard": ("tensorboardX", "pip install tensorboardX"),
            "wandb": ("wandb", "pip install 'optlab[wandb]'"),
            "mlflow": ("mlflow", "pip install 'optlab[mlflow]'")}
NOT_METRICS = {"step", "spike_steps", "nonfinite_steps"}  # the x axis, and lists of step numbers (counted elsewhere)
HPARAM_SECTIONS = ("train", "model_config")  # the parts of config.json runs are compared by


def requested(tracker: tuple[str, ...]) -> tuple[str, ...]:
  """The trackers a run writes to: --tracker's (each once), TensorBoard when none is given, nothing for `none`."""
  names = tuple(dict.fromkeys(tracker)) or ("tensorboard",)
  return () if names == ("none",) else names


def check(tracker: tuple[str, ...]):
  """Refuses (RunError, one line) `--tracker none` mixed with others, and a tracker whose package is missing."""
  if "none" in tracker and len(set(tracker)) > 1:
    raise RunError("--tracker none means metrics.jsonl only: drop it or the other --tracker flags")
  for name in requested(tracker):
    module, install = PACKAGES[name]
    with contextlib.suppress(ImportError, ValueError):
      if importlib.util.find_spec(module) is not None:
        continue
    default = "" if tracker else " (the default)"
    raise RunError(f"--tracker {name}{default} needs the {module} package: {install}")


def scalars(record: dict) -> dict[str, float]:
  """A metrics record's numbers by flat name ("moe/load/3"); bools, strings, None and NOT_METRICS left out."""
  return dict(_numbers({k: v for k, v in record.items() if k not in NOT_METRICS}))


def _numbers(value, prefix: str = ""):
  if isinstance(value, dict):
    for k, v in value.items():
      yield from _numbers(v, f"{prefix}{k}/")
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      yield from _numbers(v, f"{prefix}{i}/")
  elif isinstance(value, (int, float)) and not isinstance(value, bool):
    yield prefix[:-1], float(value)


def leaves(tree: dict, prefix: str = "") -> dict:
  """A nested config's leaves by flat name ("train/lr"); lists stay whole values."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(leaves(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _text(value) -> str:
  return value if isinstance(value, str) else json.dumps(value)


def _warn(name: str, doing: str, e: Exception):
  lines = str(e).strip().splitlines()
  detail = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
  print(f"warning: --tracker {name} failed to {doing} ({detail}); it is off for the rest of this run, "
        f"metrics.jsonl is unaffected", file=sys.stderr, flush=True)


class _TensorBoard:
  """Event files in --out. Each tracker takes (out, steps, meta, start, stored: its ids from trackers.json, empty for a
  run starting at step 0), has `log(record)`, `close()`, and `stored` (the ids to keep for a resume)."""
  name = "tensorboard"
  in_run_directory = True

  def __init__(self, out: str, steps: int, meta: dict, start: int, stored: dict):
    summary, EventsWriter, Event, SessionLog = tensorboardx()
    self.summary, self.event, self.stored = summary, Event, dict[str, object]()
    # a time-ordered suffix: the name holds whole seconds only, and a second session within the same second would
    # reopen (truncate) the first one's file
    self.writer = EventsWriter(os.path.join(out, "events"), f".{time.time_ns()}")
    self.writer.write_event(Event(wall_time=time.time(), step=start + 1,
                                  session_log=SessionLog(status=SessionLog.START)))
    self._write(start, summary.text("config", "```\n" + json.dumps(meta, indent=2) + "\n```"))
    hparams = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)  # unset (None) left out
               for k, v in leaves({s: meta[s] for s in HPARAM_SECTIONS if s in meta}).items() if v is not None}
    self._write(start, summary.hparams(hparams, {})[1])  # the session's values; TensorBoard derives the rest
    self.writer.flush()

  def _write(self, step: int, summary):
    self.writer.write_event(self.event(wall_time=time.time(), step=step, summary=summary))

  def log(self, record: dict):
    for k, v in scalars(record).items():
      self._write(record["step"], self.summary.scalar(k, v))
    self.writer.flush()  # a live run is watchable

  def close(self):
    self.writer.close()


class _WandB:
  """A W&B run, offline unless the environment configures W&B."""
  name = "wandb"
  in_run_directory = False  # its writes happen in W&B's service process: its errors are not the run's

  def __init__(self, out: str, steps: int, meta: dict, start: int, stored: dict):
    import wandb
    online = bool(os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"))
    self.run = wandb.init(dir=out, id=stored.get("id"), resume="allow", config=meta,
                          name=os.path.basename(os.path.abspath(out)),
                          project=os.environ.get("WANDB_PROJECT") or "optlab", mode=None if online else "offline",
                          reinit="create_new", settings=wandb.Settings(console="off"))
    self.first = self.run.starting_step  # resumed online: the step after the last one W&B holds (0 offline)
    self.stored = {"id": self.run.id}

  def log(self, record: dict):
    if record["step"] >= self.first:  # W&B drops (and warns about) steps below the run's current one
      self.run.log(scalars(record), step=record["step"])

  def close(self):
    self.run.finish()


class _MLflow:
  """An MLflow run, through its own client."""
  name = "mlflow"
  in_run_directory = False  # a server, or ./mlruns

  def __init__(self, out: str, steps: int, meta: dict, start: int, stored: dict):
    from mlflow.tracking import MlflowClient
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    uri = os.environ.get("MLFLOW_TRACKING_URI") or stored.get("tracking_uri") or _local_mlflow_store()
    self.client, self.steps, self.done = MlflowClient(tracking_uri=uri), steps, False
    run_id = self._resumed(stored.get("run_id"))
    self.last = 0  # the last step the run holds: a resumed run skips what MLflow already has
    if run_id is None:
      name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "optlab"
      experiment = self.client.get_experiment_by_name(name)
      experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
      run_id = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(out)),
                                      tags={"optlab.out": os.path.abspath(out)}).info.run_id
    else:
      self.last = max((m.step for m in self.client.get_metric_history(run_id, "loss")), default=0)
    self.run_id, self.stored = run_id, {"run_id": run_id, "tracking_uri": uri}
    self._params(meta)

  def _resumed(self, run_id: str | None) -> str | None:
    """The stored run, marked running again; None if there is none in this store."""
    from mlflow.exceptions import MlflowException
    if not run_id:
      return None
    try:
      self.client.get_run(run_id)
    except MlflowException as e:
      if e.error_code != "RESOURCE_DOES_NOT_EXIST":
        raise
      return None
    self.client.update_run(run_id, status="RUNNING")
    return run_id

  def _params(self, meta: dict):
    """The flattened config as params, values cut to MLflow's limit. Params never change: on a resume only the new
    ones are added (an --amend's changes are in config.json's history)."""
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
    have = self.client.get_run(self.run_id).data.params
    params = [Param(k, _text(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in leaves(meta).items() if k not in have]
    for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
      self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

  def log(self, record: dict):
    from mlflow.entities import Metric
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH
    step = record["step"]
    if step <= self.last:
      return
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
      self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])
    self.done = step == self.steps

  def close(self):
    self.client.set_terminated(self.run_id, "FINISHED" if self.done else "KILLED")  # KILLED: stopped, resumable


def _local_mlflow_store() -> str:
  """./mlruns/mlflow.db as an absolute SQLite URI (trackers.json records it, so a resume finds it from anywhere)."""
  os.makedirs("mlruns", exist_ok=True)
  return "sqlite:///" + os.path.abspath(os.path.join("mlruns", "mlflow.db"))


def _stored(path: str) -> dict:
  """trackers.json's ids; none if it is missing or unreadable (the trackers then start new runs)."""
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, ValueError):
    return {}
  return stored if isinstance(stored, dict) else {}


SINKS: dict[str, type] = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class Trackers:
  """The trackers of one session. A tracker that raises is reported and dropped; `log` raises only the run directory's
  disk refusing TensorBoard's event files (rundir.refused)."""

  def __init__(self, sinks=()):
    self.sinks = list(sinks)

  @classmethod
  def open(cls, tracker: tuple[str, ...], out: str, steps: int, meta: dict, start: int) -> Trackers:
    """Starts --tracker's trackers for a session of the run in `out` (`steps` long) that resumes after step `start`
    (0: a new run); none on processes other than 0. A tracker that fails to start is reported and left out."""
    if not is_primary():
      return cls()
    meta = flat_meta(meta)  # hyperparameters by flag (train/lr), as runs of every config layout name them
    path = os.path.join(out, "trackers.json")
    stored = _stored(path) if start else {}  # a run that starts at step 0 starts new tracker runs
    sinks = []
    for name in requested(tracker):
      try:
        sinks.append(SINKS[name](out, steps, meta, start, stored.get(name, {})))
      except Exception as e:  # a tracker is never worth the run
        _warn(name, "start", e)
    ids = {**stored, **{s.name: s.stored for s in sinks if s.stored}}
    if ids or os.path.exists(path):  # no stale ids left for a later resume
      try:
        rundir.write_json_lines(path, [ids], indent=2)
      except OSError as e:
        print(f"warning: {path} not written ({e}); a resume will start new tracker runs", file=sys.stderr, flush=True)
    return cls(sinks)

  def log(self, record: dict):
    for sink in list(self.sinks):
      try:
        sink.log(record)
      except Exception as e:
        self.sinks.remove(sink)
        if sink.in_run_directory and rundir.refused(e):
          with contextlib.suppress(OSError):  # the run's own error line says why
            sink.close()
          raise
        _warn(sink.name, f"log step {record['step']}", e)

  def close(self):
    for sink in self.sinks:
      try:
        sink.close()
      except Exception as e:
        _warn(sink.name, "close", e)
    self.sinks = []
