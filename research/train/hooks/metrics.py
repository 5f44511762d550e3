"""The one metrics processor (torchtitan's `MetricsProcessor.log`): a logged step's record is made here from its
sources, in order, and sent everywhere from here: metrics.jsonl, the trackers (TensorBoard, W&B, MLflow), the console.

A source is `fn(info) -> dict` with a cadence of its own within the logged steps (the held-out evaluation's
--eval-every); the throughput source comes before the evaluation, so evaluating is never timed as training. A step is
logged every --log-every and --eval-every steps and at the last.
"""

from __future__ import annotations

from collections.abc import Callable

from research.train.hooks.cadence import Hook, StepInfo
from research.train.store import rundir


class MetricsProcessor:
  """Makes and writes the records of the logged steps.

  Args:
    log_every: --log-every.
    eval_every: --eval-every (its steps are logged too).
    metrics: the run's metrics.jsonl (`rundir.MetricsLog`).
    trackers: called with each record as it is written (`Trackers.log`: views of metrics.jsonl).
    console: called with each record once it is written (`Progress.log`).
    write_error: `(step, OSError) -> Exception` raised when the record cannot be written (a full disk: the run is
      cut back like a failed checkpoint save).
    written: called after each record (the throughput meter restarts: logging is not training time).
    also_every: more cadences whose steps are logged (the observers': their numbers exist at those steps only).
  """

  def __init__(self, log_every: int, eval_every: int, metrics: rundir.MetricsLog, trackers: Callable[[dict], None],
               console: Callable[[dict], None], write_error: Callable[[int, OSError], Exception],
               written: Callable[[], None], also_every: tuple[int, ...] = ()):
    self.log_every, self.eval_every, self.also_every = log_every, eval_every, tuple(also_every)
    self.metrics, self.trackers, self.console = metrics, trackers, console
    self.write_error, self.written = write_error, written
    self.sources: list[Hook] = []
    self.records: list[dict] = []

  def add(self, name: str, fn: Callable[[StepInfo], dict], *, every: int = 1, at_end: bool = False) -> None:
    """Registers a source of the records, after the ones registered before it.

    Args:
      name: what it measures.
      fn: `fn(info)` -> the entries it adds to the record of each logged step it is due at.
      every: its own cadence within the logged steps (the held-out evaluation's --eval-every).
      at_end: also at the schedule's last step.
    """
    self.sources.append(Hook(name, fn, every, at_end))

  def due(self, info: StepInfo) -> bool:
    """Whether `info.step` writes a record: every --log-every and --eval-every steps, an observer's, and the last.

    Args:
      info: the step's `StepInfo`.

    Returns:
      Whether the step is logged.
    """
    return (info.step % self.log_every == 0 or info.last or info.step % self.eval_every == 0
            or any(info.step % n == 0 for n in self.also_every))

  def on_step(self, info: StepInfo) -> None:
    """The hook: the record of a logged step, written and shown."""
    if not self.due(info):
      return
    rec = {"step": info.step}
    for source in self.sources:
      if source.due(info):
        rec.update(source.fn(info))
    self.records.append(rec)
    try:
      self.metrics.write(rec)
      self.trackers(rec)
    except OSError as e:
      if not rundir.refused(e):
        raise
      raise self.write_error(info.step, e) from None
    self.console(rec)
    self.written()
