"""Device meshes from a spec string such as "data=2,fsdp=2,tensor=2".

The mesh always has the six axes of AXES, in that order; omitted axes have size 1, and one
axis may be -1 to take the remaining devices. Axis types are always passed explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

# the mesh's axis names: every other module names an axis by these constants (tests/sharding/test_axis_names.py)
DATA, STAGE, FSDP, EXPERT, CONTEXT, TENSOR = "data", "stage", "fsdp", "expert", "context", "tensor"
AXES = (DATA, STAGE, FSDP, EXPERT, CONTEXT, TENSOR)
# Order matters: the last axes vary fastest over device ids, so `tensor` (the chattiest) groups
# neighbouring devices, `context` (a K/V ring hop per layer) the next nearest, and `data` (one
# all-reduce a step) spans the farthest ones.

DATA_AXES = (DATA, FSDP, EXPERT)  # the axes a global batch is split over


class MeshError(ValueError):
  """A mesh spec that does not describe the available devices."""


def parse_mesh_spec(spec: str, num_devices: int | None) -> dict[str, int]:
  """The size of every axis of AXES that a mesh spec gives on `num_devices` devices.

  "data=2,fsdp=-1" -> {"data": 2, "stage": 1, "fsdp": 4, ...} for 8 devices.

  Args:
    spec: comma-separated `axis=size`; omitted axes are 1, one axis may be -1 (the remaining devices).
    num_devices: the devices the mesh must use, all of them; None checks the spec's form only (a command line's
      flag, before the devices are known), leaving a -1 axis as -1.

  Returns:
    {axis: size} for every axis of AXES, in that order.

  Raises:
    MeshError: when the fixed sizes do not divide `num_devices` (with a -1 axis) or do not multiply to it (without),
      or when an item is malformed, names an unknown axis or one axis twice, makes a second axis -1, or has a size
      neither positive nor -1.
  """
  sizes, fill = _parse_items(spec)
  if num_devices is None:
    return {**sizes, fill: -1} if fill is not None else sizes
  known = math.prod(v for k, v in sizes.items() if k != fill)
  if fill is not None:
    if num_devices % known:
      raise MeshError(f"mesh {spec!r}: {num_devices} devices do not divide by the fixed axes' product {known}")
    sizes[fill] = num_devices // known
  elif known != num_devices:
    raise MeshError(f"mesh {spec!r} needs {known} devices but {num_devices} are available")
  return sizes


def devices_for(spec: str, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """The devices a spec needs: the first prod(sizes) of `devices` for fixed sizes, all of them if one axis is -1.

  For running several mesh sizes in one process (benchmarks).

  Args:
    spec: comma-separated `axis=size`, as `make_mesh` takes.
    devices: the devices to pick from; default None, all (`jax.devices()`).

  Returns:
    The leading devices, in order.

  Raises:
    MeshError: when the spec needs more devices than there are (or is malformed, as `parse_mesh_spec` says).
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes, fill = _parse_items(spec)
  n = len(devices) if fill is not None else math.prod(sizes.values())
  if n > len(devices):
    raise MeshError(f"mesh {spec!r} needs {n} devices but {len(devices)} are available")
  return devices[:n]


def _parse_items(spec: str) -> tuple[dict[str, int], str | None]:
  """The axis sizes a spec names (others 1) and the axis given as -1, if any."""
  sizes = dict.fromkeys(AXES, 1)
  fill = None
  seen = set()
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, value = item.partition("=")
    name = name.strip()
    if not sep:
      raise MeshError(f"mesh spec item {item!r} is not of the form axis=size (spec {spec!r})")
    if name not in sizes:
      raise MeshError(f"unknown mesh axis {name!r} in {spec!r}; axes are {', '.join(AXES)}")
    if name in seen:
      raise MeshError(f"mesh axis {name!r} is given twice in {spec!r}")
    seen.add(name)
    try:
      size = int(value)
    except ValueError:
      raise MeshError(f"mesh axis {name!r} has non-integer size {value!r} in {spec!r}") from None
    if size == -1:
      if fill is not None:
        raise MeshError(f"only one mesh axis may be -1, got {fill!r} and {name!r} in {spec!r}")
      fill = name
    elif size <= 0:
      raise MeshError(f"mesh axis {name!r} must have a positive size (or -1), got {size} in {spec!r}")
    else:
      sizes[name] = size
  return sizes, fill


def make_mesh(spec: str = "data=-1", *, devices: Sequence[jax.Device] | None = None, explicit: bool = False) -> Mesh:
  """A mesh over `devices` (default: all) with the axes of AXES.

  A spec that does not describe the devices raises MeshError (`parse_mesh_spec`).

  Args:
    spec: comma-separated `axis=size`; omitted axes are 1, one axis may be -1; default "data=-1".
    devices: the devices to use, e.g. `jax.devices()[:4]`; default None, all.
    explicit: `AxisType.Explicit` for every axis (sharding in types) instead of `Auto` (GSPMD); default False.

  Returns:
    The mesh, its axes AXES in that order, every axis type given explicitly.
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = parse_mesh_spec(spec, len(devices))
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(kind,) * len(AXES), devices=devices)


def mesh_spec(mesh: Mesh) -> str:
  """The compact spec of a mesh: only axes larger than 1.

  Args:
    mesh: the mesh.

  Returns:
    E.g. "data=2,tensor=4"; "data=1" for a single device.
  """
  parts = [f"{a}={n}" for a, n in mesh.shape.items() if n > 1]
  return ",".join(parts) or "data=1"


def mesh_scope(mesh: Mesh) -> AbstractContextManager[Any]:
  """A context in which `mesh` is the current mesh, inside a trace or not.

  `jax.set_mesh(mesh)`, or inside a trace (where set_mesh is refused: `jax.eval_shape` of a state's construction,
  say) `jax.sharding.use_abstract_mesh`, which gives the traced code the same axes for its sharding hints.

  Args:
    mesh: the mesh.

  Returns:
    The context manager to enter (`with mesh_scope(mesh): ...`).
  """
  from jax._src import core  # trace_state_clean: the one test of "not inside a trace"; no public equivalent
  if core.trace_state_clean():
    return jax.set_mesh(mesh)
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
