"""The paired notebooks: each .ipynb matches its jupytext .py, carries no outputs, and executes cleanly (in a kernel
on this interpreter, once per session: `notebooks` in tests/conftest.py)."""

import pathlib
import re

import jupytext
import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
PAIRED = sorted(p.stem for p in NOTEBOOKS.glob("*.py"))
GUIDES = ("quickstart", "pretrained")  # walkthroughs; every other notebook runs one research/experiments/<name>.py
EXPERIMENTS = [n for n in PAIRED if n not in GUIDES]


def test_every_experiment_has_its_notebook_and_every_notebook_its_experiment():
  """The experiments as `research.experiments.NAMES` finds them (each a command: base.py, compare.py and the like
  are not) and the notebooks that are not guides are the same names."""
  from research.experiments import NAMES
  assert sorted(EXPERIMENTS) == sorted(NAMES), set(EXPERIMENTS) ^ set(NAMES)


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


def test_quickstart_executes_and_learns(notebooks):
  run = notebooks.run("quickstart")
  stdout = run.stdout
  assert "CpuDevice(id=7)" in stdout, "the notebook did not get its 8 simulated devices"
  marker = re.search(r"^loss: (\S+) -> (\S+)", stdout, re.M)
  assert marker, f"no 'loss: first -> last' line in the notebook's output:\n{stdout}"
  first, last = map(float, marker.groups())
  assert last < first - 0.5, f"20 steps should cut the loss well below its start: {first} -> {last}"
  runs = list(run.tmp.glob("optlab-quickstart-*"))
  assert len(runs) == 1 and (runs[0] / "metrics.jsonl").exists() and (runs[0] / "loss.png").exists()


def test_pretrained_path_executes_end_to_end(notebooks):
  """notebooks/pretrained: a random tiny Llama in the HF format is imported onto a mesh, fine-tuned (the loss falls),
  sampled and exported, and the export reads back with the same logits."""
  run = notebooks.run("pretrained")
  out = run.stdout
  assert "['config.json', 'model.safetensors']" in out and "'LlamaForCausalLM'" in out
  assert "True P(None, 'fsdp', 'tensor')" in out, out
  first, last = map(float, re.search(r"^loss: (\S+) -> (\S+)", out, re.M).groups())
  assert last < first - 1.0, (first, last)
  assert re.search(r"^sampled: '.+'$", out, re.M)
  assert "round trip gives the same logits: True" in out
  assert not any(run.cwd.iterdir())  # everything went to a temporary directory


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_notebook_executes_and_plots(notebooks, name):
  """Each experiment notebook runs its experiment at smoke size, shows at least one figure and writes nothing to
  its working directory (the experiment's tests check the result it computed)."""
  run = notebooks.run(name)
  nb = run.nb
  assert run.result is not None, f"notebooks/{name} has no `result`"
  assert not any(run.cwd.iterdir()), f"notebooks/{name} wrote {sorted(p.name for p in run.cwd.iterdir())}"
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
  assert images, f"notebooks/{name} showed no plot"
