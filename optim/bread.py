"""BREAD: BAdam whose inactive blocks in reach of the backward pass are also updated, cheaply ("landscape expansion").

Source: Luo, Shen, Peng, Li & Li, "Accelerating Block Coordinate Descent for LLM Finetuning via Landscape Expansion",
NeurIPS 2025 (OpenReview DBybUx7ARy; earlier "... via Landscape Correction", ICLR 2025 submission zs6bRl05g8); the
authors' code is microsoft/BlockOptimizers `block_optim.py` (`BlockOptimizer` with `sgd_mode`, `lora_mode` and a PEFT
LoRA model). The paper's own text was not available here: what is marked "paper" below is its abstract and reviews
(inactive blocks "unfrozen and updated in a cost-efficient manner during the same backpropagation", by low-rank
matrices or by SGD; a rank-1 expansion suffices for Prop. 4.1); "reference" is that code; "ours" is a choice we made.

Algorithm as implemented. Blocks are BAdam's (optim/badam.py), ordered input → output: embedding block, layers
0..L−1 of the stacked leaves, head block (a label_fn's blocks by id, taken to be in depth order). Update t trains the
active block a = block_index(t) exactly as BAdam does, θ_a ← θ_a − η_t·inner(g_a), the inner state restarting at
every switch; it also updates the blocks in reach R(a):
  reach="deeper"  R(a) = {b > a}: the inactive blocks between the active one and the loss, whose gradients the
                  backward pass to block a computes anyway (paper; reference sgd_mode / lora_mode "partial")
  reach="all"     R(a) = {b ≠ a} (reference's "all", its lora_mode default; the backward then reaches everything)
  mode="sgd"      (BREAD-SGD) θ_b ← θ_b − ρ·η_t·g_b, or ρ·η_t·sign(g_b) with sgd_sign, on every leaf of b ∈ R(a):
                  no state, no momentum, no weight decay (reference `sgd_hook`: lr·sgd_lr_scaling, decay left as a
                  TODO there; its class default scaling is 1, its README example 5)
  mode="lowrank"  (BREAD) every matrix W (..., m, n) = (..., fan_in, fan_out) of a block that can be in reach has
                  factors A (..., m, r), B (..., r, n), and the model's weight is W = W_base + s·A B, s = α/r. W is
                  kept merged in the parameters, so the state never holds W_base. For b ∈ R(a), with G = the given
                  gradient at W (the loss sees only W, so this is LoRA's chain rule):
                    g_A = s·G Bᴴ,   g_B = s·Aᴴ G
                    (A', B') = (A, B) − ρ·η_t·inner(g_A, g_B)     (inner's state over all factors: one more instance)
                    ΔW = s·(A'B' − A B) = s·(dA·B + A'·dB)        is W's update (dA = A' − A, dB = B' − B)
                  Vectors (norm scales, biases) of blocks in reach stay fixed, as under LoRA.
Every other leaf gets BAdam's update (exact zeros off the active block and the always-active leaves).

Open choices (paper / reference / ours):
  - which blocks: R(a) above, default "deeper" (paper); depth = plan order (ours for a label_fn). Leaves in no block
    (BAdam's frozen: final norm, untied head, embedding unless included) stay frozen (ours; the reference's SGD hook
    also moves the parameters after the active block that are in no block). Always-active leaves get BAdam's update
    only (ours).
  - the active block's own factors are not trained while it is (its full weight is) (ours; the reference's LoRA of
    the active layer also trains, its names matching the active prefix).
  - low-rank targets: every matrix slice of a block that can be in reach, leading axes batched (experts) (ours; the
    reference adapts PEFT's target modules, the paper "low-rank matrices").
  - init: A ~ U(±1/√fan_in) (PEFT's kaiming-uniform, a = √5), B = 0, so W is unchanged at init (reference, via PEFT);
    the draw is keyed by `seed` and the leaf (ours). Rank 8 (the reference README's r = 8), α = 16, s = 2 (ours:
    models/peft.py's default; the README's example has α = 32).
  - factors' optimizer: the same inner as the active block (AdamW: same betas, eps and decoupled weight decay, which
    decays the factors) (reference: the LoRA parameters join the base optimizer's decayed group); lr ratio ρ
    (`inactive_lr_ratio`, default 1 = reference) (ours, shared with the SGD mode's scaling).
  - reset at a switch: the factors' optimizer state (moments, bias-correction count) restarts with BAdam's
    (reference: the whole base-optimizer state is cleared); the factors themselves persist across switches and are
    never re-initialised (reference: the PEFT adapters live for the whole run).
  - merge: always merged (ours); with W_base frozen this is the reference's unmerged LoRA step for step, and when a
    block becomes active Adam trains W itself with the same G the reference gives W_base.
  - storage: factors only for the blocks that can ever be in reach: under "deeper" all but the first block (layer 0
    of the stack, or the embedding block when included), exactly those in reach while the first block trains;
    under "all" every block, one more than are ever in reach at once (ours).
    Factors and their moments in promote(param dtype, float32) (reference: fp32 copies of trained parameters).
  - η_t: the learning rate (or schedule at BAdam's count, as optax.scale_by_learning_rate would see it) is applied
    inside: the low-rank step is not linear in η (ΔW has an η² term s·dA·dB), so it cannot be scaled afterwards.
State: BAdam's (one block's inner state) plus, in low-rank mode, the factors and their inner state: per matrix
3·r·(m + n) numbers per layer, no full-size array. On a mesh the factors and their moments stay replicated (Auto
axes: pinned, the layout `sharding.shardings_like_params` gives them) or keep their type sharding (Explicit axes).
The input is the full gradient tree, as for every transform here; computing only the gradients in reach (the
paper's compute saving) is the train step's business: research/train/blockstep.py runs both modes that way, update
for update equal to this transform.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optim.badam import BAdamError, BAdamState, Order, _Plan, badam, block_plan, blockwise_needs, switches_before
from optim.hparams import Beta, Choices, Count, NonNegative, NonNegativeInt, Positive
from optim.needs import Inactive, Needs
from optim.registry import decay_mask, register
from optim.trees import path_name

MODES = ("sgd", "lowrank")
REACHES = ("deeper", "all")
PyTree = Any


class BreadError(BAdamError):
  """A BREAD configuration that does not define an algorithm."""


class BreadState(NamedTuple):
  """BREAD's state: BAdam's, and in low-rank mode the factors and their inner state."""

  badam: BAdamState  # count, the active block, the inner state over its view
  factors: Any  # lowrank: {path name: {"a_IR": A, "b_RO": B}} for the matrices of blocks that can be in reach; sgd: ()
  factor_state: Any  # lowrank: the inner state over `factors`, restarted at every switch; sgd: ()


def _in_reach(position, active, reach: str):
  return position > active if reach == "deeper" else position != active


def _reach_masks(plan, active, reach: str) -> dict[int, jax.Array]:
  """Leaf index -> whether it is in reach (stacked leaves: one flag per layer, shaped (L,)); blocked leaves only."""
  masks = {i: _in_reach(plan.layer_offset + jnp.arange(plan.num_layers), active, reach) for i in plan.stacked}
  masks.update({i: _in_reach(b, active, reach) for i, (_, b) in plan.whole.items()})
  return masks


def _first_layer(plan, reach: str) -> int:
  """The first layer that can be in reach: under "deeper", layer 0 never is when it is the first block."""
  return 1 if reach == "deeper" and plan.layer_offset == 0 else 0


def _factored(plan, leaves, reach: str) -> list[int]:
  """Leaves that carry factors: matrices (per layer for stacked leaves) of blocks that can ever be in reach."""
  can = (lambda b: b >= 1) if reach == "deeper" else (lambda b: plan.num_blocks >= 2)
  last_layer = plan.layer_offset + plan.num_layers - 1
  out = [i for i in plan.stacked if np.ndim(leaves[i]) >= 3 and can(last_layer)]
  return sorted(out + [i for i, (_, b) in plan.whole.items() if np.ndim(leaves[i]) >= 2 and can(b)])


def _factor_dtype(x):
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _expand(mask, ndim):
  return jnp.reshape(mask, jnp.shape(mask) + (1,) * (ndim - jnp.ndim(mask)))


def _matmul(x, y):
  return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)


def _ct(x):
  return jnp.conj(jnp.swapaxes(x, -1, -2))


def _keep_layout(new, old):
  """`new` laid out as `old` is.

  On Explicit mesh axes, `old`'s type sharding; on Auto axes replicated, the layout `sharding.shardings_like_params`
  gives the factors and their moments (not parameter-shaped), which XLA would otherwise change into the weight's
  split; with no mesh, as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return new
  if AxisType.Explicit in mesh.axis_types:
    return jax.sharding.reshard(new, jax.typeof(old).sharding.spec)
  return jax.lax.with_sharding_constraint(new, P())


