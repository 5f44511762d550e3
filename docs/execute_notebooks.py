"""Render the notebooks for the site: execute each notebooks/<name>.ipynb and store it, outputs and all, as
docs/notebooks/<name>.ipynb, which `make docs` renders without executing anything.

    .venv/bin/python docs/execute_notebooks.py            # the notebooks whose stored copy is missing or stale
    .venv/bin/python docs/execute_notebooks.py quickstart # one, even if its copy is current

A copy is current when its code and markdown cells equal the source notebook's (tests/docs/test_site.py checks
every copy that way, so a changed notebook without a re-rendered copy fails the tests). Each notebook runs in a fresh
kernel of this interpreter with 8 simulated CPU devices, in an empty temporary working directory, as the tests run
it; the copy records the commit and the date it was executed in its metadata.
"""

import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
SOURCE, RENDERED = ROOT / "notebooks", ROOT / "docs" / "notebooks"
# the kernel's start-up, as the tests' (tests/conftest.py): 8 simulated CPU devices before the notebook's first cell
DEVICES = 'import jax\njax.config.update("jax_num_cpu_devices", 8)\n'


def cells(nb) -> list[tuple[str, str]]:
  """The notebook's cells as (type, source) pairs: what a rendered copy must share with its source."""
  return [(c.cell_type, c.source) for c in nb.cells]


def is_current(name: str) -> bool:
  """Whether docs/notebooks/<name>.ipynb exists and has the source notebook's cells."""
  copy = RENDERED / f"{name}.ipynb"
  if not copy.exists():
    return False
  return cells(nbformat.read(copy, as_version=4)) == cells(nbformat.read(SOURCE / f"{name}.ipynb", as_version=4))


def execute(name: str) -> None:
  """Executes notebooks/<name>.ipynb in a fresh kernel and writes the executed copy (only if no cell failed)."""
  nb = nbformat.read(SOURCE / f"{name}.ipynb", as_version=4)
  with tempfile.TemporaryDirectory() as work:
    startup = Path(work, "ipython", "profile_default", "startup")
    startup.mkdir(parents=True)
    (startup / "00-devices.py").write_text(DEVICES)
    Path(work, "cwd").mkdir()
    env = {**os.environ, "IPYTHONDIR": str(Path(work, "ipython")), "JAX_PLATFORMS": "cpu"}
    client = NotebookClient(nb, kernel_name="python3", timeout=900, resources={"metadata": {"path": f"{work}/cwd"}})
    client.execute(env=env)
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  if errors:
    raise SystemExit(f"notebooks/{name}.ipynb failed: {errors[0].ename}: {errors[0].evalue}")
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
  nb.metadata["optlab"] = {"executed": datetime.date.today().isoformat(), "commit": commit.strip(), "on": "cpu"}
  RENDERED.mkdir(parents=True, exist_ok=True)
  nbformat.write(nb, RENDERED / f"{name}.ipynb")


def main(names: list[str]) -> None:
  """Executes the named notebooks, or every notebook whose rendered copy is missing or stale."""
  todo = names or [p.stem for p in sorted(SOURCE.glob("*.ipynb")) if not is_current(p.stem)]
  for name in todo:
    print(f"executing notebooks/{name}.ipynb", flush=True)
    execute(name)
  print(f"{len(todo)} executed; copies in {RENDERED.relative_to(ROOT)}/")


if __name__ == "__main__":
  main(sys.argv[1:])
