"""The paired notebooks: each .ipynb matches its jupytext .py, carries no outputs, and executes cleanly."""

import json
import pathlib
import re
import sys

import jupytext
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
PAIRED = sorted(p.stem for p in NOTEBOOKS.glob("*.py"))
EXPERIMENTS = [n for n in PAIRED if n != "quickstart"]  # one per research/experiments/<name>.py
KERNEL = "optlab-test-python"  # a spec of our own, so no user or system "python3" can pick another interpreter


def _cells(nb):
  return [(c.cell_type, c.source) for c in nb.cells]


@pytest.mark.parametrize("name", PAIRED)
def test_pair_in_sync(name):
  py = jupytext.read(NOTEBOOKS / f"{name}.py")
  ipynb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  assert _cells(ipynb) == _cells(py), (
      f"notebooks/{name}.ipynb and .py differ; regenerate with `jupytext --sync notebooks/{name}.py`")
  assert "py:percent" in ipynb.metadata.get("jupytext", {}).get("formats", ""), "ipynb is not paired with the .py"


@pytest.mark.parametrize("name", PAIRED)
def test_committed_without_outputs(name):
  ipynb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  dirty = [i for i, c in enumerate(ipynb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
  assert not dirty, f"notebooks/{name}.ipynb has outputs in cells {dirty}; clear them before committing"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
  """A kernelspec that runs ipykernel in this very interpreter, found first through JUPYTER_PATH."""
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
          "display_name": "optlab test", "language": "python"}
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's run directory lands under tmp_path
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == sys.executable
  return KERNEL


def _run(name, kernel_name, cwd):
  """The executed notebook; fails on any error output."""
  nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  NotebookClient(nb, kernel_name=kernel_name, timeout=300, resources={"metadata": {"path": str(cwd)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
  return nb


def _execute(name, kernel_name, cwd):
  """The executed notebook's stdout."""
  nb = _run(name, kernel_name, cwd)
  return "".join(o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs
                 if o.output_type == "stream" and o.name == "stdout")


def test_quickstart_executes_and_learns(kernel, tmp_path):
  stdout = _execute("quickstart", kernel, tmp_path)
  assert "CpuDevice(id=7)" in stdout, "the notebook did not get its 8 simulated devices"
  marker = re.search(r"^loss: (\S+) -> (\S+)", stdout, re.M)
  assert marker, f"no 'loss: first -> last' line in the notebook's output:\n{stdout}"
  first, last = map(float, marker.groups())
  assert last < first - 0.5, f"20 steps should cut the loss well below its start: {first} -> {last}"
  runs = list(tmp_path.glob("optlab-quickstart-*"))
  assert len(runs) == 1 and (runs[0] / "metrics.jsonl").exists() and (runs[0] / "loss.png").exists()


def test_every_experiment_has_a_notebook():
  experiments = pathlib.Path(__file__).resolve().parents[2] / "research" / "experiments"
  names = {p.stem for p in experiments.glob("*.py")} - {"__init__", "common"}
  assert names <= set(EXPERIMENTS), f"experiments without a notebook: {sorted(names - set(EXPERIMENTS))}"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_notebook_executes_and_plots(kernel, tmp_path, name):
  """Each experiment notebook runs its experiment at smoke size and shows at least one figure."""
  nb = _run(name, kernel, tmp_path)
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
  assert images, f"notebooks/{name} showed no plot"
