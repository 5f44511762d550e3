"""The blockwise step of a block-coordinate optimizer, as BlockOptimizers runs BAdam (Luo, Yu & Li, NeurIPS 2024,
and its reference package): only the active layer has a float32 master copy, Adam moments and a gradient, and backprop
stops at it. It runs an optimizer whose registry entry declares a blockwise plan (`optim.Needs.blockwise`, an
`optim.Blockwise`: the block order and switches, the active block's AdamW, what happens above it).

State (`init_state`): "params", every parameter in the storage dtype (`frozen.frozen_dtype`: bfloat16 when fine-tuning
with --init-from, else float32); "master", the active layer's slice in float32; "opt_state" = {"count", "block",
"inner"}: the update count, the active layer, and AdamW's moments over the master alone. A step (`make_block_steps`):

  g = ∂L/∂master by `models.blockwise` (no other weight gradient, no activation gradient below the layer),
      clipped by its own global norm (the reference clips the parameters that have gradients: this block's);
  master ← master − lr_t · AdamW(g) (moments, bias correction and weight decay over the block; lr_t the schedule at
      the update count), written into "params" (cast to the storage dtype) at the active layer;
  at a switch (the timing and orders of `optim.block_index`): the next layer's slice is read into a fresh
      float32 master and AdamW's state restarts — inside the same compiled program (the layer index is traced).

With storage float32 and --grad-clip 0 this is the optax transform with full backprop, update for update (tested).
Memory: 2 bytes per parameter (bfloat16) + 16 per active-layer parameter (master, m, v, gradient), ≈ 2 + 16/L.
Runs the default block layout (layer blocks; the embedding, head and final norm frozen) on meshes without `stage` or
`context`, with --sync allreduce; other settings use the optax transform over full gradients
(research/train/setup/blockwise.py `eligible`).

A plan with layers updated above the active one (`optim.Inactive`, BREAD's reach "deeper") runs here too: the same
state and active-layer update, the gradient taken by `models.blockwise.backprop_to_layer`, whose layer-by-layer
backward also updates every layer above the active one as it reaches it, in place (research/train/steps/_reachstep.py):
by
-ρ·lr_t·g (or -ρ·lr_t·sign(g)) in the plain-gradient mode, or in the low-rank mode by giving its rank-r factors
(opt_state "factors", layers 1..L−1, drawn as the optax transform draws them) their gradients s·G Bᴴ, s·Aᴴ G and
AdamW step (state "factor_state", restarted at each switch) and moving W by s·(A'B' − AB). With float32 storage and
--grad-clip 0 both are the optax transform over full gradients update for update (tested, dense, MoE and a 3-axis
mesh). The inactive updates take the unclipped gradients (the reference applies them in backward hooks, before
clipping); a layer whose gradient is not finite keeps its weights (and factors). Memory: the blockwise state's +
the factors and their moments, 3·r·(m + n) numbers per matrix per layer. FLOPs per step in units of one layer's
forward F: L·F + 3F·(L − b) (each layer from the active one b up recomputed, then differentiated; the factors'
products are rank-r, negligible); over a block cycle ≈ 2.5·L·F, 0.63x remat'd full backprop (4·L·F), 0.83x full
backprop without remat (3·L·F).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.blockwise import active_layer_forward, layer_weights
from optim import Blockwise, block_index, block_plan, decay_mask, init_factors, switches_before
from optim.trees import tree_bytes
from research.train.steps._reachstep import lowrank_backward, stepped_backward
from research.train.steps.contract import Observe, Probe, outputs, param_axes, step_result
from research.train.steps.step import aux_outputs, eval_loss, head_loss, jit_steps
from research.train.steps.train_state import TrainState
from sharding.state import shardings_like_params


class Parts:
  """The blockwise step's pieces: the optimizer's declared `optim.Blockwise` plan, the schedule, the layer count."""

  def __init__(self, schedule, plan: Blockwise, num_layers: int, grad_clip: float, name: str):
    self.name = name
    # the layers above the active one step in the same backward, by -ratio·lr_t·g (or its sign), or through their
    # rank-r factors (mode "lowrank", scale s = alpha / rank); None: they stay
    self.inactive = plan.inactive
    self.schedule, self.num_layers, self.grad_clip = schedule, num_layers, grad_clip
    self.switch_every, self.order, self.seed, self.start_block = (plan.switch_every, plan.order, plan.seed,
                                                                  plan.start_block)
    self.inner = optax.chain(optax.scale_by_adam(b1=plan.b1, b2=plan.b2, eps=plan.eps),
                             optax.add_decayed_weights(plan.weight_decay, decay_mask))

  def block(self, count):
    return block_index(count, self.num_layers, switch_every=self.switch_every, order=self.order, seed=self.seed,
                       start_block=self.start_block)

  @property
  def lowrank(self) -> bool:
    return self.inactive is not None and self.inactive.mode == "lowrank"

  def switches(self, count):
    """Switches before update `count` (as optim.badam counts them)."""
    return switches_before(count, self.switch_every)


def _plan(params: dict):
  """optim.badam's block layout of the blockwise step's parameters (layer blocks, nothing else:
  `setup.blockwise.eligible`)."""
  return block_plan(params, "auto", "blocks", False, False, ())


def _layer(params: dict, b) -> dict:
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, b, 0, keepdims=False).astype(jnp.float32),
                      params["blocks"])


def _write(params: dict, master: dict, b) -> dict:
  blocks = jax.tree.map(lambda a, m: jax.lax.dynamic_update_index_in_dim(a, m.astype(a.dtype), b, 0),
                        params["blocks"], master)
  return {**params, "blocks": blocks}


def _layer_sharding(sh: NamedSharding) -> NamedSharding:
  return NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))


def init_state(state: TrainState, shardings: TrainState, parts: Parts, dtype) -> tuple[TrainState, TrainState]:
  """(state, shardings) of the blockwise step from a plain train state: the parameters in `dtype`, the first block's
  float32 master, AdamW's state over it (the plain state's `opt_state` is replaced)."""
  m_sh = jax.tree.map(_layer_sharding, shardings.params["blocks"])
  mesh = jax.tree.leaves(shardings.params)[0].mesh
  replicated = NamedSharding(mesh, P())
  b0 = parts.block(jnp.int32(0)).astype(jnp.int32)

  def build(params):
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    master = _layer(params, b0)
    return params, master, parts.inner.init(master)

  _, abstract_master, abstract_inner = jax.eval_shape(build, state.params)
  i_sh = shardings_like_params(abstract_inner, abstract_master, m_sh, mesh)
  params, master, inner = jax.jit(build, out_shardings=(shardings.params, m_sh, i_sh))(state.params)
  opt = {"count": jnp.zeros([], jnp.int32), "block": jnp.asarray(b0, jnp.int32), "inner": inner}
  opt_sh = {"count": replicated, "block": replicated, "inner": i_sh}
  if parts.lowrank:  # BREAD's factors of layers 1.. (optim.bread's, from the same draw) and AdamW's state over them
    assert parts.inactive is not None  # `lowrank` says so
    rank = parts.inactive.rank
    factors = jax.jit(lambda p: init_factors(p, _plan(p), reach="deeper", rank=rank, seed=parts.seed),
                      out_shardings=replicated)(state.params)
    opt["factors"], opt["factor_state"] = factors, jax.jit(parts.inner.init, out_shardings=replicated)(factors)
    opt_sh["factors"], opt_sh["factor_state"] = jax.tree.map(lambda _: replicated, (factors, opt["factor_state"]))
  new = state.replace(params=params, master=master, opt_state=jax.device_put(opt, opt_sh))
  new_sh = shardings.replace(master=m_sh, opt_state=opt_sh)
  return new, new_sh


def make_block_steps(graphdef, parts: Parts, shardings, batch_sh, static_block: int | None = None,
                     observe: Observe | None = None, held_sh=()):
  """Jitted (train_step, eval_step) of the blockwise BAdam state; train_step donates the state. `static_block`: the
  forward split at this block in the program itself (`active_layer_forward(..., static_split=True)`: one program
  per block, for counting one block's FLOPs; the trainer's step reads the block from the state). `observe`,
  `held_sh`: a program with observers (`contract.outputs`), over the active layer's master."""

  def model_of(params, buffers):
    return nnx.merge(graphdef, params, buffers) if buffers else nnx.merge(graphdef, params)

  def train_step(state, x, y, *held):
    params, master, opt = state.params, state.master, state.opt_state
    buffers, b = state.model_buffers, opt["block"]

    def loss_on(m, x, y):
      model = model_of(params, buffers)
      w = layer_weights(model, b)
      nnx.replace_by_pure_dict(w, m)
      logits, aux = (active_layer_forward(model, x, w, b) if static_block is None else
                     active_layer_forward(model, x, w, static_block, static_split=True))
      return head_loss(model, y)(logits, aux)

    lr = parts.schedule(opt["count"])
    factors = opt.get("factors")
    if parts.inactive is None:
      (total, (loss, aux)), grads = jax.value_and_grad(lambda m: loss_on(m, x, y), has_aux=True)(master)
    elif parts.lowrank:
      (total, (loss, aux)), grads, params, factors, fstate = lowrank_backward(
          model_of(params, buffers), params, master, b, x, y, factors, opt["factor_state"], parts.inner,
          -lr * parts.inactive.ratio, parts.inactive.scale)
    else:
      (total, (loss, aux)), grads, params = stepped_backward(model_of(params, buffers), params, master, b, x, y,
                                                            -lr * parts.inactive.ratio, parts.inactive.sign)
    clipped = optax.clip_by_global_norm(parts.grad_clip).update(grads, optax.EmptyState())[0] \
        if parts.grad_clip > 0 else grads
    updates, inner = parts.inner.update(clipped, opt["inner"], master)
    updates = jax.tree.map(lambda u: -lr * u, updates)
    probe = Probe(lambda m, px, py: loss_on(m, px, py)[0], x, y, lambda: _layer_axes(graphdef, params, buffers))
    r = step_result(master, grads, updates, inner, aux, loss, total, probe=probe)
    ok = r.finite
    # a non-finite step changes nothing but "step" (health.keep_if_finite's rule), selected at the active layer's
    # size: a select over the stored stack would need it twice (new and old), a copy of the whole model
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    master = keep(optax.apply_updates(master, updates), master)
    inner = keep(inner, opt["inner"])
    count = jnp.where(ok, opt["count"] + 1, opt["count"])
    params = _write(params, master, b)  # in place; layer b stays master rounded to the store (as it was if not ok)
    switch = parts.switches(count) != parts.switches(opt["count"])
    extra = _factor_state(parts, factors, fstate, opt["factor_state"], ok, switch) if parts.lowrank else {}
    nxt = parts.block(count).astype(jnp.int32)
    fresh = parts.inner.init(jax.tree.map(jnp.zeros_like, master))
    inner = jax.tree.map(lambda f, s: jnp.where(switch, f, s), fresh, inner)
    master = jax.tree.map(lambda nxt_m, m: jnp.where(switch, nxt_m, m), _layer(params, nxt), master)
    new_buffers, metrics = aux_outputs(aux, buffers, model_of(params, buffers).c.moe, total, loss, keep)
    new = state.replace(step=state.step + 1, params=params, master=master,
                        opt_state={"count": count, "block": nxt, "inner": inner, **extra},
                        buffers=new_buffers if state.buffers is not None else None)
    return new, outputs(r._replace(metrics=metrics), observe, held)

  return jit_steps(train_step, eval_loss(graphdef), shardings, batch_sh, held_sh, donate=observe is None)


