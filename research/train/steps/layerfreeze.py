"""--freeze-layers N: the bottom N layers of the stack, and the embedding table below them, stay fixed and cost only
their storage; the layers above, the final norm and an untied head train, with any elementwise or matrix optimizer.

A stacked leaf (`blocks/wq_DQ`, shape (L, D, Q)) has one dtype and one optimizer state, so --freeze's regex cannot
take part of it; the split is made in the state instead, as the blockwise BAdam step makes it (research/train/
blockstep.py):
  "params"     every parameter in --frozen-dtype (bfloat16 when fine-tuning with --init-from, else float32): what
               evaluation, checkpoints and research.export read;
  "master"     the trained part in float32, a tree like the parameters': layers N.. of each stacked leaf and the
               leaves outside the stack (final norm, untied head), less what --freeze's regex also freezes;
  "opt_state"  the optimizer's state over "master" only.
A step (`make_layer_steps`): layers 0..N−1 run from "params" under stop_gradient and layers N.. from "master"
(`models.blockwise.frozen_below_forward`); the gradient is taken w.r.t. "master" alone, so the backward stops at
layer N: no weight gradient and no activation gradient below it. The optimizer updates "master", which is written
back into "params" (cast, in place). A non-finite step changes nothing but "step".

Cost, in units of one layer's forward F (the head aside): L·F + 2(L − N)·F per step against full backprop's 3·L·F —
N = L/2 gives 2/3; with --remat each trained layer is recomputed once more, L·F + 3(L − N)·F against 4·L·F.
Memory: a frozen parameter 2 bytes (bfloat16); a trained one 4 (master) + the optimizer's state + 2 (its stored
copy) + 4 (its gradient, a temporary).

The embedding freezes with the layers: its gradient would need the activation gradient through every frozen layer.
With tied embeddings (the head is the same table) the head freezes too. Refused in one line: N outside 1..L−1, and
what research/train/setup/clashes.py's table says it does not combine with (a block-coordinate optimizer, an
optimizer's update arguments: this step supplies none, --peft, --zero1, --sync, --switch-at, a stage or context mesh
axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.blockwise import frozen_below_forward, upper_layers
from optim.trees import tree_bytes
from research.train.config import RunError
from research.train.steps.contract import Observe, Probe, outputs, step_result
from research.train.steps.frozen import frozen_mask
from research.train.steps.step import aux_outputs, eval_loss, head_loss, jit_steps, param_axes
from research.train.steps.train_state import TrainState
from sharding.state import shardings_like_params


def check(n: int, n_layers: int) -> None:
  """RunError (one line) when --freeze-layers' N does not fit the model; nothing when it is off (what it does not
  combine with is research/train/setup/clashes.py's)."""
  if n and not 0 < n < n_layers:
    raise RunError(f"--freeze-layers {n}: the model has {n_layers} layers; freeze 1..{n_layers - 1} of them (all "
                   f"frozen leaves nothing to train)")


def trained_flags(params: dict, regex: str | None) -> dict:
  """A tree like `params` of Python bools: True where the leaf has a trained part (stacked leaves: layers n..; the
  embedding never; what --freeze's regex matches never)."""
  mask = frozen_mask(regex)
  frozen = mask(params) if mask else jax.tree.map(lambda _: False, params)
  return {k: (jax.tree.map(lambda f: not f, frozen[k]) if k != "embed_VD" else False) for k in params}


def _trained(params: dict, flags: dict, n: int) -> dict:
  """The trained part of `params` in float32: layers n.. of the stacked leaves, the other flagged leaves whole."""
  def part(key, x):
    return (x[n:] if key == "blocks" else x).astype(jnp.float32)
  out = {}
  for k, v in params.items():
    kept = jax.tree.map(lambda f, x, k=k: part(k, x) if f else None, flags[k], v)
    if jax.tree.leaves(kept):
      out[k] = kept
  return out


def _is_none(x) -> bool:
  return x is None


def _merged(params: dict, master: dict, fn) -> dict:
  """`params` with `fn(key, stored, trained)` at every leaf the master has (None at the leaves it does not)."""
  return {k: (jax.tree.map(lambda m, p, k=k: p if m is None else fn(k, p, m), master[k], v, is_leaf=_is_none)
              if k in master else v) for k, v in params.items()}


def _write(params: dict, master: dict, n: int) -> dict:
  """`params` with the master's values written in (cast to the stored dtype; the stack's layers n.. in place)."""
  return _merged(params, master, lambda k, p, m: p.at[n:].set(m.astype(p.dtype)) if k == "blocks" else
                 m.astype(p.dtype))


