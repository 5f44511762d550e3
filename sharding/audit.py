"""Communication audit: the collectives of a compiled program, read from its HLO, and the textbook bytes to compare.

`collectives(compiled)` reads `compiled.as_text()` (HLO after SPMD partitioning: the program ONE device runs) with
sharding/hlo.py's reader and returns every all-gather, all-reduce, reduce-scatter, all-to-all (also the tuple form
with one operand per peer), collective-permute and ragged-all-to-all, with its operand and result bytes per device,
its replica groups and a summary by kind. Reading rules:

- Async pairs (`all-gather-start` / `-done`, ...) count once, at the `-start`; the result bytes are the `-done`'s
  shape. Collectives wrapped in `async-start(..., calls=%c)` are found in `%c` and marked `is_async`.
- Replica groups: every spelling XLA prints, expanded to device ids (sharding/hlo.py's `replica_groups`).
- Loops: an op inside a `while` body runs once per iteration. When XLA knows the trip count
  (`backend_config` `known_trip_count`, which it records for `lax.scan` / `fori_loop`), `count` is multiplied by it
  (nested loops multiply); otherwise the op is counted once per program text and `trip_count_known` is False.
  `in_loop` flags either case: collectives in a loop body cost latency every iteration (and deadlock XLA:CPU's
  simulated devices when executed).
- XLA:CPU has no reduce-scatter from GSPMD: a sharded gradient shows as an all-reduce of the full buffer whose
  only users dynamic-slice a 1/n piece of it (directly, or inside a fusion, possibly after a bitcast / copy /
  transpose; XLA's combiner often packs several gradients into one tuple all-reduce, read element by element).
  Such an all-reduce keeps kind "all-reduce" (that is what the CPU sends) and records the operand bytes of those
  elements as `scatter_bytes`; `summary(fold_scatter=True)` counts that part as the reduce-scatter it stands for
  (result = operand / n, ring bytes of a reduce-scatter: what a backend with a native reduce-scatter, GPU or TPU,
  would send) and the rest as all-reduce (a tuple all-reduce with both parts is counted under both kinds).

Bytes: `operand_bytes` and `result_bytes` are the raw buffer sizes from the HLO shapes on one device, summed over a
tuple's elements (sharding/hlo.py's `shape_bytes`: pred and 8-bit types 1 byte, bf16 2, f32 / s32 4, ...).
`wire_bytes` is what one device sends with bandwidth-optimal ring algorithms over a group of n (scaling-book "How to
Scale Your Model", sharding.md; Patarasuk & Yuan 2009): all-gather (n−1)/n · result, reduce-scatter (n−1)/n ·
operand, all-reduce 2(n−1)/n · operand, all-to-all (n−1)/n · operand (one piece per peer), collective-permute the
operand.

`analytic_bytes(...)` gives the textbook per-device wire bytes of one training step for DP, FSDP, ZeRO-1 and TP.
`matmul_flops(compiled)` sums the FLOPs of the `dot`s one device runs, loop trip counts included (XLA's own
`cost_analysis()` counts a loop body once).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sharding import hlo
from sharding.mesh import DATA, EXPERT, FSDP, STAGE, TENSOR

if TYPE_CHECKING:
  import jax

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")


class AuditError(ValueError):
  """Input that is not the HLO text of a compiled (partitioned) program, or a mesh the formulas do not cover."""


def _reads_hlo(fn):
  """`fn` with the reader's HloError raised as AuditError, the one error this module's callers catch."""
  @functools.wraps(fn)
  def reading(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except hlo.HloError as e:
      raise AuditError(str(e)) from None
  return reading


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the per-device program."""
  kind: str  # one of KINDS (an async `-start` is reported under its base kind)
  name: str  # the instruction's name in the HLO text
  computation: str
  operand_bytes: int  # per device, summed over operands
  result_bytes: int  # per device, summed over a tuple's elements
  dtypes: tuple[str, ...]  # element types of the result
  groups: tuple[tuple[int, ...], ...]  # replica groups; (source, target) pairs for collective-permute
  group_size: int  # devices that take part together (2 for a permute)
  is_async: bool = False
  count: int = 1  # executions per program run: 1, or the product of the enclosing loops' known trip counts
  in_loop: bool = False
  trip_count_known: bool = True  # False: inside a while loop whose trip count XLA does not record
  scatter_bytes: int = 0  # all-reduce operand bytes only 1/n-sliced afterwards: XLA:CPU's reduce-scatter

  @property
  def scatter(self) -> bool:
    """An all-reduce that is wholly a reduce-scatter in disguise (all-reduce + dynamic-slice)."""
    return 0 < self.scatter_bytes == self.operand_bytes

  @property
  def wire_bytes(self) -> float:
    """Bytes one device sends per execution (ring algorithms over `group_size` devices)."""
    return _wire(self.kind, self.operand_bytes, self.result_bytes, self.group_size, self.groups)


