"""orbax CheckpointManager around the train state: async saves, keep-last-N, restore onto any mesh.

A checkpoint holds the state (`step`, `params`, `opt_state`) and a JSON `meta` with the run's
shape-determining config, which resume compares before touching any array.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
  """A checkpoint that cannot be used for this run."""


class Checkpointer:
  def __init__(self, directory: str, *, keep: int = 3, every: int = 100):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                             enable_async_checkpointing=True, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
    """Starts an async save if `step` is due (or `force`); returns whether it saved."""
    return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           meta=ocp.args.JsonSave(meta)), force=force)

  def read_meta(self, step: int) -> dict:
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many types for a damaged directory
      raise CheckpointError(f"checkpoint {self.directory}/{step} has unreadable metadata: {e}") from None

  def restore(self, step: int, abstract_state, shardings):
    """The state at `step`, each array created with the given sharding (so any mesh works)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    try:
      return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.directory}/{step} could not be restored: {e}") from None

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
