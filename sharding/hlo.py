"""HLO text reader: a compiled program's text parsed into computations and instructions.

It also gives how often each computation runs, and the shapes, bytes and replica groups that its instructions spell.

`Module(hlo_text(compiled))` reads `compiled.as_text()` (HLO after SPMD partitioning: the program ONE device runs):
- `Module.comps`: each computation (`Computation`) with its instructions in order (`Instruction`: name, result shape,
  opcode, operand names, the attribute text after the operands), each value's users and shape. An instruction split
  over several lines is joined and `/*index=5*/` markers dropped; a bare snippet of instructions is one computation.
- `Module.calls`: how often each computation reached from the entry runs per program execution. A `while` body runs
  once per iteration: when XLA knows the trip count (`backend_config` `known_trip_count`, which it records for
  `lax.scan` / `fori_loop`) it multiplies (nested loops multiply); otherwise once per program text, flagged. Also
  flagged: a computation reached through an `async-start(..., calls=%c)` wrapper.
- `replica_groups`: three spellings, all expanded to device ids: explicit `{{0,1},{2,3}}` (and `{}` = all devices),
  iota `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, and mesh axes `mesh['x'=2,'y'=4] {'y'}` (jax 0.10's XLA).
- `shape_bytes`: the raw buffer size of a shape on one device, summed over a tuple's elements (pred and 8-bit types
  1 byte, bf16 2, f32 / s32 4, ...; token and opaque none).
What the collectives among the instructions cost is sharding/audit.py's, which reads the program through this file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  import jax


class HloError(ValueError):
  """Input that is not the HLO text of a compiled (partitioned) program, or HLO this reader cannot read."""


@dataclasses.dataclass
class Instruction:
  """One instruction: `%name = shape opcode(operands), attrs`."""
  name: str
  shape: str  # the result's shape text, e.g. `f32[8,4]{1,0}` or a tuple `(f32[8]{0}, s32[])`
  opcode: str
  operands: list[str]  # the operands' instruction names, without `%`
  attrs: str  # the text after the operand list: replica_groups=..., calls=..., backend_config=...


@dataclasses.dataclass
class Computation:
  """One computation: its instructions in order, each value's users and each value's shape text."""
  name: str
  instrs: list[Instruction]
  users: dict[str, list[Instruction]]
  shapes: dict[str, str]

  def shape_of(self, name: str) -> str:
    """The shape text of value `name`.

    Args:
      name: an instruction's name, without `%`.

    Returns:
      Its shape text, e.g. `f32[8,4]{1,0}`; "" when it is not defined in this computation.
    """
    return self.shapes.get(name, "")


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")


def hlo_text(x: jax.stages.Compiled | str) -> str:
  """The HLO text of a compiled program.

  Args:
    x: a `jax.stages.Compiled`, or its `.as_text()`.

  Returns:
    The text, after SPMD partitioning (the program one device runs).

  Raises:
    HloError: when `x` is a Lowered program (its text is pre-partitioning), StableHLO text or anything else.
  """
  import jax
  if isinstance(x, jax.stages.Lowered):
    raise HloError("got a Lowered program: its text is pre-partitioning and has no collectives; "
                   "pass lowered.compile()")
  text = x.as_text() if hasattr(x, "as_text") else x
  if not isinstance(text, str):
    raise HloError(f"expected a jax.stages.Compiled or HLO text, got {type(x).__name__}")
  if "module @" in text[:2000] and "HloModule" not in text[:2000]:
    raise HloError("got StableHLO (MLIR) text; pass the compiled program's HLO, compiled.as_text()")
  return text


def _balanced(s: str, start: int, open_: str = "(", close: str = ")") -> int:
  """Index just past the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(s)):
    if s[i] == open_:
      depth += 1
    elif s[i] == close:
      depth -= 1
      if depth == 0:
        return i + 1
  raise HloError(f"unbalanced {open_}{close} in HLO line: {s[:200]}")


def _split_top(s: str) -> list[str]:
  parts: list[str] = []
  cur: list[str] = []
  depth = 0
  for ch in s:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return [p.strip() for p in parts]


def _parse_instr(line: str) -> Instruction | None:
  m = _INSTR.match(line)
  if not m:
    return None
  i = m.end()
  if line[i:i + 1] == "(":
    j = _balanced(line, i)
  else:
    j = i + len(line[i:].split(" ", 1)[0])
  shape = line[i:j]
  m2 = re.match(r"\s*([\w\-]+)\(", line[j:])
  if not m2:
    return None
  k = j + m2.end() - 1
  end = _balanced(line, k)
  operands = [p.split()[-1].lstrip("%") for p in _split_top(line[k + 1:end - 1]) if p]
  return Instruction(m.group(1), shape, m2.group(1), operands, line[end:])


