"""The one step contract: every step kind (plain, --freeze/--peft, pipeline, blockwise, --freeze-layers, --sync's
per-replica, gossip and stale programs, and the experiments' `fit`) hands one `StepResult` to `outputs`, the one
function that builds a step's outputs.

A step's outputs are {"loss", "grad_norm", "finite"} (what the loop, the health monitor and the metrics read), the
step kind's own entries (an MoE's router metrics, the attention-logit maxima, the replicas' losses), and, in a
program compiled with observers (research/train/observers/), the observers' numbers.

`StepResult.probe` is what an observer may read beyond the trees: the loss as a function of the trained tree on any
batch, the step's batch, the trained tree's logical axis names. Its trees are over what the step trains: the whole
parameter tree in the plain step, the active layer's float32 master in the blockwise one, layers N.. in
--freeze-layers'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from flax import nnx

from research.train.steps.health import step_ok
from sharding import variable_names


class Probe(NamedTuple):
  """What an observer reads beyond the step's trees.

  Args:
    loss_at: `loss_at(trained, x, y)` -> the loss the step differentiates (cross entropy + weighted MoE aux losses),
      at any value of the trained tree, on any batch (the rest of the model as the step holds it).
    x: the step's inputs.
    y: the step's targets.
    axes: `axes()` -> the trained tree's logical axis names (a tree like it of tuples), read at trace time only when
      an observer asks; None: unknown.
  """
  loss_at: Callable[..., jax.Array]
  x: jax.Array
  y: jax.Array
  axes: Callable[[], Any] | None = None


class StepResult(NamedTuple):
  """What one step computed, before its non-finite guard: the one contract every step kind produces.

  Args:
    params: the trained tree before the update (the tree `grads` and `updates` are over).
    grads: its gradients (unclipped).
    updates: the optimizer's updates (`params + updates` is the tree after the step).
    opt_state: the optimizer's state after the update.
    aux: the forward's aux (per-layer router statistics, attention-logit maxima).
    loss: the batch's cross entropy.
    total: the loss differentiated (cross entropy + weighted MoE aux losses).
    grad_norm: the gradients' global norm (the one logged and clipped by).
    finite: the step's finite flag (`health.step_ok`).
    metrics: the step kind's own outputs (router metrics, replicas' losses, delays).
    probe: what an observer may read beyond the trees (None: the step kind offers no observers).
  """
  params: Any
  grads: Any
  updates: Any
  opt_state: Any
  aux: dict
  loss: jax.Array
  total: jax.Array
  grad_norm: jax.Array
  finite: jax.Array
  metrics: dict
  probe: Probe | None = None


def step_result(params: Any, grads: Any, updates: Any, opt_state: Any, aux: dict, loss: jax.Array,
                total: jax.Array, metrics: dict | None = None, probe: Probe | None = None) -> StepResult:
  """A `StepResult`, its gradient norm and finite flag computed here.

  Args:
    params: the trained tree before the update.
    grads: its gradients (unclipped).
    updates: the optimizer's updates.
    opt_state: the optimizer's state after the update.
    aux: the forward's aux.
    loss: the batch's cross entropy.
    total: the loss differentiated.
    metrics: the step kind's own outputs.
    probe: what observers may read (None: none offered).

  Returns:
    The result, with `grad_norm` = ‖grads‖₂ and `finite` = `health.step_ok(total, grad_norm, updates)`.
  """
  grad_norm = optax.tree.norm(grads)
  return StepResult(params, grads, updates, opt_state, aux, loss, total, grad_norm,
                    step_ok(total, grad_norm, updates), metrics or {}, probe)


Observe = Callable[[StepResult, tuple], dict]  # observe(result, held) -> the observers' outputs, inside the step


def outputs(result: StepResult, observe: Observe | None = None, held: tuple = ()) -> dict:
  """The step's outputs, built in one place for every step kind.

  Args:
    result: the step's `StepResult`.
    observe: the observers due at this step, composed (`research.train.observers.compose`); None: none.
    held: the observers' inputs beyond the step's own (the held batch), as the observed program takes them.

  Returns:
    {"loss", "grad_norm", "finite"}, the step kind's metrics, and the observers' outputs.
  """
  out = {"loss": result.loss, "grad_norm": result.grad_norm, "finite": result.finite, **result.metrics}
  if observe is not None:
    out.update(observe(result, held))
  return out


def param_axes(graphdef: nnx.GraphDef, params: Any, buffers: Any) -> Any:
  """The logical axis names of a model's parameters (a tree like `params` of tuples), read at trace time.

  Args:
    graphdef: the model's structure.
    params: its parameters (concrete, traced or abstract).
    buffers: its buffers.

  Returns:
    The names, as `sharding.logical_names` gives them (read from the variables' metadata, no mesh needed).
  """
  names: dict = {}
  for path, v in nnx.to_flat_state(nnx.state(nnx.merge(graphdef, params, buffers), nnx.Param)):
    node = names
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = variable_names(v)
  return names
