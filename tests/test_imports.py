"""The architecture holds: no import circle anywhere, the layers import one way, the trainer stays small.

The import graph is read from the source (`ast`), not from what happens to be imported at run time: every `import`
and `from ... import` of a project module counts, inside functions too (a circle hidden in a function-level import
is still a circle). `from package import name` counts as an import of the submodule `package.name` when there is
one, else of the package.
"""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("optim", "models", "sharding", "research")

# Which rooms each room may import (besides itself). A room is a top-level package, or a folder of research/;
# research's single-file command-line tools (sample, export, quantize, plot, sweep, soak) are the room "tools".
LIBRARY = {"optim", "sharding", "models"}
ALLOWED = {
    "optim": set(),
    "sharding": set(),
    "models": {"sharding", "optim"},
    "research.entry": set(),  # the command lines' error discipline: standard library only, under every CLI
    "research.flags": LIBRARY | {"research.entry"},  # the command lines' flag rules (presets, registry, mesh specs)
    "research.data": LIBRARY | {"research.entry"},  # (docs_corpus's command line)
    "research.train": LIBRARY | {"research.data", "research.entry", "research.flags"},
    "research.verdicts": set(),  # the statistics that turn runs into verdicts: numpy and scipy only
    "research.bench": LIBRARY | {"research.data", "research.train", "research.entry", "research.flags",
                                 "research.verdicts"},
    "tools": LIBRARY | {"research.data", "research.train", "research.entry", "research.flags", "research.verdicts"},
    # an experiment may report what a benchmark measures (the methods study's step costs: research.bench.finetune)
    "research.experiments": LIBRARY | {"research.data", "research.train", "research.bench", "tools",
                                       "research.entry", "research.flags", "research.verdicts"},
}
# Modules a room may import from a room it may not import as a whole. The flash kernels are model math
# (models/flash.py); the ring schedule over the `context` mesh axis (sharding/context.py) reuses them.
ALLOWED_MODULES = {
    "sharding": {"models.flash"},
}


def modules() -> dict[str, str]:
  """{dotted module name: file path} of every module of the project's packages."""
  out = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for f in files:
        if f.endswith(".py"):
          parts = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
          out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, f)
  return out


def import_graph() -> dict[str, set[str]]:
  """{module: the project modules it imports}."""
  mods = modules()

  def resolve(name: str) -> str | None:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for name, path in mods.items():
    is_package = path.endswith("__init__.py")
    targets = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        targets |= {resolve(a.name) for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the package this module is in
          base = name.split(".") if is_package else name.split(".")[:-1]
          base = base[:len(base) - node.level + 1]
          source = ".".join(base + ([node.module] if node.module else []))
        else:
          source = node.module
        targets |= {resolve(f"{source}.{a.name}") for a in node.names}
    graph[name] = {t for t in targets if t and t != name}
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def room(module: str) -> str:
  parts = module.split(".")
  if parts[0] != "research":
    return parts[0]
  if module in ("research.entry", "research.flags"):
    return module
  if len(parts) > 1 and os.path.isdir(os.path.join(ROOT, "research", parts[1])):
    return f"research.{parts[1]}"
  return "tools" if len(parts) > 1 else "research"


def test_the_graph_sees_the_imports_it_must():
  graph = import_graph()
  assert "research.train.steps.step" in graph["research.train.loop"]
  assert "research.train.store.checkpoint" in graph["research.train.setup.resume"]  # a `from X import Name`
  # a `from package import submodule`
  assert "research.train.setup.adapters" in graph["research.train.setup.initial_state"]
  assert "research.data.tokenized" in graph["research.data"]
  assert "models.moe" in graph["models.transformer"] and "models.params" in graph["models.moe"]


def test_no_import_circle():
  assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert circles(graph) == [["a", "b", "c"]]
  assert circles({"a": {"b"}, "b": set()}) == []


def test_layers_import_one_way():
  wrong = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets if room(t) != room(m)
                 and room(t) not in ALLOWED[room(m)] and t not in ALLOWED_MODULES.get(room(m), ()))
  assert wrong == []


def test_a_module_allowed_alone_imports_nothing_of_the_room_that_imports_it():
  """models.flash is importable from sharding because it imports nothing of sharding (an arrow back would be a
  circle between the rooms)."""
  graph = import_graph()
  back = sorted(f"{m} -> {t}" for r, allowed in ALLOWED_MODULES.items() for m in allowed for t in graph[m]
                if room(t) == r)
  assert back == []


def test_sharding_context_imports_first():
  """Importing models.flash runs models/__init__.py, which imports models.attention and models.transformer, which
  import sharding.context: the graph above does not see that package arrow. From sharding.context first, they run
  while it is half loaded, so they import the module (`from sharding import context as cx`) and read its names at
  call time; a `from sharding.context import name` there fails here."""
  run = subprocess.run([sys.executable, "-c", "import sharding.context"], capture_output=True, text=True, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-2000:]