def init_factors(params: PyTree, plan: _Plan, *, reach: str, rank: int, seed: int | jax.Array) -> dict:
  """BREAD's initial factors {path name: {"a_IR": A, "b_RO": B}} for the matrices of blocks that can be in reach.

  Stacked leaves: layers `_first_layer`.. only. A ~ U(±1/√fan_in) keyed by `seed` and the leaf's index in `params`,
  B = 0 (module docstring). The blockwise step (research/train/blockstep.py) starts from the same factors.

  Args:
    params: the parameter tree.
    plan: its block layout (`optim.badam.block_plan`).
    reach: "deeper" or "all" (which blocks can be in reach).
    rank: r, the factors' rank.
    seed: keys A's draw (with the leaf's index).

  Returns:
    {path name: {"a_IR": A (..., fan_in, r), "b_RO": B (..., r, fan_out)}}, in promote(param dtype, float32).
  """
  leaves = plan.treedef.flatten_up_to(params)
  paths = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  out: dict[str, dict[str, jax.Array]] = {}
  lo = _first_layer(plan, reach)
  for i in _factored(plan, leaves, reach):
    *lead, m, n = np.shape(leaves[i])
    if i in plan.stacked:  # layers lo.. only
      lead[0] -= lo
    dtype = _factor_dtype(leaves[i])
    key = jax.random.fold_in(jax.random.key(seed), i)
    bound = 1 / math.sqrt(m)
    a = jax.random.uniform(key, (*lead, m, rank), jnp.finfo(dtype).dtype, -bound, bound).astype(dtype)
    out[paths[i]] = {"a_IR": a, "b_RO": jnp.zeros((*lead, rank, n), dtype)}
  return out