def _model_inputs(params: dict, master: dict, n: int) -> tuple[dict, dict]:
  """(the parameters the model is built from: the master's leaves outside the stack in place of the stored ones,
  the stack's layers n.. for `frozen_below_forward`: the master's, or the stored ones a regex froze)."""
  built = _merged(params, {k: v for k, v in master.items() if k != "blocks"}, lambda k, p, m: m)
  upper = jax.tree.map(lambda m, p: p[n:] if m is None else m, master["blocks"], params["blocks"], is_leaf=_is_none)
  return built, upper


def init_state(state: TrainState, shardings: TrainState, tx, regex: str | None, n: int, dtype):
  """(state, shardings) of the --freeze-layers step from a plain train state: the parameters in `dtype`, the trained
  part's float32 master, the optimizer's state over it (the plain state's `opt_state` is replaced)."""
  params = state.params
  flags = trained_flags(params, regex)
  if not any(jax.tree.leaves(flags["blocks"])):
    raise RunError(f"--freeze {regex!r} freezes every leaf of the layer stack, so --freeze-layers {n} leaves no layer "
                   f"to train; drop one of them or narrow --freeze")
  mesh = jax.tree.leaves(shardings.params)[0].mesh
  m_sh = {k: jax.tree.map(lambda f, s: s if f else None, flags[k], shardings.params[k]) for k in params}
  m_sh = {k: v for k, v in m_sh.items() if jax.tree.leaves(v)}

  def build(params):
    master = _trained(params, flags, n)
    return jax.tree.map(lambda x: x.astype(dtype), params), master, tx.init(master)

  _, abstract_master, abstract_opt = jax.eval_shape(build, params)
  o_sh = shardings_like_params(abstract_opt, abstract_master, m_sh, mesh)
  stored, master, opt_state = jax.jit(build, out_shardings=(shardings.params, m_sh, o_sh))(params)
  new = state.replace(params=stored, master=master, opt_state=opt_state)
  return new, shardings.replace(master=m_sh, opt_state=o_sh)


def make_layer_steps(graphdef, tx, shardings, batch_sh, n: int, observe: Observe | None = None, held_sh=()):
  """Jitted (train_step, eval_step) of the --freeze-layers state; train_step donates the state. `observe`,
  `held_sh`: a program with observers (`contract.outputs`), over the trained part's master."""

  def model_of(params, buffers):
    return nnx.merge(graphdef, params, buffers) if buffers else nnx.merge(graphdef, params)

  def train_step(state, x, y, *held):
    params, master, buffers = state.params, state.master, state.model_buffers

    def loss_on(m, x, y):
      built, upper = _model_inputs(params, m, n)
      model = model_of(built, buffers)
      return head_loss(model, y)(*frozen_below_forward(model, x, upper_layers(model, n, upper), n))

    (total, (loss, aux)), grads = jax.value_and_grad(lambda m: loss_on(m, x, y), has_aux=True)(master)
    updates, opt_state = tx.update(grads, state.opt_state, master)
    probe = Probe(lambda m, px, py: loss_on(m, px, py)[0], x, y,
                  lambda: {k: v for k, v in param_axes(graphdef, params, buffers).items() if k in master})
    r = step_result(master, grads, updates, opt_state, aux, loss, total, probe=probe)
    ok = r.finite
    keep = lambda new, old: jax.tree.map(lambda a, o: jnp.where(ok, a, o), new, old)
    master = keep(optax.apply_updates(master, updates), master)
    new_buffers, metrics = aux_outputs(aux, buffers, model_of(params, buffers).c.moe, total, loss, keep)
    if "blocks" in buffers:  # the frozen layers' router bias stays too (their routing is part of what is frozen)
      new_buffers = {**new_buffers, "blocks": jax.tree.map(lambda b, old: b.at[:n].set(old[:n]),
                                                           new_buffers["blocks"], buffers["blocks"])}
    new = state.replace(step=state.step + 1, params=_write(params, master, n), master=master,
                        opt_state=keep(opt_state, state.opt_state),
                        buffers=new_buffers if state.buffers is not None else None)

    return new, outputs(r._replace(metrics=metrics), observe, held)

  return jit_steps(train_step, eval_loss(graphdef), shardings, batch_sh, held_sh, donate=observe is None)


def state_bytes(state: TrainState) -> dict[str, int]:
  """Bytes of the --freeze-layers state's parts: the stored parameters, the master, the optimizer's state."""
  return {"params": tree_bytes(state.params), "master": tree_bytes(state.master), "opt": tree_bytes(state.opt_state)}