def _layer_axes(graphdef, params, buffers):
  """The logical axis names of one layer's weights (the master's): the stack's, less its leading `layers`."""
  return jax.tree.map(lambda n: n[1:], param_axes(graphdef, params, buffers)["blocks"],
                      is_leaf=lambda n: isinstance(n, tuple))


def _factor_state(parts: Parts, factors, new, old, ok, switch) -> dict:
  """BREAD low-rank's factors and their AdamW state after a step: the state's count kept by a non-finite step (the
  pass already kept each layer's moments), restarted with the active layer's at a switch (the factors persist)."""
  new = jax.tree.map(lambda n, o: n if n.ndim else jnp.where(ok, n, o), new, old)
  fresh = parts.inner.init(jax.tree.map(jnp.zeros_like, factors))
  return {"factors": factors, "factor_state": jax.tree.map(lambda f, x: jnp.where(switch, f, x), fresh, new)}


def state_bytes(state: TrainState) -> dict[str, int]:
  """Bytes of the blockwise state's parts: the stored parameters, the master, AdamW's state."""
  opt = state.opt_state
  return {"params": tree_bytes(state.params), "master": tree_bytes(state.master),
          "adam": tree_bytes(opt["inner"]), "factors": tree_bytes((opt.get("factors"), opt.get("factor_state")))}