def factor_grads(g: jax.Array, a: jax.Array, b: jax.Array, s: float | jax.Array) -> dict:
  """The factors' gradients from W's, W = W_base + s·A B: {"a_IR": s·G Bᴴ, "b_RO": s·Aᴴ G} (leading axes batched).

  Args:
    g: G, the gradient at W (..., m, n).
    a: A (..., m, r).
    b: B (..., r, n).
    s: the factors' scale α/r.

  Returns:
    {"a_IR": s·G Bᴴ, "b_RO": s·Aᴴ G}.
  """
  return {"a_IR": s * _matmul(g, _ct(b)), "b_RO": s * _matmul(_ct(a), g)}


def factor_delta(da: jax.Array, db: jax.Array, a2: jax.Array, b: jax.Array, s: float | jax.Array) -> jax.Array:
  """W's update from the factors' steps dA, dB (A' = A + dA, B = the old B): s·(A'B' − AB) = s·(dA·B + A'·dB).

  Args:
    da: dA, A's step (..., m, r).
    db: dB, B's step (..., r, n).
    a2: A' = A + dA.
    b: the old B.
    s: the factors' scale α/r.

  Returns:
    s·(dA·B + A'·dB), W's update (..., m, n).
  """
  return s * (_matmul(da, b) + _matmul(a2, db))


