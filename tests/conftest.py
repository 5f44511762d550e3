"""8 simulated CPU devices for every test (the backend started with them), and one persistent
compilation cache for the session: runs of the same config (determinism, resume, subprocesses, the
notebook kernel, which inherit these variables) compile once."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# created by the first process only (xdist workers inherit it) and removed when that process ends
OWN_CACHE = None if "JAX_COMPILATION_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="optlab-jax-cache-")
if OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# one OpenBLAS thread per LAPACK call (subprocesses, kernels inherit it): 8 simulated devices each running jaxlib's
# LAPACK kernels (SOAP's eigh, Dion's QR, Kron's solves) with a spinning pool apiece oversubscribe the CPU ~10x
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# XLA:CPU's LLVM backend at -O0 (subprocesses and kernels inherit it): the suite is compile-bound (tiny models, many
# distinct programs), and -O0 halves the compile time: tests/sharding/test_sharded_model.py took 28 s of CPU instead of
# 54-65 s. It changes code generation only (not the HLO passes, shardings or collectives the tests inspect).
# XLA:CPU's legacy elemental emitters instead of its MLIR fusion emitters, and one LLVM module per program instead of
# a split for parallel codegen: at -O0 they took a 2-step `tiny` muon run's compile from 8.9 s to 3.4 s (85 programs;
# the run itself 12.9 s -> 6.9 s). They change how fusions are emitted (the MLIR emitters also wrap lone elementwise
# ops in fusions of their own, so the compiled HLO text differs), not the partitioning, collectives, FLOPs or values.
FAST_COMPILE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
                "xla_cpu_parallel_codegen_split_count": "1"}
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given, *(f"--{k}={v}" for k, v in FAST_COMPILE.items() if k not in _given)])
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# started here, so every test sees the same 8 devices whichever runs first (code that sets its own count before
# the backend starts, as `research.train` does when run as a script, cannot change it under the tests)
assert len(jax.devices()) == 8


# ---- notebooks: each executed once per session, by `notebooks.run(name)` -------------------------------------------
# An experiment notebook runs its experiment at smoke size; the notebook's own test checks the notebook (it executes,
# it plots) and the experiment's tests check the `result` it computed, so the smoke run happens once per session.

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "optlab-test-python"  # a spec of our own, so no user or system "python3" can pick another interpreter
# run in the kernel before the notebook: the 8 simulated devices every test here has, the backend started, so a
# smoke run in a notebook is the very program the tests compile (run alone, a notebook gets 1 device)
STARTUP = """import jax
jax.config.update("jax_num_cpu_devices", 8)
assert len(jax.devices()) == 8
"""
# appended to the executed copy only: hands the notebook's `result` (plain data) to the experiment's tests
SAVE_RESULT = """import pickle as _pickle
if "result" in globals():
  with open({path!r}, "wb") as _f:
    _pickle.dump(result, _f)
"""


@dataclasses.dataclass
class Executed:
  nb: object  # the executed nbformat notebook (without the appended cell)
  cwd: pathlib.Path  # the kernel's working directory: empty unless the notebook wrote to it
  tmp: pathlib.Path  # the kernel's TMPDIR
  result: object  # the notebook's `result` variable, None if it has none

  @property
  def stdout(self) -> str:
    return "".join(o.text for c in self.nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and o.name == "stdout")


class NotebookRunner:
  def __init__(self, root: pathlib.Path):
    self.root, self.done = root, {}
    spec_dir = root / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "optlab test", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    startup = root / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-devices.py").write_text(STARTUP)

  def run(self, name: str) -> Executed:
    """notebooks/<name>.ipynb executed (once per session); fails on any error output."""
    if name not in self.done:
      import nbformat
      from jupyter_client.kernelspec import KernelSpecManager
      from nbclient import NotebookClient
      work = self.root / name
      cwd, tmp = work / "cwd", work / "tmp"
      cwd.mkdir(parents=True)
      tmp.mkdir()
      assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == sys.executable
      nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
      n = len(nb.cells)
      nb.cells.append(nbformat.v4.new_code_cell(SAVE_RESULT.format(path=str(work / "result.pkl"))))
      env = {**os.environ, "IPYTHONDIR": str(self.root / "ipython"), "TMPDIR": str(tmp), "JAX_PLATFORMS": "cpu"}
      NotebookClient(nb, kernel_name=KERNEL, timeout=300, resources={"metadata": {"path": str(cwd)}}).execute(env=env)
      nb.cells = nb.cells[:n]
      errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
      assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
      pkl = work / "result.pkl"
      result = pickle.loads(pkl.read_bytes()) if pkl.exists() else None
      self.done[name] = Executed(nb, cwd, tmp, result)
    return self.done[name]


@pytest.fixture(scope="session")
def notebooks(tmp_path_factory):
  """`notebooks.run(name)`: notebooks/<name>.ipynb executed once per session in a kernel on this interpreter."""
  with pytest.MonkeyPatch.context() as mp:
    root = tmp_path_factory.mktemp("notebooks")
    mp.setenv("JUPYTER_PATH", str(root / "jupyter"))  # where the kernel spec is looked up
    yield NotebookRunner(root)


# ---- workers: `make test` runs the suite in 2 processes (pytest-xdist, --dist loadgroup) -----------------------------
# A unit of work goes to one worker whole: a test module (its module fixtures run once), or all the tests that read one
# notebook's run (the notebook's own tests and its experiment's tests), so each notebook still executes once. The units
# come from our own scheduler, not from `xdist_group` marks: xdist 3.8 passes a mark's group to its scheduler by
# appending it to the test's node id, which pytest 9.2's structured node ids ignore (pytest-dev/pytest-xdist#1386), so
# the marks were silently dropped and every notebook and module fixture ran once per worker.


def work_unit(nodeid: str) -> str:
  """The unit of work of a test, from its node id ("tests/research/test_experiment_peft.py::test_protocol")."""
  path = nodeid.split("::")[0]
  module = pathlib.PurePosixPath(path).stem
  if module.startswith("test_experiment_") and (NOTEBOOKS / f"{module[len('test_experiment_'):]}.py").exists():
    return "notebook-" + module[len("test_experiment_"):]
  param = nodeid[nodeid.index("[") + 1:-1] if nodeid.endswith("]") and "[" in nodeid else None
  if module == "test_notebooks" and param is not None and (NOTEBOOKS / f"{param}.py").exists():
    return "notebook-" + param
  return path


class _Scheduler:
  """Registered only where xdist is loaded (`-p no:xdist` would reject an unknown hook in a conftest)."""

  def pytest_xdist_make_scheduler(self, config, log):
    if config.getvalue("dist") != "loadgroup":
      return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
      ordered = False

      def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

      def _assign_work_unit(self, node):
        # the longest units first, so no worker is left with a long one at the end: xdist orders units by their number
        # of tests, which puts a notebook (3–6 tests, each up to minutes) behind every module of small tests
        if not self.ordered:
          for scope in sorted(self.workqueue, key=lambda unit: (not unit.startswith("notebook-"),
                                                                 not unit.startswith("tests/research/"))):
            self.workqueue.move_to_end(scope)
          self.ordered = True
        super()._assign_work_unit(node)

    return WorkUnits(config, log)


def pytest_configure(config):
  if config.pluginmanager.hasplugin("xdist"):
    config.pluginmanager.register(_Scheduler(), "optlab-scheduler")


def pytest_unconfigure(config):
  if OWN_CACHE:
    import shutil
    shutil.rmtree(OWN_CACHE, ignore_errors=True)
