"""The README and the site say what the code does: the quick start, flags, presets, optimizers and commands exist, and
the lists are the registries' (a flag, preset or optimizer that disappears, or a new one left out, fails here). Every
`python -m` command of both is checked against its parser in tests/docs/test_commands.py."""

import importlib.util
import os
import re
import subprocess
import sys

from models import PRESETS
from optim import OPTIMIZERS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def page(path: str) -> str:
  """A page of the site (docs/<path>)."""
  return open(os.path.join(ROOT, "docs", path)).read()


def section(title: str, text: str = README) -> str:
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end > 0 else None]


def test_the_readme_is_a_welcome_and_every_page_is_in_the_site():
  assert len(README.splitlines()) <= 250
  docs = os.path.join(ROOT, "docs")
  pages = {os.path.relpath(os.path.join(d, f), docs) for d, _, fs in os.walk(docs) for f in fs if f.endswith(".md")}
  linked = set(re.findall(r"\]\(docs/([\w/.-]+\.md)", README))
  assert linked and linked <= pages, sorted(linked - pages)


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
  documented = set(re.findall(r"`(--[a-z][\w.-]*)", page("train-cli.md") + section("First hour")))
  documented = {f for f in documented if not f.startswith("--no-")} - {"--help"}
  assert documented and documented <= flags, sorted(documented - flags)
  assert {"--moe.num-experts", "--moe.top-k", "--moe.d-expert", "--peak-flops", "--progress"} <= flags


def test_presets_and_optimizers_listed_are_the_registries():
  model_row = next(line for line in page("train-cli.md").splitlines() if line.startswith("| `--model`"))
  assert re.findall(r"`(\w+)`", model_row.split("|")[3].split(";")[0]) == list(PRESETS)
  listed = re.search(r"\(`optim\.OPTIMIZERS`\):\n(.*?)\.\n", page("optimizers/index.md"), re.S).group(1)
  assert re.findall(r"`(\w+)`", listed) == sorted(OPTIMIZERS)


def test_modules_the_readme_and_the_site_run_exist():
  text = README + "".join(open(os.path.join(d, f)).read() for d, _, fs in os.walk(os.path.join(ROOT, "docs"))
                          for f in fs if f.endswith(".md"))
  modules = set(re.findall(r"python -m ([a-z]\w*(?:\.[a-z]\w*)*)", text))  # not research.experiments.<name>
  assert {"research.train", "research.plot", "research.sample", "research.export"} <= modules
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  assert not missing, missing


def test_the_first_hours_resume_step_is_accepted_by_the_resume_check(tmp_path):
  """Step 3 of "First hour" resumes runs/default (made by step 1, `make run`) with its ARGS: the resume check the
  trainer runs (research/train/setup/resume.py) must accept them, recording the change in the history."""
  import dataclasses
  import shlex

  import tyro

  from research.train.config import TrainConfig
  from research.train.setup.resume import check_resume
  from research.train.store import rundir
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
