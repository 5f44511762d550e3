"""Pipeline parallelism over the `stage` mesh axis: a GPipe schedule of microbatches through stacked layers.

Shapes: S stages, M microbatches, L layers, Q = L/S layers per stage, B batch rows, b = B/M rows per microbatch.

Design (MaxText's pipeline, shared/reference/parallelism.md §1.4): the L layers stacked on a leading axis are cut
into S stages of Q consecutive layers, `w_L... -> w_SQ...`, whose S axis is sharded over `stage` (the rules map the
logical `layers` axis to `stage`). A loop state `x_Sb...` holds one microbatch per stage. Each iteration runs every
stage on its own slot (`run_stages`: a shard_map manual over `stage` only, so data / fsdp / tensor stay with GSPMD
inside it), then moves every slot one stage on (`shift_stages`: a `ppermute`, the only collective the pipeline
writes). Stage 0 takes microbatch t at iteration t and stage S-1 finishes microbatch m at iteration m + S - 1, so a
batch takes M + S - 1 iterations, of which each stage idles S - 1: the GPipe bubble (S-1)/(M+S-1) (Huang et al.
2019, arXiv 1811.06965). The backward pass is autodiff of this schedule: all forwards, then all backwards.

The time loop is unrolled in Python: XLA:CPU can deadlock on collectives inside while loops, and M + S - 1 is small.
A microbatch takes every M-th row (rows m, m+M, m+2M, ...), so each microbatch stays split over the data axes like
the batch itself and no row changes device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding.mesh import DATA_AXES, STAGE
from sharding.rules import constrain

AXIS = STAGE
PyTree = Any


class PipelineError(ValueError):
  """A pipeline that cannot be laid out as asked."""


def bubble_fraction(stages: int, microbatches: int) -> float:
  """Idle fraction of each stage under GPipe: (S - 1) / (M + S - 1); 0 for a single stage.

  Args:
    stages: S, pipeline stages.
    microbatches: M, microbatches per batch.

  Returns:
    The fraction of the M + S - 1 iterations in which a stage idles.

  Raises:
    PipelineError: when `stages` or `microbatches` is below 1.

  References:
    Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019, arXiv
      1811.06965.
  """
  if stages < 1 or microbatches < 1:
    raise PipelineError(f"stages ({stages}) and microbatches ({microbatches}) must be positive")
  return (stages - 1) / (microbatches + stages - 1)


def mesh_stages() -> int:
  """Size of the `stage` axis of the current mesh (`jax.set_mesh`).

  Returns:
    The axis size; 1 outside a mesh or on a mesh without the axis.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get(AXIS, 1)


def _data_parallel() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else math.prod(mesh.shape.get(a, 1) for a in DATA_AXES)


def check_pipeline(n_layers: int, batch: int, stages: int, microbatches: int, data_parallel: int = 1) -> None:
  """Check that a layer stack and a batch can run as a pipeline whose microbatches split over the data axes.

  Args:
    n_layers: L, layers in the stack.
    batch: B, rows per batch.
    stages: S, pipeline stages.
    microbatches: M, microbatches per batch.
    data_parallel: devices a microbatch's rows split over (the data axes DATA_AXES); default 1.

  Raises:
    PipelineError: naming the fix, when S or M is below 1, S does not divide L, M does not divide B, or
      `data_parallel` does not divide B/M.
  """
  if stages < 1 or microbatches < 1:
    raise PipelineError(f"pipeline stages ({stages}) and microbatches ({microbatches}) must be positive")
  if n_layers % stages:
    raise PipelineError(f"n_layers={n_layers} does not split into stage={stages} pipeline stages; "
                        f"use a multiple of {stages} layers or a stage size that divides {n_layers}")
  if batch % microbatches:
    raise PipelineError(f"a batch of {batch} rows does not split into {microbatches} microbatches; "
                        f"make the batch a multiple of {microbatches} or pick microbatches dividing {batch}")
  if (batch // microbatches) % data_parallel:
    raise PipelineError(f"a microbatch of {batch // microbatches} rows (batch {batch} / {microbatches} microbatches) "
                        f"does not split over the {data_parallel} devices of the data axes {DATA_AXES}; "
                        f"use fewer microbatches or a batch that is a multiple of {microbatches * data_parallel}")


def shift_stages(x_S: PyTree) -> PyTree:
  """Move every stage's slot one stage on, as a ring: out[s] = x[s - 1], out[0] = x[S - 1].

  On a mesh with a `stage` axis this is one collective-permute per leaf: a shard_map that is manual over `stage`
  only (data / fsdp / tensor stay with GSPMD) around `jax.lax.ppermute`. Elsewhere it is `jnp.roll(x, 1, axis=0)`,
  which it equals.

  Args:
    x_S: the loop state, every leaf leading with S (split over `stage`).

  Returns:
    The state with every leaf rolled one stage on.
  """
  S = mesh_stages()
  if S == 1:
    return jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), x_S)
  perm = [(i, (i + 1) % S) for i in range(S)]
  ring = jax.shard_map(lambda a: jax.lax.ppermute(a, AXIS, perm), in_specs=P(AXIS), out_specs=P(AXIS),
                       axis_names={AXIS})
  return jax.tree.map(ring, x_S)


