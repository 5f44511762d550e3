"""The update arguments the trainer supplies, each declared once: an optimizer's `optim.Needs.update_args` names
them, and every part of the trainer reads their declarations here instead of testing a name.

An `UpdateArg` says how the step supplies the value (`supply`, traced inside the step from the step's `Context`), what
of the forward it reads (`aux`: a replica step forwards those entries, combined over the replicas by `combine`), what
the model must compute for it (`model`: config fields set), whether the state keeps the parameters before the last
update for it (`prev_params`), whether --grad-clip clips it too (`clip`: each by its own global norm), and the run
features that do not combine with it (`clashes`: research/train/setup/clashes.py's names, each with the reason).

A new update argument is one `register(UpdateArg(...))` call, in its own file or a test
(tests/research/test_optimizer_needs.py registers one), and no edit under research/train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Context(NamedTuple):
  """What a step has when it supplies the update arguments: the loss function, the batch and the forward's aux.

  Args:
    loss_fn: (params, x, y, buffers) -> (total loss, (cross entropy, aux)).
    prev_params: the parameters before the last update (a state that keeps them), else None.
    x: the batch's inputs.
    y: the batch's targets.
    buffers: the model's buffers.
    aux: the forward's aux (a replica step's: the entries its arguments read, combined over the replicas).
  """
  loss_fn: Callable[..., Any]
  prev_params: Any
  x: jax.Array
  y: jax.Array
  buffers: Any
  aux: dict


@dataclasses.dataclass(frozen=True)
class UpdateArg:
  """One extra keyword argument of `tx.update` the trainer supplies (module docstring).

  Args:
    name: the keyword, as an optimizer's `optim.Needs.update_args` names it.
    supply: its value inside the step, from the step's `Context`.
    aux: the forward's aux entries it reads.
    combine: how a replica step combines those entries over the replicas (stacked on axis 0).
    model: model config fields the forward needs set for it ({"logit_stats": True}).
    prev_params: whether the state keeps the parameters before the last update for it.
    clip: whether --grad-clip clips it too, by its own global norm (a gradient).
    clashes: {run feature (research/train/setup/clashes.py): why it does not combine with this argument}.
  """
  name: str
  supply: Callable[[Context], Any]
  aux: tuple[str, ...] = ()
  combine: Callable[..., Any] = jnp.max
  model: dict = dataclasses.field(default_factory=dict)
  prev_params: bool = False
  clip: bool = False
  clashes: dict = dataclasses.field(default_factory=dict)


ARGS: dict[str, UpdateArg] = {}


class UpdateArgError(ValueError):
  """An optimizer declares an update argument no registration supplies."""


def register(arg: UpdateArg) -> UpdateArg:
  """Makes an update argument one the trainer supplies.

  Args:
    arg: its declaration.

  Returns:
    `arg`.
  """
  ARGS[arg.name] = arg
  return arg


def declared(names: Iterable[str]) -> tuple[UpdateArg, ...]:
  """The declarations of an optimizer's update arguments, in registration order.

  Args:
    names: `optim.Needs.update_args`.

  Returns:
    Their `UpdateArg`s.

  Raises:
    UpdateArgError: a name no registration supplies.
  """
  names = set(names)
  unknown = sorted(names - set(ARGS))
  if unknown:
    raise UpdateArgError(f"update argument(s) {', '.join(unknown)} are not ones the trainer supplies "
                         f"(registered: {', '.join(ARGS)})")
  return tuple(a for n, a in ARGS.items() if n in names)


def supply(names: Iterable[str], ctx: Context) -> dict:
  """{name: value} of the declared update arguments, traced in the step.

  Args:
    names: the declared update arguments.
    ctx: the step's `Context`.

  Returns:
    The keyword arguments for `tx.update`.
  """
  return {a.name: a.supply(ctx) for a in declared(names)}


def forwarded(names: Iterable[str], aux: dict) -> dict:
  """The aux entries a replica's forward hands on for the declared arguments (the rest stay in the replica).

  Args:
    names: the declared update arguments.
    aux: one replica's forward aux.

  Returns:
    {entry: value}.
  """
  return {k: aux[k] for a in declared(names) for k in a.aux}


def combined(names: Iterable[str], stacked: dict) -> dict:
  """The forwarded aux entries of every replica (stacked on axis 0), each combined by its argument's `combine`.

  Args:
    names: the declared update arguments.
    stacked: {entry: the replicas' values, stacked}.

  Returns:
    {entry: combined value}.
  """
  return {k: a.combine(stacked[k], axis=0) for a in declared(names) for k in a.aux}


def keeps_prev_params(names: Iterable[str]) -> bool:
  """Whether the declared arguments need the state to keep the parameters before the last update."""
  return any(a.prev_params for a in declared(names))


def model_settings(names: Iterable[str]) -> dict:
  """The model config fields the declared arguments need set."""
  return {k: v for a in declared(names) for k, v in a.model.items()}


def clipped(names: Iterable[str]) -> tuple[str, ...]:
  """The declared arguments --grad-clip clips too."""
  return tuple(a.name for a in declared(names) if a.clip)


def _prev_grads(c: Context):
  return jax.grad(lambda p: c.loss_fn(p, c.x, c.y, c.buffers)[0])(c.prev_params)


# the gradient at the parameters before the last update, on this step's batch (MARS's exact mode): a second backward
# pass and one more copy of the parameters
register(UpdateArg("prev_grads", _prev_grads, prev_params=True, clip=True,
                   clashes={"sync": "keeps a copy of the parameters per data replica",
                            "freeze": "takes no gradient of the frozen leaves"}))
# each attention head's largest logit in this step's forward, stacked like the layers (MuonClip's QK-clip)
register(UpdateArg("max_logits", lambda c: c.aux["max_logit"], aux=("max_logit",), model={"logit_stats": True}))