def bread(inner: optax.GradientTransformation, learning_rate: optax.ScalarOrSchedule, *, mode: str = "lowrank",
          rank: int = 8, alpha: float | jax.Array = 16.0, inactive_lr_ratio: float | jax.Array = 1.0,
          reach: str = "deeper", sgd_sign: bool = False, blocks: str | Callable = "auto",
          switch_every: int | jax.Array = 50, order: str = "descending", seed: int | jax.Array = 0,
          start_block: int | jax.Array | None = None, include_embedding: bool = False, include_head: bool = False,
          always_active: Sequence[str] | Callable = (), stacked: str | Callable = "blocks"
          ) -> optax.GradientTransformation:
  """BREAD around an elementwise inner optimizer: BAdam on the active block plus steps on the inactive ones in reach.

  The inactive blocks in reach take SGD or low-rank steps (module docstring: equations, sources, every choice).
  Returns parameter updates, the learning rate applied (a low-rank step is not linear in it); do not chain a
  learning-rate scale after it. BAdam's settings are checked by `badam` (`BAdamError`).

  Args:
    inner: as `badam`'s (scale_by_adam + decayed weights, say); in low-rank mode it also drives the factors, whose
      tree is {path name: {"a_IR": A, "b_RO": B}} (name-based masks see "<path>/a_IR").
    learning_rate: η, a number or a schedule of BAdam's update count.
    mode: "sgd" (BREAD-SGD) or "lowrank" (BREAD).
    rank: r of the factors (static: it fixes the state's shapes).
    alpha: α, the factors' scale s = α/r.
    inactive_lr_ratio: ρ, the inactive update's learning rate over η (SGD steps, factor steps); 0 is BAdam.
    reach: "deeper" (blocks after the active one in depth order) or "all" (every other block).
    sgd_sign: SGD mode steps by ρ·η·sign(g) (the reference's sgd_use_sign).
    blocks: as `badam`'s.
    switch_every: as `badam`'s.
    order: as `badam`'s.
    seed: as `badam`'s; it also keys the factors' initial A.
    start_block: as `badam`'s.
    include_embedding: as `badam`'s.
    include_head: as `badam`'s.
    always_active: as `badam`'s.
    stacked: as `badam`'s.

  Returns:
    A transformation with extra-argument support (ignored) whose update is the parameter update, learning rate
    included, with a `BreadState`; init and update raise `BAdamError` where `optim.badam.block_plan` does.

  Raises:
    BreadError: when `mode` or `reach` is unknown, `rank` is not a positive int, or a numeric `inactive_lr_ratio` is
      negative.

  References:
    Luo, Shen, Peng, Li and Li, "Accelerating Block Coordinate Descent for LLM Finetuning via Landscape Expansion",
      NeurIPS 2025 (OpenReview DBybUx7ARy); reference code microsoft/BlockOptimizers `block_optim.py`.
  """
  if mode not in MODES:
    raise BreadError(f"unknown BREAD mode {mode!r}; choose from {', '.join(MODES)}")
  if reach not in REACHES:
    raise BreadError(f"unknown BREAD reach {reach!r}; choose from {', '.join(REACHES)}")
  if not isinstance(rank, int) or rank < 1:
    raise BreadError(f"rank must be a positive integer (static: list it in static_args), got {rank!r}")
  if isinstance(inactive_lr_ratio, (int, float)) and inactive_lr_ratio < 0:
    raise BreadError(f"inactive_lr_ratio must be >= 0, got {inactive_lr_ratio}")
  plan_args = (blocks, stacked, include_embedding, include_head, always_active)
  core = badam(inner, blocks=blocks, switch_every=switch_every, order=order, seed=seed, start_block=start_block,
               include_embedding=include_embedding, include_head=include_head, always_active=always_active,
               stacked=stacked)

  def init(params):
    plan = block_plan(params, *plan_args)
    factors = () if mode == "sgd" else init_factors(params, plan, reach=reach, rank=rank, seed=seed)
    factor_state = () if mode == "sgd" else inner.init(factors)
    return BreadState(core.init(params), factors, factor_state)

  def update(updates, state, params=None, **extra_args):
    del extra_args  # optax's contract: arguments a transform does not use are ignored
    plan = block_plan(updates, *plan_args)
    grads = plan.treedef.flatten_up_to(updates)
    count, active = state.badam.count, state.badam.block
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    step = -lr * inactive_lr_ratio
    u, badam_state = core.update(updates, state.badam, params)
    out = [jnp.asarray(-lr, g.dtype) * x for g, x in zip(grads, plan.treedef.flatten_up_to(u))]
    masks = _reach_masks(plan, active, reach)
    if mode == "sgd":
      for i, mask in masks.items():
        g = jnp.sign(grads[i]) if sgd_sign else grads[i]
        out[i] = out[i] + jnp.where(_expand(mask, g.ndim), jnp.asarray(step, g.dtype) * g, 0)
      return jax.tree_util.tree_unflatten(plan.treedef, out), BreadState(badam_state, (), ())
    paths = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
    index = {paths[i]: i for i in _factored(plan, grads, reach)}
    lo = _first_layer(plan, reach)
    part = lambda i, x: x[lo:] if i in plan.stacked else x  # the layers that have factors
    s = alpha / rank
    fgrads = {}
    for name, f in state.factors.items():
      i = index[name]
      a, b = f["a_IR"], f["b_RO"]
      g, mask = part(i, grads[i]).astype(a.dtype), _expand(part(i, masks[i]), a.ndim)
      fgrads[name] = jax.tree.map(lambda x: jnp.where(mask, x, 0), factor_grads(g, a, b, s))
    fu, factor_state = inner.update(fgrads, state.factor_state, state.factors)
    factors = {}
    for name, f in state.factors.items():
      i = index[name]
      mask = _expand(part(i, masks[i]), f["a_IR"].ndim)
      da, db = (jnp.where(mask, jnp.asarray(step, x.dtype) * fu[name][k], 0) for k, x in f.items())
      a2, b2 = f["a_IR"] + da, f["b_RO"] + db
      factors[name] = {"a_IR": a2, "b_RO": b2}
      dw = factor_delta(da, db, a2, f["b_RO"], s).astype(out[i].dtype)
      out[i] = out[i].at[lo:].add(dw) if i in plan.stacked and lo else out[i] + dw
    switch = switches_before(badam_state.count, switch_every) != switches_before(count, switch_every)
    fresh = inner.init(jax.tree.map(jnp.zeros_like, factors))
    factor_state = jax.tree.map(lambda f, x, old: _keep_layout(jnp.where(switch, f, x), old), fresh, factor_state,
                                state.factor_state)
    factors = jax.tree.map(_keep_layout, factors, state.factors)
    return jax.tree_util.tree_unflatten(plan.treedef, out), BreadState(badam_state, factors, factor_state)

  return optax.GradientTransformationExtraArgs(init, update)


