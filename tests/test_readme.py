"""The README says what the code does: its quick start, flags, presets, optimizers and commands exist, and its lists
are the registries' (a flag, preset or optimizer that disappears, or a new one left out, fails here)."""

import importlib.util
import os
import re
import subprocess
import sys

from models import PRESETS
from optim import OPTIMIZERS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def section(title: str) -> str:
  start = README.index(f"\n## {title}\n")
  end = README.find("\n## ", start + 1)
  return README[start:end if end > 0 else None]


def train_flags() -> set[str]:
  env = {**os.environ, "COLUMNS": "250"}
  out = subprocess.run([sys.executable, "-m", "research.train", "--help"], capture_output=True, text=True,
                       env=env, cwd=ROOT).stdout
  return set(re.findall(r"(--[a-z][\w.-]*)", out))


def test_quick_start_is_two_make_commands_that_exist():
  block = re.search(r"```bash\n(.*?)```", section("Quick start"), re.S).group(1)
  commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
  assert commands == ["make run", "make test"]
  makefile = open(os.path.join(ROOT, "Makefile")).read()
  assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
  assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_documented_flags_exist():
  flags = train_flags()
  documented = set(re.findall(r"`(--[a-z][\w.-]*)", section("Training CLI") + section("First hour")))
  documented |= set(re.findall(r"python -m research\.train[^\n`]*?(--[a-z][\w.-]*)", README))
  documented = {f for f in documented if not f.startswith("--no-")} - {"--help"}
  assert documented and documented <= flags, sorted(documented - flags)
  assert {"--moe.num-experts", "--moe.top-k", "--moe.d-expert", "--peak-flops", "--progress"} <= flags


def test_presets_and_optimizers_listed_are_the_registries():
  model_row = next(line for line in section("Training CLI").splitlines() if line.startswith("| `--model`"))
  assert re.findall(r"`(\w+)`", model_row.split("|")[3].split(";")[0]) == list(PRESETS)
  listed = re.search(r"\(`optim\.OPTIMIZERS`\):\n(.*?)\.\n", section("Optimizers"), re.S).group(1)
  assert re.findall(r"`(\w+)`", listed) == sorted(OPTIMIZERS)


def test_modules_the_readme_runs_exist():
  modules = set(re.findall(r"python -m ([a-z]\w*(?:\.[a-z]\w*)*)", README))  # not research.experiments.<name>
  assert {"research.train", "research.plot", "research.sample", "research.export"} <= modules
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  assert not missing, missing