@dataclasses.dataclass(frozen=True)
class KindTotal:
  """The collectives of one kind in a program, summed: every total counts each op `count` times (loop trip counts)."""
  count: int  # executions per program run
  operand_bytes: int  # per device
  result_bytes: int  # per device
  wire_bytes: float  # what one device sends (ring algorithms)


@dataclasses.dataclass(frozen=True)
class Audit:
  """The collectives of one program; counts and bytes in `summary` include loop trip counts."""
  ops: tuple[Collective, ...]
  num_devices: int

  def summary(self, fold_scatter: bool = False) -> dict[str, KindTotal]:
    """Totals by kind over the kinds present, loop trip counts included.

    Args:
      fold_scatter: report the part of an all-reduce that is only 1/n-sliced afterwards (`Collective.scatter_bytes`,
        XLA:CPU's reduce-scatter) as the reduce-scatter it stands for (module docstring); default False.

    Returns:
      {kind: KindTotal}, kinds in the order of KINDS.
    """
    acc: dict[str, list] = {}

    def add(op, kind, operand, result):
      a = acc.setdefault(kind, [0, 0, 0, 0.0])
      wire = _wire(kind, operand, result, op.group_size, op.groups)
      for i, v in enumerate((1, operand, result, wire)):
        a[i] += op.count * v

    for op in self.ops:
      part = op.scatter_bytes if fold_scatter else 0
      if part:
        add(op, "reduce-scatter", part, part // op.group_size)
      if not part or op.operand_bytes > part:
        add(op, op.kind, op.operand_bytes - part, op.result_bytes - part)
    return {k: KindTotal(*acc[k]) for k in KINDS if k in acc}

  def wire_bytes(self, fold_scatter: bool = False) -> float:
    """Bytes one device sends in one program execution, over all collectives.

    Args:
      fold_scatter: count all-reduce + dynamic-slice as reduce-scatter, as `summary` does; default False.

    Returns:
      The sum of `summary(fold_scatter)`'s wire bytes.
    """
    return sum(t.wire_bytes for t in self.summary(fold_scatter).values())

  def table(self, fold_scatter: bool = False) -> str:
    """The summary as a markdown table (MiB).

    Args:
      fold_scatter: count all-reduce + dynamic-slice as reduce-scatter, as `summary` does; default False.

    Returns:
      One row per kind (count, operand, result and wire MiB per device), then, if any collective is inside a while
      loop, a line counting them and naming the first 8.
    """
    mib = 2 ** 20
    rows = ["| collective | count | operand MiB | result MiB | wire MiB/device |", "|---|---|---|---|---|"]
    for k, t in self.summary(fold_scatter).items():
      rows.append(f"| {k} | {t.count} | {t.operand_bytes / mib:.2f} | {t.result_bytes / mib:.2f} | "
                  f"{t.wire_bytes / mib:.2f} |")
    loops = [op.name for op in self.ops if op.in_loop]
    if loops:
      rows.append(f"\n{len(loops)} inside while loops: {', '.join(loops[:8])}")
    return "\n".join(rows)


@_reads_hlo
def collectives(compiled_or_hlo: jax.stages.Compiled | str) -> Audit:
  """Every collective of a compiled program, with its bytes per device and its replica groups.

  The reading rules (async pairs, replica groups, loops, XLA:CPU's reduce-scatter as all-reduce + dynamic-slice) and
  the byte counts are the module docstring's. Input that is not the HLO of a compiled program raises AuditError
  (sharding/hlo.py's HloError, re-raised).

  Args:
    compiled_or_hlo: a `jax.stages.Compiled`, or its `.as_text()`.

  Returns:
    The program's collectives, in program order, and its device count.
  """
  module = hlo.Module(hlo.hlo_text(compiled_or_hlo))
  ops = []
  for comp, instr in module.walk():
    kind = instr.opcode.removesuffix("-start")
    if kind not in KINDS:
      continue
    mult, in_loop, known, is_async = module.calls[comp.name]
    result_shape = instr.shape
    if instr.opcode.endswith("-start"):
      done = [u for u in comp.users.get(instr.name, ()) if u.opcode == kind + "-done"]
      result_shape = done[0].shape if done else hlo.start_result(kind, instr.shape, len(instr.operands))
    if kind == "collective-permute":
      groups = hlo.source_target_pairs(instr.attrs)
    else:
      groups = hlo.replica_groups(instr.attrs, module.num_devices)
    size = 2 if kind == "collective-permute" else (len(groups[0]) if groups else module.num_devices)
    op = Collective(kind=kind, name=instr.name, computation=comp.name,
                    operand_bytes=sum(hlo.shape_bytes(comp.shape_of(o)) for o in instr.operands),
                    result_bytes=hlo.shape_bytes(result_shape),
                    dtypes=tuple(t for t, _ in hlo.arrays(result_shape)),
                    groups=groups, group_size=size, is_async=is_async or instr.opcode.endswith("-start"),
                    count=mult, in_loop=in_loop, trip_count_known=known)
    if kind == "all-reduce":
      op = dataclasses.replace(op, scatter_bytes=_scatter_bytes(module, comp, instr, size))
    ops.append(op)
  return Audit(tuple(ops), module.num_devices)


@_reads_hlo
def matmul_flops(compiled_or_hlo: jax.stages.Compiled | str) -> float:
  """FLOPs of every `dot` one device runs per program execution, loop trip counts included.

  Each dot counts 2 · result elements · contracted size; loop bodies are multiplied by their known trip counts (once
  per program text where XLA does not know it). XLA's own `cost_analysis()` counts a loop body once. Input that is
  not the HLO of a compiled program raises AuditError.

  Args:
    compiled_or_hlo: a `jax.stages.Compiled`, or its `.as_text()`.

  Returns:
    The FLOPs, summed over the program's dots.
  """
  module = hlo.Module(hlo.hlo_text(compiled_or_hlo))
  total = 0.0
  for comp, instr in module.walk():
    if instr.opcode != "dot":
      continue
    lhs = hlo.arrays(comp.shape_of(instr.operands[0]))[0][1]
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
    total += module.calls[comp.name][0] * 2.0 * math.prod(hlo.arrays(instr.shape)[0][1]) * contracted
  return total


def analytic_bytes(n_params: int, mesh: jax.sharding.Mesh | Mapping[str, int] | str, *, zero1: bool = False,
                   param_bytes: int = 4, grad_bytes: int | None = None, n_layers: int = 0, d_model: int = 0,
                   tokens: int = 0, act_bytes: int = 4) -> dict[str, float]:
  """Textbook wire bytes one device sends in one training step, by term, plus "total".

  With r(n) = (n−1)/n (a ring over n devices), P parameters, mesh axes D = data, X = fsdp, Y = tensor, b_p / b_g /
  b_a bytes per parameter / gradient / activation element:

    FSDP (ZeRO-3) over X:  all-gather params forward  r(X)·(P/Y)·b_p
                           all-gather params backward r(X)·(P/Y)·b_p      (re-gathered, not kept)
                           reduce-scatter grads       r(X)·(P/Y)·b_g      → 3·r(X)·P·b: 1.5× DP
    DP over D:             all-reduce grads           2·r(D)·(P/XY)·b_g  (AR = RS + AG)
    ZeRO-1 over D:         reduce-scatter grads       r(D)·(P/XY)·b_g
                           all-gather params          r(D)·(P/XY)·b_p     → the same bytes as DP
    TP (Megatron) over Y:  4 all-reduces of the activations per layer (2 forward: after the attention output and
                           the MLP down projection; 2 backward: their transposes at the QKV and up projections),
                           each 2·r(Y)·(tokens/(D·X))·d_model·b_a

  TP is taken to split all P parameters by Y (norms and biases, which it replicates, are negligible). Pipeline and
  expert axes are not modelled.

  Args:
    n_params: trainable parameters P.
    mesh: a `jax.sharding.Mesh`, a {axis: size} mapping, or a spec such as "data=2,fsdp=4".
    zero1: gradients reduce-scattered and parameters all-gathered over `data` instead of an all-reduce; default False.
    param_bytes: bytes per parameter element b_p; default 4.
    grad_bytes: bytes per gradient element b_g; default None, `param_bytes`.
    n_layers: layers, for the TP term (needed when tensor > 1).
    d_model: model width, for the TP term (needed when tensor > 1).
    tokens: tokens per global batch (batch · seq), for the TP term (needed when tensor > 1).
    act_bytes: bytes per activation element b_a; default 4.

  Returns:
    {term: bytes} for the terms the mesh has (e.g. "data all-reduce grads", "fsdp reduce-scatter grads"), plus
    "total", their sum.

  Raises:
    AuditError: when the mesh has a stage or expert axis larger than 1, `zero1` is set on a mesh whose `data` axis is
      1, a tensor axis larger than 1 comes without `n_layers`, `d_model` and `tokens`, or `mesh` is a spec or object
      the function cannot read.

  References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2019, arXiv
      1910.02054, §7 (DP and ZeRO-1/2 move 2Ψ, ZeRO-3 3Ψ per step).
    "How to Scale Your Model" (jax-ml/scaling-book): sharding.md (collective costs), training.md (per-layer DP /
      FSDP / TP communication).
    Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019,
      arXiv 1909.08053, §3 (two all-reduces forward, two backward per layer).
  """
  sizes = _mesh_sizes(mesh)
  for axis in (STAGE, EXPERT):
    if sizes.get(axis, 1) > 1:
      raise AuditError(f"analytic_bytes models data, fsdp and tensor axes only; got {axis}={sizes[axis]}")
  d, x, y = sizes.get(DATA, 1), sizes.get(FSDP, 1), sizes.get(TENSOR, 1)
  if zero1 and d == 1:
    raise AuditError("zero1=True shards optimizer state over the `data` axis, which has size 1 here; "
                     "use a mesh such as {'data': 8}")
  if y > 1 and not (n_layers and d_model and tokens):
    raise AuditError("a tensor axis > 1 needs n_layers, d_model and tokens for the activation all-reduces")
  r = lambda n: (n - 1) / n
  b_g = param_bytes if grad_bytes is None else grad_bytes
  p_local = n_params / y
  out: dict[str, float] = {}
  if x > 1:
    out["fsdp all-gather params (forward)"] = r(x) * p_local * param_bytes
    out["fsdp all-gather params (backward)"] = r(x) * p_local * param_bytes
    out["fsdp reduce-scatter grads"] = r(x) * p_local * b_g
  if d > 1 and zero1:
    out["data reduce-scatter grads"] = r(d) * p_local / x * b_g
    out["data all-gather params"] = r(d) * p_local / x * param_bytes
  elif d > 1:
    out["data all-reduce grads"] = 2 * r(d) * p_local / x * b_g
  if y > 1:
    out["tensor all-reduce activations"] = n_layers * 4 * 2 * r(y) * tokens / (d * x) * d_model * act_bytes
  out["total"] = sum(out.values())
  return out


def _wire(kind, operand_bytes, result_bytes, n, groups) -> float:
  if kind == "collective-permute":
    return float(operand_bytes) if any(a != b for a, b in groups) else 0.0
  r = (n - 1) / n if n > 1 else 0.0
  if kind == "all-gather":
    return r * result_bytes
  if kind == "all-reduce":
    return 2 * r * operand_bytes
  return r * operand_bytes  # reduce-scatter, all-to-all, ragged-all-to-all (as if dense)


def _scatter_bytes(module: hlo.Module, comp: hlo.Computation, instr: hlo.Instruction, n: int) -> int:
  """Bytes of an all-reduce's result (element by element for a tuple) that are only ever 1/n-sliced afterwards."""
  if n < 2:
    return 0
  name = instr.name
  if instr.opcode.endswith("-start"):
    done = [u for u in comp.users.get(name, ()) if u.opcode.endswith("-done")]
    if len(done) != 1:
      return 0
    name = done[0].name
  arrays = hlo.arrays(instr.shape)
  if len(arrays) == 1 and not instr.shape.startswith("("):
    return hlo.shape_bytes(instr.shape) if _only_sliced(module, comp, name, n) else 0
  sliced: dict[int, bool] = {}  # tuple index -> every get-tuple-element of it only sliced
  for u in comp.users.get(name, ()):
    if u.opcode != "get-tuple-element":
      return 0
    m = re.search(r"index=(\d+)", u.attrs)
    assert m is not None  # XLA prints every get-tuple-element with its index
    k = int(m.group(1))
    sliced[k] = sliced.get(k, True) and _only_sliced(module, comp, u.name, n)
  return sum(math.ceil(hlo.element_bits(arrays[k][0]) * math.prod(arrays[k][1]) / 8)
             for k, ok in sliced.items() if ok)


_LAYOUT_OPS = ("bitcast", "copy", "transpose", "reshape")


def _only_sliced(module: hlo.Module, comp: hlo.Computation, name: str, n: int, depth: int = 0) -> bool:
  """Whether every use of value `name` ends in a dynamic-slice keeping 1/n of it.

  Uses are followed through layout ops and into fusions: the fusion's parameter for that operand is followed inside
  the fused computation.
  """
  users = comp.users.get(name, [])
  if not users or depth > 8:
    return False
  size = math.prod(hlo.arrays(comp.shape_of(name))[0][1]) if hlo.arrays(comp.shape_of(name)) else 0
  for u in users:
    if u.opcode == "dynamic-slice" and u.operands[0] == name:
      if math.prod(hlo.arrays(u.shape)[0][1]) * n != size:
        return False
    elif u.opcode in _LAYOUT_OPS:
      if not _only_sliced(module, comp, u.name, n, depth + 1):
        return False
    elif u.opcode == "fusion":
      called = re.search(r"calls=%?([\w.\-]+)", u.attrs)
      inner = module.comps.get(called.group(1)) if called else None
      if inner is None:
        return False
      params = {i.operands[0]: i.name for i in inner.instrs if i.opcode == "parameter"}
      for k, o in enumerate(u.operands):
        if o == name and not (str(k) in params and _only_sliced(module, inner, params[str(k)], n, depth + 1)):
          return False
    else:
      return False
  return True


def _mesh_sizes(mesh) -> dict[str, int]:
  if hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
    return dict(mesh.shape)
  if isinstance(mesh, Mapping):
    return {k: int(v) for k, v in mesh.items()}
  if isinstance(mesh, str):
    out = {}
    for item in filter(None, (s.strip() for s in mesh.split(","))):
      name, sep, value = item.partition("=")
      if not sep or not value.strip().isdigit():
        raise AuditError(f"mesh spec item {item!r} must be axis=size with a positive size (spec {mesh!r})")
      out[name.strip()] = int(value)
    return out
  raise AuditError(f"mesh must be a Mesh, a {{axis: size}} mapping or a spec string, got {type(mesh).__name__}")

