"""Multi-process runs: when to start `jax.distributed` (global batches: `sharding.global_batch`).

Every process (one per host, or one per GPU) runs the same command; together they see one global mesh over all
their devices, and each feeds and checkpoints only the shards on its own devices. JAX must hear of the other
processes before its backend starts, so `initialize` is the first thing a run does.

When (`mode="auto"`) it calls `jax.distributed.initialize`:
  * a coordinator is named: `coordinator="HOST:PORT"` (`--coordinator`) or $JAX_COORDINATOR_ADDRESS, with the
    process count and this process's id from the arguments or $JAX_NUM_PROCESSES / $JAX_PROCESS_ID;
  * a multi-task launcher that JAX detects by itself is present: SLURM (`srun`, SLURM_NTASKS > 1) or Open MPI
    (`mpirun`, OMPI_COMM_WORLD_SIZE > 1).
`mode="on"` always calls it, leaving the rest to JAX's cluster detection (Cloud TPU pods and Kubernetes, which JAX
finds by asking the platform); `mode="off"` never does.

CPU processes exchange collectives over gloo (TCP), JAX 0.10's default `jax_cpu_collectives_implementation`, so
nothing needs setting; "mpi" there switches to MPI. Sources: jax `_src/distributed.py`, `_src/clusters/`,
`_src/xla_bridge.py` (make_cpu_client), docs/multi_process.md.
"""

from __future__ import annotations

import os
from typing import Literal

import jax
import numpy as np


class DistributedError(ValueError):
  """A multi-process setting that cannot work."""


# JAX's own launcher detection (jax/_src/clusters): the variable that gives the task count.
_LAUNCHERS = {"SLURM": "SLURM_NTASKS", "Open MPI": "OMPI_COMM_WORLD_SIZE"}


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or not value.strip():
    return None
  try:
    return int(value)
  except ValueError:
    raise DistributedError(f"${name}={value!r} is not an integer") from None


def launcher() -> str | None:
  """The multi-task launcher this process runs under (SLURM, Open MPI) when it started more than one task."""
  if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ and (_env_int("SLURM_NTASKS") or 1) > 1:
    return "SLURM"
  if "OMPI_COMM_WORLD_RANK" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "Open MPI"
  return None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               mode: Literal["auto", "on", "off"] = "auto", heartbeat_timeout: float = 100) -> bool:
  """Starts `jax.distributed` when the arguments or the environment ask for several processes.

  Args:
    coordinator: "HOST:PORT" that process 0 listens on and the others reach; default $JAX_COORDINATOR_ADDRESS.
    num_processes: processes in the run; default $JAX_NUM_PROCESSES (or the launcher's count).
    process_id: this process's index in [0, num_processes); default $JAX_PROCESS_ID (or the launcher's rank).
    mode: "auto" (see the module docstring), "on" (always, with JAX's cluster detection), "off" (never).
    heartbeat_timeout: seconds after which JAX's coordination service declares a silent process dead and aborts
      the others (JAX's default: 100).

  Returns:
    Whether this process is part of a multi-process run (also when an earlier call started it).
  """
  if jax.distributed.is_initialized():
    return True
  if mode == "off":
    return False
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
  found = launcher()
  if mode == "auto" and coordinator is None:
    if num_processes is not None or process_id is not None:
      raise DistributedError("--num-processes/--process-id (or $JAX_NUM_PROCESSES/$JAX_PROCESS_ID) need "
                             "--coordinator HOST:PORT (or $JAX_COORDINATOR_ADDRESS): the address of process 0")
    if found is None:
      return False
  if coordinator is not None:
    host, sep, port = coordinator.rpartition(":")
    if not (sep and host and port.isdigit()):
      raise DistributedError(f"--coordinator {coordinator!r} is not HOST:PORT, e.g. --coordinator 10.0.0.1:1234")
    if found is None and (num_processes is None or process_id is None):
      raise DistributedError(f"--coordinator {coordinator} needs --num-processes and --process-id (or "
                             "$JAX_NUM_PROCESSES and $JAX_PROCESS_ID)")
  if num_processes is not None and num_processes < 1:
    raise DistributedError(f"--num-processes must be positive, got {num_processes}")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise DistributedError(f"--process-id {process_id} must lie in [0, --num-processes={num_processes})")
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=int(heartbeat_timeout))
  except RuntimeError as e:
    if "must be called before" in str(e):  # a library call started the backend first
      raise DistributedError("jax.distributed must start before JAX's backend: call research.train.runtime.processes."
                             "initialize (or run the CLI) before any other JAX use in this process") from None
    raise
  return True


def is_primary() -> bool:
  """Whether this process writes the run's own files (metrics, config): process 0 of the run."""
  return jax.process_index() == 0


def all_agree(flag: bool) -> bool:
  """Whether `flag` holds on every process (itself in a single-process run); a collective when there are several."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.asarray(flag, np.int32))))
