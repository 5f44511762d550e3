"""The mesh's axis names are constants of sharding/mesh.py (`DATA`, `STAGE`, `FSDP`, `EXPERT`, `CONTEXT`, `TENSOR`),
used everywhere a mesh axis is named: a new axis is one line there, and renaming one cannot miss a site. The scan
reads the code's syntax for the places a mesh axis is named (a mesh's shape, a size dict, a PartitionSpec, a tuple of
axes, an axis-name lookup), so the same words used as logical axis names ("expert"), flags (--data) or table columns
are not mistaken for them."""

import ast
import os

from sharding import mesh as mesh_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AXES = set(mesh_module.AXES)
HOME = os.path.join("sharding", "mesh.py")


def _axis(node) -> bool:
  return isinstance(node, ast.Constant) and node.value in AXES


def _sized(node) -> bool:
  """A mesh's shape (`mesh.shape`, `m.shape`) or a size dict (`sizes`)."""
  return (isinstance(node, ast.Attribute) and node.attr == "shape") or (isinstance(node, ast.Name) and
                                                                        node.id == "sizes")


def axis_literals(source: str) -> list[int]:
  """Lines where a string literal names a mesh axis.

  Args:
    source: Python code.

  Returns:
    The line of each literal used as one: an index or `.get` of a mesh's shape or a size dict, an argument of `P` /
    `PartitionSpec` / `.index` on axis names / `axis=`, a dict whose keys are all axes, a tuple or list of axes only.
  """
  lines = []
  for node in ast.walk(ast.parse(source)):
    hits: list = []
    if isinstance(node, ast.Subscript) and _sized(node.value):
      hits = [node.slice]
    elif isinstance(node, ast.Call):
      f = node.func
      name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
      if name in ("P", "PartitionSpec"):
        hits = [a for arg in node.args for a in (arg.elts if isinstance(arg, ast.Tuple) else [arg])]
      elif name == "get" and isinstance(f, ast.Attribute) and _sized(f.value):
        hits = node.args[:1]
      elif name == "index" and isinstance(f, ast.Attribute) and getattr(f.value, "attr", "") == "axis_names":
        hits = node.args[:1]
      hits += [k.value for k in node.keywords if k.arg in ("axis", "axis_name", "spmd_axis_name")]
    elif isinstance(node, ast.Dict) and node.keys and all(_axis(k) for k in node.keys):
      hits = list(node.keys)
    elif isinstance(node, (ast.Tuple, ast.List)) and node.elts and all(_axis(e) for e in node.elts):
      hits = list(node.elts)
    lines += [h.lineno for h in hits if _axis(h)]
  return sorted(set(lines))


def test_no_mesh_axis_is_spelled_outside_sharding_mesh():
  found = []
  for room in ("optim", "models", "sharding", "research"):
    for sub, _, files in os.walk(os.path.join(ROOT, room)):
      for f in sorted(files):
        path = os.path.join(sub, f)
        rel = os.path.relpath(path, ROOT)
        if f.endswith(".py") and rel != HOME:
          found += [f"{rel}:{line}" for line in axis_literals(open(path).read())]
  assert found == []


def test_the_scan_finds_each_way_an_axis_is_named():
  code = ('a = mesh.shape["data"]\nb = sizes.get("fsdp", 1)\nc = P("tensor", None)\nd = P(("data", "fsdp"))\n'
          'e = {"data": 2, "stage": 1}\nf = ("context",)\ng = mesh.axis_names.index("expert")\n'
          'h = jax.lax.psum(x, axis_name="data")\n'
          'ok = (row["context"], {"expert": 1, "muon": 2}, ("expert", "embed"), flag == "data", "stage")\n')
  assert axis_literals(code) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_the_axes_keep_their_names_and_order():
  """The mesh specs users write and the device order (`tensor` fastest) rest on these names in this order."""
  assert mesh_module.AXES == ("data", "stage", "fsdp", "expert", "context", "tensor")
  assert (mesh_module.DATA, mesh_module.STAGE, mesh_module.FSDP, mesh_module.EXPERT, mesh_module.CONTEXT,
          mesh_module.TENSOR) == mesh_module.AXES
