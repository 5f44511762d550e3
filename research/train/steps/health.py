"""Bad-step safety: non-finite updates are skipped inside the step, counted, and stop the run when they persist;
loss spikes are flagged.

In the jitted step (`keep_if_finite`), with g the gradients:

  ok = isfinite(loss) & isfinite(||g||_2)
  state' = where(ok, update(state), state)     leaf by leaf, for everything but the step counter

so parameters and optimizer state (moments, counts, schedule position) stay exactly as they were after a bad batch;
the select fuses into the update, and ||g||_2 is computed for the metrics anyway. ||g||_2 is non-finite iff some
gradient element is, or its sum of squares overflows float32 (such a step is skipped too).
The same idea as `optax.apply_if_finite`, moved out of the optimizer so that the loss is checked too and the
optimizer state keeps its structure (checkpoints stay compatible).

On the host (`Monitor`), every step's loss and flag, read one step late (when step t+1 is queued, step t's; at logged
and checkpointed steps all at once), so the device never waits for the host:
  * skipped: the number of non-finite steps so far; `max_bad_steps` in a row set `failed` (the train loop then
    stops without a further checkpoint and raises `BadStepsError`);
  * spike at step t: loss_t > factor * median(last W finite losses before t), once W are known; the losses of a
    spike stay in the window, so a lasting level shift stops being one after ~W/2 steps. The definition (1.5x its
    100-step median) is the one in shared/reference/methods.md §10; PaLM (arXiv 2204.02311 §5.1) documents such
    spikes and recovered by restarting ~100 steps earlier and skipping 200-500 batches.
"""

from __future__ import annotations

import collections
import math
import statistics

import jax
import jax.numpy as jnp
import optax


class BadStepsError(RuntimeError):
  """Too many non-finite steps in a row: the run stopped; its checkpoints hold only finite states."""


def step_ok(loss, grad_norm, updates) -> jax.Array:
  """The step's finite flag: loss, gradient norm and the update all finite (the update too: a NaN learning rate or an
  optimizer that divides by zero spoils finite gradients). `loss` may be per replica (all must be finite)."""
  return jnp.all(jnp.isfinite(loss)) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))


def keep_if_finite(ok, new, old):
  """A step's new state, or the old one where the step was not finite.

  Args:
    ok: the step's finite flag (a scalar bool).
    new: the `TrainState` after the step.
    old: the one before it.

  Returns:
    `new` where `ok` holds, else `old`, for every part but `step` (and the parts `old` has none of).
  """
  def pick(name, value):
    before = getattr(old, name)
    if name == "step" or value is None or before is None:
      return value
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), value, before)
  return new.replace(**{k: pick(k, v) for k, v in vars(new).items()})


class Monitor:
  """Reads each step's (loss, finite) from the device in batches, counts skipped steps and spikes.

  Args:
    max_bad_steps: this many non-finite steps in a row end the run (`failed`); 0 never does.
    spike_factor: a loss above spike_factor x the running median is a spike; 0 turns the detector off.
    spike_window: W, the number of previous finite losses the median is taken over.
  """

  def __init__(self, max_bad_steps: int = 5, spike_factor: float = 1.5, spike_window: int = 100):
    self.max_bad_steps, self.spike_factor = max_bad_steps, spike_factor
    self.window: collections.deque = collections.deque(maxlen=spike_window)
    self.skipped = self.spikes = self.bad_run = 0
    self.bad_from: int | None = None  # first and last step of the current run of non-finite steps
    self.bad_last: int | None = None
    self.flagged: dict[str, list[int]] = {"nonfinite": [], "spike": []}  # steps since the last `take`
    self._pending: list = []

  def push(self, step: int, out: dict):
    """Queues the step's outputs (device scalars; nothing is read yet)."""
    self._pending.append((step, out["loss"], out["finite"]))

  def flush(self, keep: int = 0):
    """Reads and accounts every queued step but the newest `keep`, in one transfer."""
    done, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
    values = jax.device_get([p[1:] for p in done])
    for (step, *_), (loss, finite) in zip(done, values):
      self.update(step, float(loss), bool(finite))

  def update(self, step: int, loss: float, finite: bool):
    """Accounts one step."""
    if not finite:
      self.bad_last = step
      self.skipped += 1
      self.bad_run += 1
      self.bad_from = step if self.bad_run == 1 else self.bad_from
      self.flagged["nonfinite"].append(step)
      return
    self.bad_run, self.bad_from = 0, None
    if (self.spike_factor > 0 and len(self.window) == self.window.maxlen
        and loss > self.spike_factor * statistics.median(self.window)):
      self.spikes += 1
      self.flagged["spike"].append(step)
    self.window.append(loss)

  def take(self) -> dict:
    """The fields for a metrics record: the counts so far, plus `spike: true` and the steps that were skipped
    (`nonfinite_steps`) or spiked (`spike_steps`) since the last record, if any."""
    rec: dict = {"skipped": self.skipped, "spikes": self.spikes}
    if self.flagged["spike"]:
      rec.update(spike=True, spike_steps=self.flagged["spike"])
    if self.flagged["nonfinite"]:
      rec["nonfinite_steps"] = self.flagged["nonfinite"]
    self.flagged = {"nonfinite": [], "spike": []}
    return rec

  @property
  def failed(self) -> bool:
    return self.max_bad_steps > 0 and self.bad_run >= self.max_bad_steps

  def error(self, step: int, last_checkpoint: int | None) -> BadStepsError:
    kept = ("no checkpoint was saved" if last_checkpoint is None
            else f"its last checkpoint (step {last_checkpoint}) is kept")
    return BadStepsError(f"{self.bad_run} non-finite steps in a row (steps {self.bad_from}-{self.bad_last}, none "
                         f"applied; --max-bad-steps {self.max_bad_steps}): stopped at step {step}, {kept}; lower --lr, "
                         f"check the data at those steps, or raise --max-bad-steps")

  def state(self) -> dict:
    """What resuming needs to continue exactly (JSON, saved with each checkpoint)."""
    return {"skipped": self.skipped, "spikes": self.spikes, "bad_run": self.bad_run, "bad_from": self.bad_from,
            "bad_last": self.bad_last, "window": list(self.window), "flagged": self.flagged}

  def load(self, saved: dict | None):
    if not saved:
      return
    self.skipped, self.spikes = saved["skipped"], saved["spikes"]
    self.bad_run, self.bad_from, self.bad_last = saved["bad_run"], saved["bad_from"], saved.get("bad_last")
    self.window.clear()
    self.window.extend(x for x in saved["window"] if math.isfinite(x))
    self.flagged = {k: list(v) for k, v in saved["flagged"].items()}