def run_stages(stage_fn: Callable[[PyTree, jax.Array], tuple[jax.Array, PyTree]], w_S: PyTree, x_S: jax.Array
               ) -> tuple[jax.Array, PyTree]:
  """Every stage at once on its own slot: out[s] = stage_fn(w[s], x[s]), outputs stacked on a leading S axis.

  On a mesh with a `stage` axis: a shard_map manual over `stage` only, so each stage's devices run `stage_fn` on
  their own weights and slot, while data / fsdp / tensor (and shard_maps inside `stage_fn`, such as the expert
  dispatch, which then see `stage` as manual) stay as they are. Elsewhere `jax.vmap(stage_fn)`, which it equals.
  (MaxText uses `jax.vmap(..., spmd_axis_name="stage")`; vmap cannot batch a shard_map over the other axes inside
  `stage_fn` that way, so the stage axis is made manual instead.)

  Args:
    stage_fn: `(stage_weights, x) -> (y, aux)` for one stage, as `pipeline` takes.
    w_S: the stages' weights, every leaf leading with S.
    x_S: one slot per stage (S, ...).

  Returns:
    (y_S, aux_S): every stage's output and aux, stacked on a leading S axis.
  """
  if mesh_stages() == 1:
    return jax.vmap(stage_fn)(w_S, x_S)

  def local(w_1, x_1):  # one stage: leading axes of size 1
    y, aux = stage_fn(jax.tree.map(lambda a: a[0], w_1), x_1[0])
    return y[None], jax.tree.map(lambda a: a[None], aux)

  # check_vma=False: with it on, jax 0.10.2 gives the backward of a shard_map nested inside (the expert dispatch)
  # residuals that name `stage`, which its lowering rejects ("already bound by a parent manual_computation"). Every
  # input and output here is split over `stage`, so there is no replication for the check to track.
  return jax.shard_map(local, in_specs=P(AXIS), out_specs=P(AXIS), axis_names={AXIS}, check_vma=False)(w_S, x_S)


