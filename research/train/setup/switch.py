"""--switch-at: the plan of (step, mesh) and, for each, a `Layout` (shardings, batches and steps compiled ahead of time)
the loop moves the live state onto."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from research.train.config import RunError
from research.train.config.observe import ObserveSection
from research.train.config.sections import MeshSection, TrainingSection
from research.train.setup.build import step_options
from research.train.setup.plan import Plan
from research.train.steps import observed
from research.train.steps.step import make_steps
from research.train.steps.train_state import TrainState
from sharding import (
  ShardingError,
  abstract_state,
  batch_sharding,
  devices_for,
  global_batch,
  make_mesh,
  mesh_spec,
  state_shardings,
)


class Layout(NamedTuple):
  """What training on one mesh needs: the mesh, the state's shardings, the batch sharding, the held-out batches
  placed there, and the jitted train and eval steps for those shardings."""
  mesh: jax.sharding.Mesh
  shardings: Any
  batch_sh: jax.sharding.NamedSharding
  val: list
  train_step: Callable
  eval_step: Callable


def switch_plan(mesh: MeshSection, training: TrainingSection) -> list[tuple[int, jax.sharding.Mesh]]:
  """--switch-at (the mesh section's) as (step, mesh) in step order; a mesh spec with fixed sizes takes the first
  devices it needs; `training`: --steps, and the batch each mesh must split."""
  plan = {}
  for item in mesh.switch_at:
    at, sep, spec = item.partition(":")
    if not (sep and at.strip().isdigit()):
      raise RunError(f"--switch-at {item!r} is not STEP:MESH, e.g. --switch-at 100:fsdp=4,tensor=2")
    if not 0 < int(at) < training.steps:
      raise RunError(f"--switch-at {item!r}: STEP must lie in [1, --steps={training.steps})")
    if int(at) in plan:
      raise RunError(f"--switch-at names step {int(at)} twice")
    plan[int(at)] = make_mesh(spec, devices=devices_for(spec))
    try:  # the batch must split over the new mesh's data axes
      batch_sharding(plan[int(at)], (training.batch_size, training.seq_len))
    except ShardingError as e:
      raise ShardingError(f"--switch-at {item!r}: the batch: {e}") from None
  return sorted(plan.items(), key=lambda item: item[0])


def switch_layout(mesh, state, names, graphdef, tx, plan: Plan, training: TrainingSection, observe: ObserveSection,
                  val_host) -> Layout:
  """What training on `mesh` needs, its steps compiled ahead of time (`.lower(...).compile()`).

  Args:
    mesh: the mesh switched to.
    state: the abstract train state.
    names: the state's logical axis names.
    graphdef: the model's structure.
    tx: the optimizer.
    plan: the run's plan (--zero1, the step's options).
    training: the config's training section (the batch's shape).
    observe: its observe section (the observed steps).
    val_host: the held-out batches on the host.

  Returns:
    The `Layout`: mesh, state shardings, batch sharding, held-out batches there, train and eval steps.
  """
  try:
    shardings = TrainState.of(state_shardings(state.as_dict(), names, mesh, zero1=plan.zero1))
  except ShardingError as e:
    raise ShardingError(f"--switch-at to {mesh_spec(mesh)}: {e}") from None
  batch_sh = batch_sharding(mesh, (training.batch_size, training.seq_len))
  jitted_train, jitted_eval = make_steps(graphdef, tx, shardings, batch_sh, **step_options(plan))
  x = jax.ShapeDtypeStruct((training.batch_size, training.seq_len), jnp.int32, sharding=batch_sh)
  t = time.perf_counter()
  with jax.set_mesh(mesh):
    train = jitted_train.lower(abstract_state(state, shardings), x, x).compile()
    evaluate = jitted_eval.lower(abstract_state(state.params, shardings.params), x, x,
                                 abstract_state(state.model_buffers, shardings.model_buffers)).compile()
  print(f"compiled the steps for mesh {mesh_spec(mesh)} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
  val = [global_batch(b, mesh) for b in val_host]
  build = lambda observe, held_sh: make_steps(graphdef, tx, shardings, batch_sh, **step_options(plan),
                                              observe=observe, held_sh=held_sh)[0]
  return Layout(mesh, shardings, batch_sh, val, observed.wrap(observe, train, build, val), evaluate)