def test_every_room_is_in_the_table():
  assert {room(m) for m in modules()} - {"research"} == set(ALLOWED)


def test_the_error_discipline_imports_the_standard_library_only():
  """research/entry.py is under every command line, before its slow imports: no third-party module (jax, numpy)."""
  tree = ast.parse(open(os.path.join(ROOT, "research", "entry.py")).read())
  names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
  assert "os" in names and names <= sys.stdlib_module_names | {"__future__"}, names - sys.stdlib_module_names


def test_the_train_cli_imports_nothing_slow_before_its_signal_handlers():
  """`python -m research.train` runs the package's front door first: its first import (research/train/runtime/
  early.py) sets the SIGINT/SIGTERM handlers when the interpreter was started as that command, before the imports
  that take seconds, and it and what it imports are the standard library's or each other."""
  init = ast.parse(open(os.path.join(ROOT, "research", "train", "__init__.py")).read())
  first = next(n for n in init.body if isinstance(n, (ast.Import, ast.ImportFrom)))
  assert isinstance(first, ast.ImportFrom) and first.module == "research.train.runtime" and first.names[0].name == \
      "early"
  ours = {"research.entry", "research.train.runtime.signals"}
  for path in ("research/train/runtime/early.py", "research/train/runtime/signals.py", "research/entry.py"):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in names if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}} <= ours, path
  code = ("from research.train.runtime.early import as_command; print(as_command(['python', '-m', 'research.train', "
          "'--help']), as_command(['python', '-c', 'import research.train']))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
  assert out.split() == ["True", "False"]


# The trainer's rooms, lowest first: a room imports only rooms below it (config/ is the flags alone: it imports no
# other room of the trainer; setup/ builds a run from everything beneath it; the loop and the CLI sit on top).
TRAIN_ROOMS = ("runtime", "config", "observers", "steps", "store", "feed", "hooks", "setup", "vmapped", "loop",
               "command", "__main__", "")


def train_room(module: str) -> str | None:
  """The trainer room of a module of research/train ("" for the package itself), else None."""
  parts = module.split(".")
  return (parts[2] if len(parts) > 2 else "") if parts[:2] == ["research", "train"] else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
  """The imports from a trainer room to one above it in `TRAIN_ROOMS`."""
  found = []
  for module, targets in graph.items():
    a = train_room(module)
    for target in targets:
      b = train_room(target)
      if a is not None and b is not None and TRAIN_ROOMS.index(b) > TRAIN_ROOMS.index(a):
        found.append(f"{module} -> {target}")
  return sorted(found)


def test_the_trainer_rooms_import_downward():
  graph = import_graph()
  assert {train_room(m) for m in graph} - {None} <= set(TRAIN_ROOMS)  # every room is placed
  assert upward_imports(graph) == []


def test_the_downward_check_finds_an_upward_import():
  graph = {"research.train.config.checks": {"research.train.hooks.trackers"}, "research.train.hooks.trackers": set()}
  assert upward_imports(graph) == ["research.train.config.checks -> research.train.hooks.trackers"]


def test_the_trainer_stays_readable():
  """Every trainer file ≤ 300 lines, every function in it ≤ 60, the loop's story `_train` among them."""
  folder = os.path.join(ROOT, "research", "train")
  long_files, long_functions = [], []
  paths = [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".py")]
  for f in sorted(paths):
    if f.endswith(".py"):
      src = open(os.path.join(folder, f)).read()
      if len(src.splitlines()) > 300:
        long_files.append(f)
      long_functions += [f"{f}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(src))
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.end_lineno - n.lineno + 1 > 60]
  assert long_files == [] and long_functions == []
  loop = ast.parse(open(os.path.join(folder, "loop.py")).read())
  assert any(isinstance(n, ast.FunctionDef) and n.name == "_train" for n in loop.body)


def test_every_trainer_module_is_listed_where_a_reader_looks():
  """Each module of research/train/ is named in its package's docstring (research/train/__init__.py for the top-level
  ones) and in the site map's research/train row (docs/architecture.md), so neither can fall behind the tree."""
  folder = os.path.join(ROOT, "research", "train")
  map_page = os.path.join(ROOT, "docs", "architecture.md")
  readme_row = next(line for line in open(map_page) if line.startswith("| `research/train/` |"))
  missing = []
  for d, _, fs in os.walk(folder):
    doc = ast.get_docstring(ast.parse(open(os.path.join(d, "__init__.py")).read())) or ""
    if d == folder:
      doc = doc.replace("command.py ", "command.py")  # (its column)
    for f in sorted(fs):
      if f.endswith(".py") and f not in ("__init__.py", "__main__.py"):
        where = os.path.relpath(os.path.join(d, f), folder)
        if f not in doc:
          missing.append(f"{where}: not in its package docstring")
        if f not in readme_row:
          missing.append(f"{where}: not in the site's map (docs/architecture.md)")
  assert missing == []