def _logical_lines(text: str):
  """Lines of the HLO text; an instruction split over several lines (open parenthesis or trailing comma) joined."""
  pending: list[str] = []
  for raw in text.splitlines():
    raw = re.sub(r"/\*.*?\*/", "", raw)  # `/*index=5*/` markers in long tuples and operand lists
    pending.append(raw.strip() if pending else raw)
    line = " ".join(pending)
    open_ = line.count("(") > line.count(")") or line.rstrip().endswith(",")
    if _INSTR.match(line) and open_ and len(pending) < 50:
      continue
    pending = []
    yield line


class Module:
  """Computations, each instruction's users, and how often each computation runs per program execution.

  Attributes:
    num_devices: the larger of num_partitions and replica_count.
    comps: {name: Computation}.
    entry: the entry computation's name.
    calls: {name: (executions per program run, in a while loop, every enclosing loop's trip count known, reached
      through an async wrapper)} for each computation reached from the entry.

  Args:
    text: the HLO text (`hlo_text`), or a bare snippet of instructions (one implicit entry computation).

  Raises:
    HloError: when the text holds no HLO instructions.
  """

  def __init__(self, text: str):
    head = re.search(r"num_partitions=(\d+)", text)
    reps = re.search(r"replica_count=(\d+)", text)
    self.num_devices = max(int(head.group(1)) if head else 1, int(reps.group(1)) if reps else 1)
    self.comps: dict[str, Computation] = {}
    entry, cur = None, None
    for line in _logical_lines(text):
      if not _INSTR.match(line):
        h = _HEADER.match(line.strip())
        if h:
          cur = self.comps[h.group(2)] = Computation(h.group(2), [], {}, {})
          entry = cur.name if h.group(1) else entry
        continue
      ins = _parse_instr(line)
      if ins is None:
        continue
      if cur is None:  # a bare snippet of instructions: one implicit entry computation
        cur = self.comps["<entry>"] = Computation("<entry>", [], {}, {})
        entry = cur.name
      cur.instrs.append(ins)
      cur.shapes[ins.name] = ins.shape
      for o in ins.operands:
        cur.users.setdefault(o, []).append(ins)
    if entry is None:
      if not self.comps:
        raise HloError("no HLO instructions found; pass compiled.as_text() of a jax.jit(...).lower(...).compile()")
      entry = list(self.comps)[-1]  # XLA prints the entry computation last
    self.entry = entry
    # name -> (multiplier, in_loop, trip_count_known, reached through an async wrapper)
    self.calls: dict[str, tuple[int, bool, bool, bool]] = {}
    self._visit(entry, 1, False, True, False)

  def _visit(self, name, mult, in_loop, known, is_async):
    """Add `mult` executions of computation `name` (reached from one more call site) and of all it calls."""
    old = self.calls.get(name, (0, False, True, False))
    self.calls[name] = (old[0] + mult, in_loop or old[1], known and old[2], is_async or old[3])
    for ins in self.comps[name].instrs:
      for key, value in _CALLED.findall(ins.attrs):
        if key == "to_apply" and ins.opcode != "call":  # scalar reducers: no collectives or dots live there
          continue
        for t in (t.strip().lstrip("%") for t in value.strip("{}").split(",")):
          if t not in self.comps:
            continue
          if key in ("body", "condition"):
            trip = _trip_count(ins.attrs)
            self._visit(t, mult * (trip or 1), True, known and trip is not None, is_async)
          else:
            self._visit(t, mult, in_loop, known, is_async or ins.opcode == "async-start")

  def walk(self) -> Iterator[tuple[Computation, Instruction]]:
    """Every instruction in the computations reached from the entry, computation by computation.

    Yields:
      (computation, instruction) pairs, instructions in program order.
    """
    for name in self.calls:
      comp = self.comps[name]
      for ins in comp.instrs:
        yield comp, ins


