"""`TrainState`: what a step reads and writes and a checkpoint holds, one typed field per part (nanodo's
`TrainState`, Levanter's `TrainerState`), instead of a dict keyed by strings.

A run has the first three; the others are there only where the run needs them (None elsewhere, which is no leaf of
the pytree, so a state and its shardings, a `TrainState` of `NamedSharding`s, have the same structure). A checkpoint
holds `as_dict()`: the fields present, by name, the layout runs have always been saved in, so checkpoints written
before this class restore into it (`of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax import struct


@struct.dataclass
class TrainState:
  """The train state.

  Args:
    step: updates done (an int32 scalar).
    params: the parameters (a blockwise or --freeze-layers run: every one in the storage dtype).
    opt_state: the optimizer's state (--sync local/gossip: in `replicas` instead).
    buffers: the model's other variables (a router's selection bias, a PEFT run's frozen base), or None.
    prev_params: the parameters before the last update, for an update argument that keeps them.
    master: the trained part in float32 (a blockwise optimizer's active layer, --freeze-layers' upper layers).
    replicas: --sync local / gossip: each data replica's "params" and "opt_state", stacked.
    outer_state: --sync local: the outer optimizer's state.
    history: --sync stale: the last TAU + 1 parameter versions.
    delay_key: --sync stale:TAU:random: the delays' PRNG key.
  """
  step: Any
  params: Any
  opt_state: Any = None
  buffers: Any = None
  prev_params: Any = None
  master: Any = None
  replicas: Any = None
  outer_state: Any = None
  history: Any = None
  delay_key: Any = None

  if TYPE_CHECKING:  # flax.struct.dataclass adds it at runtime, where type checkers do not see it
    def replace(self, **changes: Any) -> TrainState: ...

  @classmethod
  def of(cls, tree: dict) -> TrainState:
    """The typed state of a dict.

    Args:
      tree: a checkpoint's state, or `sharding.init_train_state`'s (or its shardings'): {part: value}.

    Returns:
      The `TrainState` with those parts (an empty "buffers" is none).
    """
    fields = dict(tree)
    if not fields.get("buffers"):
      fields.pop("buffers", None)
    return cls(**fields)

  def as_dict(self) -> dict:
    """{field: value} of the fields present: a checkpoint's layout."""
    return {k: v for k, v in vars(self).items() if v is not None}

  @property
  def model_buffers(self) -> dict:
    """`buffers`, or {} for a model without any (what `nnx.merge` and the losses take)."""
    return self.buffers if self.buffers is not None else {}


def create(model_fn, tx, mesh, zero1: bool = False) -> tuple:
  """(graphdef, state, shardings) of a plain train state created sharded on `mesh` (`sharding.init_train_state`'s,
  typed): the parameters of `model_fn()`, `tx`'s state, the model's buffers if any.

  Args:
    model_fn: builds the model (called inside the placement, never materialised whole on one device).
    tx: the optimizer.
    mesh: the mesh the state is placed on by its logical names.
    zero1: split the optimizer state over `data` too.

  Returns:
    (graphdef, `TrainState`, its shardings as a `TrainState`).
  """
  from sharding import init_train_state
  graphdef, state, shardings = init_train_state(model_fn, tx, mesh, zero1=zero1)
  return graphdef, TrainState.of(state), TrainState.of(shardings)