def _needs(hp: dict) -> Needs:
  """`bread_adamw`'s declaration for the trainer: BAdam's blockwise step, the layers above the active one included.

  The layers above the active one are updated in its backward (`optim.needs.Inactive`), when the reach is "deeper"
  (the backward stops at the active layer) and the block layout the default.
  """
  if hp["reach"] != "deeper":
    return Needs(not_blockwise=f"reach={hp['reach']} (the backward then reaches every layer)")
  return blockwise_needs(hp, Inactive(hp["mode"], hp["inactive_lr_ratio"], hp["sgd_sign"], hp["rank"],
                                      hp["alpha"] / hp["rank"]))


@register("bread", needs=_needs)
def bread_adamw(learning_rate: optax.ScalarOrSchedule, *, mode: Annotated[str, Choices(MODES)] = "lowrank",
                rank: Count = 8, alpha: Positive = 16.0, inactive_lr_ratio: NonNegative = 1.0,
                reach: Annotated[str, Choices(REACHES)] = "deeper", sgd_sign: bool = False, b1: Beta = 0.9,
                b2: Beta = 0.95, eps: NonNegative = 1e-8, weight_decay: NonNegative = 0.1, switch_every: Count = 50,
                order: Order = "descending", seed: NonNegativeInt = 0, start_block: NonNegativeInt | None = None,
                include_embedding: bool = False, include_head: bool = False, always_active: Sequence[str] = (),
                mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """BREAD with AdamW inside (`badam_adamw`'s, the learning rate outside its restarts), ρ = inactive_lr_ratio.

    active block a:        θ ← θ − η_t·(m̂/(√v̂ + eps) + weight_decay·θ)      (m̂, v̂ since the last switch)
    blocks b in reach, sgd:     θ_b ← θ_b − ρ·η_t·g_b
    blocks b in reach, lowrank: (A, B) ← (A, B) − ρ·η_t·AdamW(s·G Bᴴ, s·Aᴴ G);  W ← W + s·(A'B' − AB)
    everything else:       θ ← θ

  With inactive_lr_ratio = 0 it is `badam_adamw`. Other arguments: `bread`, `badam_adamw`.

  Args:
    learning_rate: η, a number or a schedule of BAdam's update count.
    mode: "lowrank" (BREAD, default) or "sgd" (BREAD-SGD).
    rank: r of the factors (static; default 8).
    alpha: α, the factors' scale s = α/r (default 16).
    inactive_lr_ratio: ρ, the inactive update's learning rate over η (default 1; 0 is `badam_adamw`).
    reach: "deeper" (default) or "all".
    sgd_sign: SGD mode steps by ρ·η·sign(g) (default False).
    b1: AdamW's β1 (default 0.9).
    b2: AdamW's β2 (default 0.95).
    eps: AdamW's ε (default 1e-8).
    weight_decay: AdamW's decoupled weight decay (default 0.1), also on the factors.
    switch_every: K, updates per block (default 50).
    order: one of `optim.badam.ORDERS` (default "descending").
    seed: the "random" order's stream and the factors' initial draw (default 0).
    start_block: the first (or, fixed, the only) block; None: the order's default.
    include_embedding: put the embedding leaves in a block (default False).
    include_head: put the head leaves in a block (default False).
    always_active: substrings of leaf paths trained at every step.
    mask: where weight decay applies: a bool tree or a function of the params; None: `decay_mask`.

  Returns:
    `bread` over AdamW.

  References:
    Luo, Shen, Peng, Li and Li, "Accelerating Block Coordinate Descent for LLM Finetuning via Landscape Expansion",
      NeurIPS 2025 (OpenReview DBybUx7ARy); reference code microsoft/BlockOptimizers `block_optim.py`.
  """
  inner = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                      optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask))
  return bread(inner, learning_rate, mode=mode, rank=rank, alpha=alpha, inactive_lr_ratio=inactive_lr_ratio,
               reach=reach, sgd_sign=sgd_sign, switch_every=switch_every, order=order, seed=seed,
               start_block=start_block, include_embedding=include_embedding, include_head=include_head,
               always_active=tuple(always_active))
