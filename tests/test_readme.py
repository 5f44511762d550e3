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
  env = {**os.environ, "COLUMNS": "120"}  # one column of groups (wider terminals get several side by side)
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


def test_the_first_hours_resume_step_is_accepted_by_the_resume_check(tmp_path):
  """Step 3 of "First hour" resumes runs/default (made by step 1, `make run`) with its ARGS: the resume check the
  trainer runs (research/train/setup/resume.py) must accept them, recording the change in the history."""
  import dataclasses
  import shlex
  import tyro
  from research.train.store import rundir
  from research.train.config import TrainConfig
  from research.train.setup.resume import check_resume
  block = re.search(r"```bash\n(.*?)```", section("First hour"), re.S).group(1)
  step3 = next(line for line in block.splitlines() if line.split("#")[-1].strip().startswith("3."))
  args = shlex.split(re.search(r'ARGS="([^"]*)"', step3).group(1))
  make = open(os.path.join(ROOT, "Makefile")).read()
  run_line = re.search(r"^run:.*\n((?:\t.*\n)+)", make, re.M).group(1)
  assert "research.train" in run_line and "$(ARGS)" in run_line

  def meta(cfg):
    return {"train": dataclasses.asdict(cfg), "model_config": {"moe": None}, "corpus": {"fingerprint": "same"},
            "mesh": "data=8", "devices": [0] * 8}

  first = tyro.cli(TrainConfig, args=[])
  again = tyro.cli(TrainConfig, args=args)
  changed = check_resume(json_roundtrip(meta(first)), meta(again), "runs/default")
  assert changed == {"steps": [first.training.steps, again.training.steps]}
  assert rundir.amend_history({}, changed, 200) == [{"from_step": 200, "changed": changed}]


def json_roundtrip(x):
  import json
  return json.loads(json.dumps(x))
