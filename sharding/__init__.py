"""Meshes, the logical->mesh rules table, and sharded state creation. Knows nothing of any optimizer."""

from sharding.audit import Audit, AuditError, Collective, analytic_bytes, collectives, matmul_flops
from sharding.experts import capacity as expert_capacity
from sharding.experts import dispatch as dispatch_experts
from sharding.mesh import (
  AXES,
  CONTEXT,
  DATA,
  DATA_AXES,
  EXPERT,
  FSDP,
  STAGE,
  TENSOR,
  MeshError,
  devices_for,
  make_mesh,
  mesh_scope,
  mesh_spec,
  parse_mesh_spec,
)
from sharding.pipeline import PipelineError, bubble_fraction, check_pipeline, pipeline
from sharding.reshard import ReshardError, abstract_state, moved_bytes, reshard, state_shardings
from sharding.rules import RULES, ShardingError, constrain, logical_to_spec, named_sharding
from sharding.state import (
  batch_sharding,
  global_batch,
  init_buffers,
  init_params,
  init_train_state,
  local_batch,
  logical_names,
  param_shardings,
  place_variables,
  process_rows,
  shard_batch,
  shardings_like_params,
  train_state_of,
  variable_names,
  variable_shardings,
  zero1_shardings,
)

__all__ = ["AXES", "CONTEXT", "DATA", "EXPERT", "FSDP", "STAGE", "TENSOR"]
__all__ += ["Audit", "AuditError", "Collective", "DATA_AXES", "MeshError", "PipelineError", "RULES",
           "ReshardError", "ShardingError", "abstract_state", "analytic_bytes", "batch_sharding", "bubble_fraction",
           "check_pipeline", "collectives", "constrain", "devices_for", "dispatch_experts", "expert_capacity",
           "global_batch", "init_buffers", "init_params", "init_train_state", "local_batch", "logical_names",
           "logical_to_spec", "make_mesh", "matmul_flops", "mesh_scope", "mesh_spec", "moved_bytes", "named_sharding",
           "param_shardings", "parse_mesh_spec", "pipeline", "place_variables", "process_rows", "reshard",
           "shard_batch", "shardings_like_params", "state_shardings", "train_state_of", "variable_names",
           "variable_shardings", "zero1_shardings"]
