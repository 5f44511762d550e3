"""The memory pre-flight: every run's bytes per device estimated from its own compiled train step before anything is
allocated, printed at start-up, and a run that cannot fit refused in one line that names the estimate and the fix.

The train step is compiled against the abstract state (`state.abstract_initial_state`: shapes, dtypes and shardings,
no arrays), and XLA's `memory_analysis` of that program gives the bytes one device holds while it runs:

  arguments (the train state's shard and the batch) + outputs (the new state, metrics) − aliased (the donated state's
  buffers the outputs reuse) + temporaries (activations kept for the backward, gradients, optimizer intermediates)

The compiled program is the one the run then calls (JAX's jit cache is keyed on the same shapes and shardings), so the
estimate costs no second compilation. The limit it is checked against: an accelerator's own memory
(`memory_stats()["bytes_limit"]`); on the CPU, host RAM (the smaller of physical memory and the cgroup's limit),
which every simulated device and the process itself share, so there the estimate is the process's resident memory
now (JAX, the data) plus the per-device bytes times the local devices, plus the checkpoint writer's buffers: orbax
writes the state from host memory, which on the CPU is the devices' own, and may still be writing while the next
steps run. The trainer's checkpointer writes each array a chunk of `store.checkpoint.CHUNK_BYTES` at a time from the
arrays' own memory, and the estimate counts `WRITER_BYTES` for it, or the whole state if smaller (`writer_bound`).
What it does not see: a --init-from checkpoint's host copy while it loads, the held-out evaluation (its
temporaries are below the train step's), and the observers' programs (--watch, --sharpness-every, ...: compiled at the
first step they are due, when their own bytes per device are printed; an observed step also holds the state twice,
research/train/steps/observed.py).
`--memory-limit GIB` replaces the limit (0: print the estimate, check nothing).
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource

import jax
import jax.numpy as jnp

from models import peft
from models.attention import BLOCK, resolve
from optim import OPTIMIZERS, registry
from research.train.config import RunError
from research.train.config.trainable import Trainable
from research.train.runtime.xla import GIB, StepBytes, size
from research.train.store.checkpoint import CHUNK_BYTES
from sharding import mesh_scope

WRITER_GB = 1  # the checkpoint writer's bytes in flight on the CPU (orbax's save_concurrent_gb: 10^9 bytes a unit)
WRITER_BYTES = 8 * CHUNK_BYTES  # the writer's own buffers (CPU): its chunks in flight, with room


@dataclasses.dataclass(frozen=True)
class Estimate:
  step: StepBytes  # per device
  state: int  # the train state's bytes per device (part of step.argument)
  devices: int  # devices that share `limit` (the CPU's simulated devices share host RAM; an accelerator: 1)
  host: int  # bytes the process holds already and keeps (CPU: resident memory before the state exists), else 0
  limit: int | None  # bytes available to those devices; None: unknown
  where: str  # what `limit` is, e.g. "host RAM" or "cuda:0"
  writer: int = 0  # the checkpoint writer's buffers in the same memory (CPU), else 0
  writer_gb: int | None = None  # the bound on them the checkpointer is given (`writer_bound`); None: orbax's default

  @property
  def total(self) -> int:
    return self.host + self.devices * self.step.peak + self.writer

  def line(self) -> str:
    s = self.step
    per = (f"{size(s.peak)} per device (train state {size(self.state)}, activations, gradients and temporaries "
           f"{size(s.temp)})")
    writer = f" + checkpoint writer {size(self.writer)}" if self.writer else ""
    shared = f" x {self.devices} devices + {size(self.host)} in use{writer} = {size(self.total)}" \
        if self.host or self.devices > 1 or self.writer else ""
    return f"memory: the step needs an estimated {per}{shared}; {self.where} has {size(self.limit)}"


def host_ram() -> int | None:
  """Bytes of RAM this process may use: physical memory, or the cgroup's limit if lower; None if neither is known."""
  sizes = []
  try:
    sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError):
    pass
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path) as f:
        text = f.read().strip()
    except OSError:
      continue
    if text.isdigit() and int(text) < 2 ** 60:  # "max" or a huge number: no limit
      sizes.append(int(text))
  return min(sizes) if sizes else None


def resident_bytes() -> int:
  """This process's resident memory now (Linux /proc; 0 where it is not readable)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def device_limit(mesh) -> tuple[int | None, int, str, bool]:
  """(bytes available, devices sharing them, description, host-shared) for the mesh's devices on this process."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  device = local[0]
  if device.platform == "cpu":
    return host_ram(), len(local), "host RAM", True
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  return (int(limit) if limit else None), 1, f"{device.platform}:{device.id}", False


def _array_bytes(state) -> list[int]:
  return [math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(state)]


