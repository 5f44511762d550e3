"""PAD-Net's mode partition at step 0 of a new run (--moe.pad with --moe.pad-ratio < 1).

Iterative Mode Partition (`models.padnet.iterative_partition`) ranks every expert entry of the state's PAD-Net masks
(`models.padnet.PadMask` buffers) by |∂L/∂M| of the training loss (the step's, `lm_loss`: cross entropy plus the MoE
aux losses), summed over the first --moe.pad-batches training batches, before the first update: the paper partitions
once, at the start of fine-tuning. The masks are buffers of the train state, so every checkpoint holds them; a resumed
run restores them and never partitions again. The scoring is bounded (--moe.pad-batches at most the run's --steps,
research/train/setup/checks.py) and shows a progress bar on stderr once it takes longer than `PROGRESS_AFTER_S`.
The partition's report (settings, the share after each round, the dynamic entries kept) goes to config.json as
"pad_net".
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import padnet
from research.train.config import RunError
from research.train.runtime.processes import is_primary
from research.train.steps.step import lm_loss
from research.train.steps.train_state import TrainState
from sharding import global_batch, mesh_scope

PROGRESS_AFTER_S = 2.0  # the step-0 scoring shows a progress bar once it has taken this long (a small model's: never)


def partition(how: dict, loader, graphdef: nnx.GraphDef, state: TrainState, mesh) -> tuple[TrainState, dict, str]:
  """IMP of the state's PAD-Net masks as --moe.* asks.

  Args:
    how: the moe section's partition settings (`MoEFlags.partition()`, not None: --moe.pad-ratio < 1).
    loader: the run's training batches (the scoring batches are its first ones).
    graphdef: the model's structure.
    state: the new run's train state at step 0.
    mesh: the run's mesh.

  Returns:
    (the state with the partitioned masks, placed as the old ones were; the report config.json keeps under
    "pad_net"; the one line to print).

  Raises:
    RunError: the state has no PAD-Net mask among its buffers.
  """
  batches = [global_batch(tuple(loader.batch(i))[:2], mesh) for i in range(how["batches"])]  # (x, y)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state.model_buffers)
  at = _mask_leaves(graphdef, state, [tuple(k.key for k in path) for path, _ in leaves])
  buffers = [leaf for _, leaf in leaves]
  loss = lm_loss(graphdef)

  def mask_loss(masks_f, params, rest, x, y):
    values = list(rest)
    for i, m in zip(at, masks_f):
      values[i] = m
    return loss(params, x, y, jax.tree.unflatten(treedef, values))[0]

  mask_grad = jax.jit(jax.grad(mask_loss), out_shardings=NamedSharding(mesh, P()))  # replicated: every process ranks

  bar = tqdm.tqdm(total=how["rounds"] * len(batches), desc="PAD-Net partition (batches scored)",
                  delay=PROGRESS_AFTER_S, file=sys.stderr, disable=not is_primary(), leave=False)

  def grad_sum(masks_f):
    grads = []
    with mesh_scope(mesh):
      for x, y in batches:
        grads.append(jax.block_until_ready(mask_grad([jnp.asarray(m) for m in masks_f], state.params, buffers, x, y)))
        bar.update()
    return [_host(sum(g[j] for g in grads)) for j in range(len(at))]

  with bar:
    new, shares = padnet.iterative_partition([_host(buffers[i]) for i in at], grad_sum, how["ratio"],
                                             rounds=how["rounds"], schedule=how["schedule"], scope=how["scope"])
  for i, m in zip(at, new):  # each process holds the same masks: placed on its devices' shards
    buffers[i] = jax.make_array_from_callback(m.shape, buffers[i].sharding, m.__getitem__)
  kept, total = int(sum(m.sum() for m in new)), int(sum(m.size for m in new))
  report = {**how, "shares": shares, "dynamic": kept, "entries": total}
  line = (f"PAD-Net: Iterative Mode Partition at step 0 on {how['batches']} training batches, {how['rounds']} rounds "
          f"({how['schedule']}, {how['scope']}) to the dynamic ratio {how['ratio']:g}: {kept:,} of {total:,} expert "
          f"entries kept dynamic ({kept / total:.1%})")
  return state.replace(buffers=jax.tree.unflatten(treedef, buffers)), report, line


def _mask_leaves(graphdef: nnx.GraphDef, state: TrainState, keys: list[tuple]) -> list[int]:
  """The positions among the buffers' leaves (their key paths `keys`) of the model's PAD-Net masks, in their order."""
  model = nnx.merge(graphdef, state.params, state.model_buffers)
  paths = [tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, padnet.PadMask))]
  if not paths or any(p not in keys for p in paths):
    raise RunError("--moe.pad-ratio: the model's PAD-Net masks are not among the train state's buffers (a model built "
                   "with --moe.pad has them)")
  return [keys.index(p) for p in paths]


def _host(a) -> np.ndarray:
  """A replicated array's value on this host (one shard is the whole array, also where others are on other hosts)."""
  return np.asarray(a.addressable_data(0) if isinstance(a, jax.Array) else a)