def _trip_count(attrs: str) -> int | None:
  m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?', attrs)
  return int(m.group(1)) if m else None


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The arrays of a shape string, tuples flattened.

  Args:
    shape: a shape text, e.g. `f32[8,4]{1,0}` or `(f32[8]{0}, s32[])`; dynamic dims `<=n` read as n.

  Returns:
    [(element type, dims)], one per array.
  """
  out = []
  for t, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]", shape):
    out.append((t, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d)))
  return out


def element_bits(t: str) -> int:
  """Bits of one element of an HLO type.

  Args:
    t: the element type, e.g. `pred`, `bf16`, `f8e4m3fn`.

  Returns:
    pred 8; s8 / u8 / f8* 8, bf16 16, f32 32, ...; token, opaque 0.
  """
  if t == "pred":
    return 8
  m = re.fullmatch(r"(?:s|u|f|bf|c)(\d+)[a-z0-9]*", t)
  return int(m.group(1)) if m else 0  # token[], opaque: no bytes


def shape_bytes(shape: str) -> int:
  """Bytes of the buffers of a shape text on one device, summed over a tuple's elements.

  Args:
    shape: a shape text (`Instruction.shape`).

  Returns:
    The bytes, each array rounded up to whole bytes (`element_bits`).
  """
  return sum(math.ceil(element_bits(t) * math.prod(d) / 8) for t, d in arrays(shape))


def start_result(kind: str, shape: str, n_operands: int) -> str:
  """The destination buffer of an async start whose `-done` is not in the text.

  All-gather-start's tuple is (operands..., results...), collective-permute-start's (operand, result, context...).

  Args:
    kind: the collective's base kind, e.g. "all-gather" (the opcode without `-start`).
    shape: the start instruction's shape text.
    n_operands: the start instruction's operand count.

  Returns:
    The result part of the shape text (its arrays joined by commas), or `shape` itself otherwise.
  """
  parts = [f"{t}[{','.join(map(str, d))}]" for t, d in arrays(shape)]
  if kind == "all-gather" and len(parts) >= 2 * n_operands:
    return ",".join(parts[n_operands:2 * n_operands])
  if kind == "collective-permute" and len(parts) >= 2:
    return parts[1]
  return shape


def replica_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
  """The replica groups of an instruction as device ids, from any of their spellings (module docstring).

  Args:
    attrs: the instruction's attribute text (`Instruction.attrs`).
    num_devices: the program's devices: one group of all of them when there is no `replica_groups=` or it is `{}`.

  Returns:
    One tuple of device ids per group.

  Raises:
    HloError: when the groups are spelled in a way this reader does not know.
  """
  m = re.search(r"replica_groups=", attrs)
  if not m:
    return (tuple(range(num_devices)),)
  s = attrs[m.end():]
  if s.startswith("{"):
    body = s[:_balanced(s, 0, "{", "}")]
    groups = tuple(tuple(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([\d,]*)\}", body[1:-1]))
    return groups or (tuple(range(num_devices)),)
  if s.startswith("["):
    it = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
    if not it:
      raise HloError(f"cannot read iota replica groups {s[:60]!r}")
    ids = _iota(it.group(2), it.group(3))
    return tuple(tuple(int(v) for v in row) for row in ids.reshape([int(v) for v in it.group(1).split(",")]))
  if s.startswith("mesh["):
    return _mesh_groups(s)
  raise HloError(f"cannot read replica groups {s[:60]!r}")


def _iota(dims: str, perm: str | None) -> np.ndarray:
  shape = [int(v) for v in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  if perm:
    ids = ids.transpose([int(v) for v in perm.split(",")])
  return ids.reshape(-1)


def _mesh_groups(s: str) -> tuple[tuple[int, ...], ...]:
  """The groups of `mesh['a'=2,'b'=4] {'b'}` (XLA MeshAxesReplicaGroupList).

  Optionally `, device_ids=([2,4]T(1,0))` (an iota, reshaped and transposed, or a list) after the mesh and sub-axes
  `'a':(1)2`: the devices of the mesh array that differ only along the listed axes form a group.
  """
  m = re.match(r"mesh\[([^\]]*)\]", s)
  assert m is not None  # the caller saw `mesh[`, and XLA always closes the bracket
  axes = [(n, int(v)) for n, v in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))]
  rest = s[m.end():]
  ids = np.arange(math.prod(v for _, v in axes))
  dm = re.match(r",\s*device_ids=\(", rest)
  if dm:
    end = _balanced(rest, dm.end() - 1)
    inner = rest[dm.end():end - 1]
    it = re.fullmatch(r"\s*(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", inner)  # `[2,4]T(1,0)`: iota
    ids = _iota(it.group(1), it.group(2)) if it else np.array([int(v) for v in re.findall(r"\d+", inner)])
    rest = rest[end:]
  sel = re.match(r"\s*\{([^}]*)\}", rest)
  refs = re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", sel.group(1)) if sel else []
  names = [n for n, _ in axes]
  unknown = [n for n, _, _ in refs if n not in names]
  if unknown:
    raise HloError(f"replica groups name axes {unknown} that are not in {s[:80]!r}")
  # reshape every mesh axis into pieces (pre-size padding, a grouped sub-axis, the rest); groups vary the grouped
  # pieces, in the listed order, and share all others
  dims: list[int] = []
  grouped: dict[int, int] = {}
  for name, size in axes:
    whole = [i for i, (n, p, _) in enumerate(refs) if n == name and not p]
    if whole:
      grouped[whole[0]] = len(dims)
      dims.append(size)
      continue
    prefix = 1
    for pre, z, i in sorted((int(p), int(z), i) for i, (n, p, z) in enumerate(refs) if n == name):
      if pre != prefix:
        dims.append(pre // prefix)
        prefix = pre
      grouped[i] = len(dims)
      dims.append(z)
      prefix *= z
    if prefix != size:
      dims.append(size // prefix)
  order = [grouped[i] for i in range(len(refs))]
  keep = [d for d in range(len(dims)) if d not in order]
  n = math.prod(dims[d] for d in order)
  arr = ids.reshape(dims).transpose(keep + order).reshape(-1, n)
  return tuple(tuple(int(v) for v in row) for row in arr)


def source_target_pairs(attrs: str) -> tuple[tuple[int, ...], ...]:
  """A collective-permute's (source, target) device pairs.

  Args:
    attrs: the instruction's attribute text (`Instruction.attrs`).

  Returns:
    The pairs, in the text's order; () when it has none.
  """
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
  return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else ()