def writer_bound(state, mesh) -> tuple[int | None, int]:
  """(orbax's save_concurrent_gb for saving `state` on `mesh`, the writer's bytes the estimate counts). Where the
  devices are host memory (CPU): `WRITER_GB` or, if larger, the largest array's size rounded up to whole GB (orbax
  refuses to write an array larger than the bound), and `WRITER_BYTES`, or the process's share of the state if
  smaller: the checkpointer writes chunks of `CHUNK_BYTES` straight from the arrays (measured on this machine's CPU,
  three random 2.1 GB arrays: 0.31 GiB above the state while saving; orbax's OCDBT format, used before, held the
  encoded arrays in flight, 2.98 GiB). Elsewhere (None, 0): orbax's default, an accelerator's state copied to host
  RAM, which the device estimate does not hold."""
  if not device_limit(mesh)[3]:
    return None, 0
  sizes = _array_bytes(state)
  gb = max([WRITER_GB] + [math.ceil(n / 10 ** 9) for n in sizes])
  return gb, min(sum(sizes) // jax.process_count(), WRITER_BYTES)


def measured(est: Estimate, mesh) -> str:
  """The run's measured peak beside its estimate, one line: on the CPU the process's peak RSS against the estimate's
  total, on an accelerator the largest peak_bytes_in_use of this process's devices against the per-device peak."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if local[0].platform == "cpu":
    got, what, want = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS", est.total
  else:
    peaks: list = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in local]
    if None in peaks:
      return f"memory: {local[0].platform} reports no peak; the estimate was {size(est.step.peak)} per device"
    n = len(local)
    got, what, want = max(peaks), f"peak bytes in use, the largest of {n} {local[0].platform} device" + "s" * (n > 1), \
        est.step.peak
  return f"memory: measured {size(got)} ({what}) against the estimate {size(want)} ({got / want:.2f}x)"


def compile_step(train_step, state, batch_shape: tuple[int, int], batch_sh, mesh):
  """`train_step` compiled for the abstract `state` (ShapeDtypeStructs with shardings) and int32 (x, y) batches of
  `batch_shape` placed by `batch_sh`: the program a run then calls (JAX's jit cache holds it)."""
  x = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sh)
  with mesh_scope(mesh):
    return train_step.lower(state, x, x).compile()


def estimate(train_step, state, batch_shape: tuple[int, int], batch_sh, mesh) -> Estimate:
  """The bytes of `compile_step(...)`'s program per device, against what the mesh's devices have."""
  step = StepBytes.of(compile_step(train_step, state, batch_shape, batch_sh, mesh))
  state_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(state))
  limit, devices, where, shared = device_limit(mesh)
  gb, writer = writer_bound(state, mesh)
  return Estimate(step, state_bytes, devices, resident_bytes() if shared else 0, limit, where, writer, gb)


def _shard_bytes(a) -> int:
  shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
  return math.prod(shape) * jnp.dtype(a.dtype).itemsize


def check(est: Estimate, override: float | None, trains: Trainable, mcfg, seq_len: int) -> None:
  """Refuses (RunError, one line) a run whose estimate exceeds the limit.

  Args:
    est: the run's estimate.
    override: --memory-limit: GiB replacing the devices' limit, 0 checks nothing, None: the devices'.
    trains: what the run trains (`Plan.trains`).
    mcfg: its model config.
    seq_len: --seq-len.
  """
  if override == 0:
    return
  limit = int(override * GIB) if override is not None else est.limit
  if limit is None or est.total <= limit:
    return
  where = f"--memory-limit {override:g} GiB" if override is not None else f"{est.where} ({size(limit)})"
  raise RunError(f"the run needs an estimated {size(est.total)} (train state {size(est.state)} and step "
                 f"temporaries {size(est.step.temp)} per device{f' x {est.devices} devices' if est.devices > 1 else ''}"
                 f"{f', {size(est.host)} already in use' if est.host else ''}"
                 f"{f', checkpoint writer {size(est.writer)}' if est.writer else ''}) but {where} holds less: "
                 f"{fix(est, trains, mcfg, seq_len)}; or --memory-limit GIB (0: no check) if you know better")


def fix(est: Estimate, trains: Trainable, mcfg, seq_len: int) -> str:
  """What would make the run fit, by what dominates it: the state (with the gradients and update temporaries of its
  size, about half the step's temporaries when the state dominates) or the activations.

  Args:
    est: the run's estimate.
    trains: what the run trains.
    mcfg: its model config (--remat; the head dim decides whether cuDNN would take its attention).
    seq_len: --seq-len.

  Returns:
    The advice, one phrase.
  """
  state_bound = 2 * est.state >= est.step.temp
  if state_bound and not (trains.adapters or trains.blockwise):
    blockwise = " / ".join(sorted(n for n in OPTIMIZERS if registry.needs(n).blockwise is not None))
    return (f"fine-tune fewer bytes (--optimizer {blockwise}: the model in bfloat16, one layer trained at a time; "
            f"--peft {next(iter(peft.ADAPTERS))} trains adapters on a bfloat16 base; --freeze) or shard the state over "
            "more devices (--mesh fsdp=N)")
  if state_bound:
    return "shard the state over more devices (--mesh fsdp=N) or choose a smaller model"
  remat = "" if mcfg.remat else ", or recompute activations in the backward (--remat)"
  return f"lower --batch-size or --seq-len{remat}{scores_fix(mcfg, seq_len)}"


def scores_fix(mcfg, seq_len: int) -> str:
  """The attention that keeps no T·T scores, when this run's (model config `mcfg`, --seq-len) keeps them over a
  sequence longer than one tile."""
  kind = getattr(jax.devices()[0], "device_kind", "")
  impl = resolve(mcfg.attention, mcfg.compute_dtype, seq_len, mcfg.hd, 1, kind)
  if impl != "xla" or seq_len <= BLOCK:
    return ""
  return (f", or an attention that keeps no T·T scores (--attention flash with --seq-len a multiple of {BLOCK}; "
          f"cudnn on an NVIDIA GPU in bfloat16)")
