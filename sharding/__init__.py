"""Meshes, the logical->mesh rules table, and sharded state creation. Knows nothing of any optimizer."""

from sharding.audit import Audit, AuditError, Collective, analytic_bytes, collectives, matmul_flops
from sharding.mesh import AXES, DATA_AXES, MeshError, devices_for, make_mesh, mesh_spec, parse_mesh_spec
from sharding.reshard import ReshardError, abstract_state, moved_bytes, reshard, state_shardings
from sharding.rules import RULES, ShardingError, constrain, logical_to_spec, named_sharding
from sharding.state import (batch_sharding, init_params, init_train_state, logical_names, param_shardings,
                            shard_batch, shardings_like_params, zero1_shardings, global_batch)

__all__ = ["AXES", "Audit", "AuditError", "Collective", "DATA_AXES", "MeshError", "RULES", "ShardingError",
           "batch_sharding", "constrain", "devices_for",
           "init_params", "init_train_state", "logical_names", "logical_to_spec", "make_mesh", "mesh_spec",
           "named_sharding", "param_shardings", "parse_mesh_spec", "shard_batch", "shardings_like_params",
           "analytic_bytes", "collectives", "matmul_flops",
           "ReshardError", "abstract_state", "moved_bytes", "reshard", "state_shardings"]
__all__ += ["global_batch", "zero1_shardings"]
from sharding.experts import capacity as expert_capacity, dispatch as dispatch_experts  # noqa: E402
from sharding.state import init_buffers  # noqa: E402

__all__ += ["dispatch_experts", "expert_capacity", "init_buffers"]
from sharding.pipeline import PipelineError, bubble_fraction, check_pipeline, pipeline  # noqa: E402

__all__ += ["PipelineError", "bubble_fraction", "check_pipeline", "pipeline"]
