"""The train step: the loss, its gradients, the optimizer update, the non-finite guard, and the eval step.

The loss is the cross entropy plus the weighted MoE aux losses; both steps are jitted with the state's shardings pinned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import MoEConfig, Transformer, cross_entropy
from models.moe import aux_loss, update_router_bias
from models.moe import summarize as moe_summary
from research.train.runtime.xla import compiler_options
from research.train.steps import update_args as update_args_
from research.train.steps.contract import Observe, Probe, StepResult, outputs, param_axes, step_result
from research.train.steps.health import keep_if_finite
from research.train.steps.train_state import TrainState


def keep_prev_params(state: TrainState, shardings: TrainState) -> tuple[TrainState, TrainState]:
  """The state of a run whose update arguments keep the parameters before the last update, with them.

  Args:
    state: the train state at step 0.
    shardings: its shardings.

  Returns:
    (state, shardings) with `prev_params`: at first a copy of the parameters, sharded like them.
  """
  prev = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(state.params)
  return state.replace(prev_params=prev), shardings.replace(prev_params=shardings.params)


LossOut = tuple[jax.Array, tuple[jax.Array, dict]]  # (cross entropy + weighted MoE aux losses, (cross entropy, aux))


def head_loss(model: Transformer, y: jax.Array) -> Callable[[jax.Array, dict], LossOut]:
  """The loss on top of a forward, `model.forward`'s or a blockwise one's.

  The blockwise forwards are research/train/steps/blockstep.py's, _reachstep.py's and layerfreeze.py's.

  Args:
    model: the model (its config weighs the MoE aux losses).
    y: the batch's targets.

  Returns:
    head(logits, aux) -> (cross entropy + weighted MoE aux losses, (cross entropy, aux)).
  """
  def head(logits, aux):
    ce = cross_entropy(logits, y)
    return ce + aux_loss(aux, model.c), (ce, aux)
  return head


def lm_loss(graphdef: nnx.GraphDef) -> Callable[..., LossOut]:
  """The language-model loss of a model structure, a function of its parameters and buffers.

  Args:
    graphdef: the model's structure, `nnx.split(model, nnx.Param, ...)`'s first part.

  Returns:
    loss_fn(params, x, y, buffers) -> (cross entropy + weighted MoE aux losses, (cross entropy, aux)), aux the
    model's (per-layer router stats, attention-logit maxima).
  """
  def loss_fn(params, x, y, buffers):
    model = nnx.merge(graphdef, params, buffers)
    return head_loss(model, y)(*model.forward(x))
  return loss_fn


def eval_loss(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
  """The loss every held-out evaluation takes: the cross entropy of a model structure.

  Args:
    graphdef: the model's structure, `nnx.split(model, nnx.Param, ...)`'s first part.

  Returns:
    eval_fn(params, x, y, buffers) -> the cross entropy.
  """
  loss_fn = lm_loss(graphdef)
  return lambda params, x, y, buffers: loss_fn(params, x, y, buffers)[1][0]


def value_and_grad_trained(loss_fn: Callable[..., Any], params: Any, frozen: Any, *args: Any) -> tuple[Any, Any]:
  """`jax.value_and_grad(loss_fn, has_aux=True)(params, *args)` taken w.r.t. the leaves not `frozen` only.

  The frozen leaves enter the loss as constants, so XLA computes no gradient (no weight-gradient dot) for them. Their
  entries of the returned gradient tree are zeros of their shape (free: nothing computes them), so the optimizer
  sees the whole tree.

  Args:
    loss_fn: loss_fn(params, *args) -> (loss, aux).
    params: the parameter tree.
    frozen: a tree of Python bools like `params`, True for a frozen leaf (None: nothing frozen).
    *args: the loss's other arguments.

  Returns:
    ((loss, aux), gradients), the gradients a tree like `params`.
  """
  if frozen is None:
    return jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
  leaves, treedef = jax.tree.flatten(params)
  flags = jax.tree.leaves(frozen)

  def loss_of_trained(trained):
    it = iter(trained)
    return loss_fn(jax.tree.unflatten(treedef, [leaf if f else next(it) for leaf, f in zip(leaves, flags)]), *args)

  value, grads = jax.value_and_grad(loss_of_trained, has_aux=True)([x for x, f in zip(leaves, flags) if not f])
  it = iter(grads)
  return value, jax.tree.unflatten(treedef, [jnp.zeros(x.shape, x.dtype) if f else next(it)
                                             for x, f in zip(leaves, flags)])


def make_steps(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, shardings: TrainState,
               batch_sh: jax.sharding.Sharding, *, update_args: Iterable[str] = frozenset(),
               frozen: Callable[[Any], Any] | None = None, observe: Observe | None = None,
               held_sh: Any = ()) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
  """Jitted (train_step, eval_step) with the state's shardings pinned; train_step donates the state.

  A step whose loss, gradient norm or update norm is not finite leaves the state unchanged but for `step`, and reports
  finite=False (`research.train.steps.health`).

  Args:
    graphdef: the model's structure, `nnx.split(model, nnx.Param, ...)`'s first part.
    tx: the optimizer.
    shardings: the state's shardings, a `TrainState` of them (with `prev_params` when an update argument keeps them).
    batch_sh: a batch's sharding.
    update_args: the optimizer's declared `optim.Needs.update_args`, supplied to `tx.update` as their declarations
      say (research/train/steps/update_args.py); one that keeps the previous parameters needs a state with
      `prev_params` (`keep_prev_params`).
    frozen: --freeze's mask, a function of the parameter tree giving a Python bool per leaf (None: all trained); the
      gradient is taken w.r.t. the other leaves only (`value_and_grad_trained`), the frozen ones are neither
      differentiated nor written (the optimizer gives them no state, `research.train.steps.frozen.freeze`), and the
      gradient norm (the one logged, and the one --grad-clip clips by) is the trained parameters'.
    observe: the observers this program runs (`contract.outputs`); None: the plain program, no observer.
    held_sh: the shardings of the observers' extra inputs (the held batch), which the program then takes after y.

  Returns:
    (train_step(state, x, y, *held) -> (state, outputs), eval_step(params, x, y, buffers) -> cross entropy), both
    jitted.

  Raises:
    ValueError: the update arguments keep the previous parameters and the state has none, or the other way round.
  """
  exact = update_args_.keeps_prev_params(update_args)
  if exact != (shardings.prev_params is not None):
    raise ValueError(f"update arguments {sorted(update_args)} and a state {'without' if exact else 'with'} "
                     f"prev_params (keep_prev_params)")
  update = make_update(graphdef, tx, update_args=update_args, frozen=frozen)

  def train_step(state, x, y, *held):
    u = update(state.params, state.model_buffers, state.opt_state, x, y, state.prev_params)
    r = u.result
    new = state.replace(step=state.step + 1, params=u.params, opt_state=r.opt_state,
                        prev_params=state.params if exact else None,
                        buffers=u.buffers if state.buffers is not None else None)
    return keep_if_finite(r.finite, new, state), outputs(r, observe, held)  # a non-finite step changes nothing

  return jit_steps(train_step, eval_loss(graphdef), shardings, batch_sh, held_sh, donate=observe is None)


def aux_outputs(aux: dict, buffers: dict, moe: MoEConfig | None, total: jax.Array, loss: jax.Array,
                keep: Callable[[Any, Any], Any]) -> tuple[dict, dict]:
  """(buffers, metrics): a step's outputs from the model's aux (the plain, blockwise and --freeze-layers steps).

  Args:
    aux: the forward's aux (per-layer router stats, attention-logit maxima).
    buffers: the model's buffers before the step.
    moe: the model's MoE config (its router-bias rate; None: a dense model).
    total: the step's total loss.
    loss: the step's cross entropy.
    keep: `keep(new, old)`, the buffers a non-finite step keeps.

  Returns:
    The buffers after the step (an MoE's with the aux-loss-free router-bias update, DeepSeek-V3's) and the step's
    metrics: an MoE's aux loss and router metrics; with --logit-stats the attention-logit maxima.
  """
  metrics: dict = {}
  if "load" in aux:
    assert moe is not None  # router loads come from an MoE
    if buffers:
      buffers = keep(update_router_bias(buffers, aux, moe.bias_rate), buffers)
    metrics = {"aux_loss": total - loss, **moe_summary(aux)}
  if "max_logit" in aux:  # (L, N): the largest over heads and layers, and each layer's
    metrics["attn/max_logit"] = jnp.max(aux["max_logit"])
    metrics["attn/max_logit_layer"] = jnp.max(aux["max_logit"], axis=-1)
  return buffers, metrics


def jit_steps(train_step: Callable[..., Any], eval_fn: Callable[..., Any], shardings: TrainState,
              batch_sh: jax.sharding.Sharding, held_sh: Any = (),
              donate: bool = True) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
  """(train_step, eval_fn) jitted with the state's shardings pinned; train_step donates the state unless told not to.

  Both are compiled with `xla.compiler_options()` (no float32 copy of a bfloat16 model on the CPU).

  Args:
    train_step: train_step(state, x, y, *held) -> (state, outputs).
    eval_fn: eval_fn(params, x, y, buffers) -> the cross entropy.
    shardings: the state's shardings, a `TrainState` of them.
    batch_sh: a batch's sharding.
    held_sh: the shardings of the observers' extra inputs after y (a program compiled with observers), else ().
    donate: whether train_step donates the state (not an observed program's: research/train/steps/observed.py).

  Returns:
    (train_step, eval_fn), jitted.
  """
  opts = compiler_options()
  train = jax.jit(train_step, in_shardings=(shardings, batch_sh, batch_sh, *held_sh), out_shardings=(shardings, None),
                  donate_argnums=0 if donate else (), compiler_options=opts)
  evaluate = jax.jit(eval_fn, in_shardings=(shardings.params, batch_sh, batch_sh, shardings.model_buffers),
                     compiler_options=opts)
  return train, evaluate


def router_metrics(out: dict) -> dict:
  """The MoE and attention-logit entries of a step's outputs as JSON numbers.

  Args:
    out: a step's outputs, on the device.

  Returns:
    {name: number or list}: "aux_loss", the "moe/" and "attn/" entries (per-expert loads, per-layer maxima as lists).
  """
  got = jax.device_get({k: v for k, v in out.items() if k.startswith(("moe/", "attn/")) or k == "aux_loss"})
  return {k: np.asarray(v).tolist() for k, v in got.items()}


class Update(NamedTuple):
  """One update's results (`make_update`): the trees after it and the step's `contract.StepResult`."""
  params: Any  # after the update (a frozen leaf as it was)
  buffers: Any  # after it (an MoE's router bias moved by the step's loads)
  result: StepResult  # the step contract: params before, grads, updates, optimizer state, aux, losses, finite


def make_update(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, update_args: Iterable[str] = frozenset(),
                frozen: Callable[[Any], Any] | None = None) -> Callable[..., Update]:
  """The one update path: the trainer's plain step (`make_steps`) and the experiments' `fit` both take it.

  The loss and its gradients (`lm_loss`; with `frozen`, only the trained leaves differentiated:
  `value_and_grad_trained`), the optimizer's declared extra arguments (`update_args.supply`), `tx.update`,
  `optax.apply_updates` (a frozen leaf passed through as it is), and for an MoE the aux-loss-free router-bias update
  from the step's loads (`aux_outputs`). The non-finite guard and the step count are the caller's.

  Args:
    graphdef: the model's structure, `nnx.split(model, nnx.Param, ...)`'s first part.
    tx: the optimizer.
    update_args: the extra `tx.update` arguments the optimizer declared (`optim.Needs.update_args`), supplied as
      research/train/steps/update_args.py declares them (one that keeps the previous parameters: the caller passes
      `prev_params`).
    frozen: --freeze's mask, a function of the parameter tree giving a Python bool per leaf (None: all trained).

  Returns:
    update(params, buffers, opt_state, x, y, prev_params=None) -> `Update`. Pure: jit it, or call it inside a jitted
    step.
  """
  update_args = frozenset(update_args)
  loss_fn = lm_loss(graphdef)
  keeps = update_args_.keeps_prev_params(update_args)

  def update(params, buffers, opt_state, x, y, prev_params=None) -> Update:
    if keeps and prev_params is None:
      raise ValueError(f"update arguments {sorted(update_args)} need the previous parameters (a state with "
                       f"prev_params: keep_prev_params)")
    flags = None if frozen is None else frozen(params)
    (total, (ce, aux)), grads = value_and_grad_trained(loss_fn, params, flags, x, y, buffers)
    extra = update_args_.supply(update_args, update_args_.Context(loss_fn, prev_params, x, y, buffers, aux))
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra)
    new = optax.apply_updates(params, updates)
    if flags is not None:  # a frozen leaf is passed through as it is (its zero update is never computed)
      new = jax.tree.map(lambda f, old, n: old if f else n, flags, params, new)
    new_buffers, metrics = aux_outputs(aux, buffers, nnx.merge(graphdef, params, buffers).c.moe, total, ce,
                                       lambda n, o: n)
    probe = Probe(lambda p, px, py: loss_fn(p, px, py, buffers)[0], x, y, lambda: param_axes(graphdef, params, buffers))
    return Update(new, new_buffers, step_result(params, grads, updates, new_opt_state, aux, ce, total, metrics,
                                                probe))

  return update