def pipeline(stage_fn: Callable[[PyTree, jax.Array], tuple[jax.Array, PyTree]], layers: PyTree, x: jax.Array, *,
             microbatches: int, stages: int | None = None, names: Sequence[str | None] | None = None
             ) -> tuple[jax.Array, PyTree]:
  """Run L stacked layers over `x` as a GPipe pipeline of S stages; equals `stage_fn(layers, x)` on one device.

  Args:
    stage_fn: `(stage_layers, x_b...) -> (x_b..., aux)`, applies Q consecutive layers (leaves of `stage_layers`
      lead with Q) to one microbatch and returns the aux leaves stacked over those Q layers (e.g. `lax.scan`).
      It must be finite on inputs derived from zeros: the bubble slots compute on them, then are discarded.
    layers: the layer stack, every leaf leading with L (sharded over `stage` by the `layers` rule).
    x: activations (B, ...), B split over the data axes.
    microbatches: M; it must divide B, and B/M the data-parallel device count.
    stages: S; default the mesh's `stage` size. Without a stage axis (one device) the same schedule runs with
      `jnp.roll` as the shift, which is how tests compare it with the sharded version.
    names: logical axis names of x for the loop state's sharding constraints (default ("batch", None, ...)).

  Returns:
    (y, aux): y shaped like x; aux leaves stacked (L, ...), each layer's aux averaged over the M microbatches (an
    entry named max_*, the attention's max_logit, is the maximum over them). That
    is the sequential aux exactly when every entry is a mean over tokens (loads, mean router probabilities, z-loss);
    a product of batch means (a Switch loss f·P computed inside the layer) would become the mean of its
    per-microbatch values (gradient accumulation semantics, as in Megatron and MaxText), so form such products
    from the returned means.

  Raises:
    PipelineError: when `stages` differs from the mesh's stage axis, the layer stack's leaves lead with different
      layer counts, or (`check_pipeline`) the layers or the batch do not split as asked.

  References:
    Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019, arXiv
      1811.06965 (the schedule and its bubble).
    MaxText's pipeline (AI-Hypercomputer/maxtext, layers/pipeline.py): stage-stacked weights and a `ppermute` shift.
  """
  S = stages or mesh_stages()
  if mesh_stages() not in (1, S):
    raise PipelineError(f"stages={S} but the mesh's stage axis has {mesh_stages()} devices; leave stages=None")
  L = {a.shape[0] for a in jax.tree.leaves(layers)}
  if len(L) != 1:
    raise PipelineError(f"every leaf of the layer stack must lead with the same layer count, got {sorted(L)}")
  L, M, B = L.pop(), microbatches, x.shape[0]
  check_pipeline(L, B, S, M, _data_parallel())
  Q, b = L // S, B // M
  names = tuple(names) if names is not None else ("batch",) + (None,) * (x.ndim - 1)

  w_SQ = jax.tree.map(lambda a: a.reshape(S, Q, *a.shape[1:]), layers)  # stage s: layers sQ .. sQ+Q-1
  x_Mb = constrain(x.reshape(b, M, *x.shape[1:]).swapaxes(0, 1), (None,) + names)  # microbatch m: rows m::M
  in_stage0 = (np.arange(S) == 0).reshape((S,) + (1,) * x.ndim)
  on_stage = lambda a: constrain(a, ("act_stage",) + names)

  state_Sb = on_stage(jnp.zeros((S, b) + x.shape[1:], x.dtype))
  outs, aux_SQ = [], None
  for t in range(M + S - 1):
    # stage 0 takes microbatch t; once they are all in, zeros (its slot is a bubble from then on)
    feed = x_Mb[t] if t < M else jnp.zeros_like(x_Mb[0])
    state_Sb = on_stage(jnp.where(in_stage0, feed[None], state_Sb))
    y_Sb, aux = run_stages(stage_fn, w_SQ, state_Sb)
    y_Sb = on_stage(y_Sb)
    mb_S = t - np.arange(S)  # the microbatch each stage holds; outside [0, M) a bubble
    live_S = (mb_S >= 0) & (mb_S < M)
    live = lambda a: live_S.reshape((S,) + (1,) * (a.ndim - 1))
    aux = jax.tree_util.tree_map_with_path(lambda p, a: jnp.where(live(a), a, _empty(p, a)), aux)
    aux_SQ = aux if aux_SQ is None else jax.tree_util.tree_map_with_path(_combine, aux_SQ, aux)
    if t >= S - 1:
      outs.append(y_Sb)  # stage S-1 has just finished microbatch t - S + 1
    if t < M + S - 2:
      state_Sb = shift_stages(y_Sb)
  # one gather from the last stage for the whole batch, rather than one per iteration
  y_Mb = constrain(jnp.stack(outs)[:, S - 1], (None,) + names)
  y = y_Mb.swapaxes(0, 1).reshape(x.shape)
  aux_L = jax.tree_util.tree_map_with_path(lambda p, a: (a if _is_max(p) else a / M).reshape(L, *a.shape[2:]),
                                           aux_SQ)
  return constrain(y, names), aux_L


def _is_max(path) -> bool:
  """An aux entry named max_* (the attention's max_logit) is a maximum over microbatches, not a mean."""
  return str(getattr(path[-1], "key", "")).startswith("max_")


def _empty(path, a):
  return jnp.full_like(a, -jnp.inf) if _is_max(path) else jnp.zeros_like(a)


def _combine(path, total, a):
  return jnp.maximum(total, a) if _is_max(path) else total + a
