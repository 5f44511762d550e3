"""The command lines' one error discipline (research/entry.py): an output path that cannot be written is refused in
one line before any work (bench, experiments, plot, soak); Ctrl-C is one line and exit 130, a second one ends the
process at once; a warning is one line without a source path (a file or unwritable $OPTLAB_CACHE included)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from research import entry

pytestmark = pytest.mark.xdist_group("entry")


def cli(*args, env=None):
  return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})})


def one_error_line(p, timeout=300):
  out, err = p.communicate(timeout=timeout)
  lines = err.strip().splitlines()
  assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (p.args, p.returncode, err)
  return lines[0]


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
  """A file where a directory must be: each command answers in one line (seconds: its imports), writes nothing."""
  blocker = tmp_path / "a-file"
  blocker.write_text("kept")
  under = str(blocker / "sub")
  procs = {  # started together: their imports overlap
    "bench": cli("-m", "research.bench", "optim", "--out", f"{under}/optim.md"),
    "bench hf": cli("-m", "research.bench", "hf", "--out", f"{under}/hf.md"),  # its out inside an Args dataclass
    "experiment": cli("-m", "research.experiments.pad_net", "--out", under),
    "no seeds": cli("-m", "research.experiments.exfusion", "--smoke", "--seeds"),
    "plot": cli("-m", "research.plot", str(tmp_path), "--out", f"{under}/curves.png"),
    "soak": cli("-m", "research.soak", "--out", under),
  }
  lines = {name: one_error_line(p) for name, p in procs.items()}
  assert f"{blocker} is a file, not a directory" in lines["bench"] and lines["bench hf"] == lines["bench"].replace(
      "optim.md", "hf.md")
  assert lines["experiment"] == f"error: --out {under}: {blocker} is a file, not a directory"
  assert lines["no seeds"] == "error: --seeds: give at least one value"
  assert f"{blocker} is a file" in lines["plot"] and f"{blocker} is a file" in lines["soak"]
  assert sorted(os.listdir(tmp_path)) == ["a-file"] and blocker.read_text() == "kept"


def test_writable_paths_are_checked_without_creating_anything(tmp_path):
  entry.writable_file(str(tmp_path / "new" / "deeper" / "x.md"))  # missing folders are fine: created later
  entry.writable_dir(str(tmp_path / "new" / "deeper"))
  entry.writable_file(None)
  with pytest.raises(entry.OutputError, match="is a directory"):
    entry.writable_file(str(tmp_path))
  (tmp_path / "f").write_text("")
  with pytest.raises(entry.OutputError, match="is a file, not a directory"):
    entry.writable_dir(str(tmp_path / "f" / "x"), "--report")
  assert sorted(os.listdir(tmp_path)) == ["f"]


DRIVER = """
import sys, time
from research import entry

def main():
  if sys.argv[1] == "swallow":  # a library that catches KeyboardInterrupt and goes on
    try:
      print("started", flush=True)
      time.sleep(60)
    except KeyboardInterrupt:
      pass
  print("started", flush=True)
  time.sleep(60)

entry.command(main, interrupted="what was kept")
"""


@pytest.mark.parametrize("how", ["once", "swallow"])
def test_ctrl_c_is_one_line_and_a_second_one_ends_at_once(how):
  p = cli("-c", DRIVER, how)
  assert p.stdout.readline() == "started\n"
  p.send_signal(signal.SIGINT)
  if how == "swallow":  # the first was handled (and swallowed): now the second
    assert p.stdout.readline() == "started\n"
    p.send_signal(signal.SIGINT)
  _, err = p.communicate(timeout=30)
  want = {"once": "error: interrupted (Ctrl-C); what was kept",
          "swallow": "error: interrupted again: stopped at once"}[how]
  assert p.returncode == 130 and err.strip().splitlines() == [want], err


def test_an_experiment_stopped_by_ctrl_c_says_so_in_one_line(tmp_path):
  p = cli("-c", "from research.experiments import common, exfusion\n"
               "def main(cfg):\n  print('working', flush=True)\n  return exfusion.main(cfg)\n"
               "common.cli(main, exfusion.Config)", "--smoke")
  assert p.stdout.readline() == "working\n"
  time.sleep(2)  # into the work (its first compile)
  p.send_signal(signal.SIGINT)
  _, err = p.communicate(timeout=120)
  assert p.returncode == 130 and err.strip().splitlines() == ["error: interrupted (Ctrl-C)"], err


def test_a_cache_that_is_a_file_is_one_warning_line_and_the_run_goes_on(tmp_path):
  (tmp_path / "cache").write_text("not a directory")
  p = cli("-m", "research.train", "--model=tiny", "--n-layers=1", "--steps=2", "--batch-size=8", "--seq-len=32",
          "--eval-every=2", "--eval-batches=1", "--peak-flops=1e12", "--no-progress", f"--out={tmp_path / 'run'}",
          env={"OPTLAB_CACHE": str(tmp_path / "cache")})
  _, err = p.communicate(timeout=300)
  assert p.returncode == 0, err
  assert err.strip().splitlines() == [
      f"warning: the cache {tmp_path / 'cache'} cannot be written (a file, not a directory): nothing is cached there "
      f"this run (built corpora, compiled programs); set $OPTLAB_CACHE to a writable directory"], err
  assert (tmp_path / "cache").read_text() == "not a directory"


def test_a_warning_is_shown_as_one_line_without_its_source():
  import io
  f = io.StringIO()
  entry.show_warning(UserWarning("first line\nsecond"), UserWarning, "/some/path.py", 3, file=f)
  assert f.getvalue() == "warning: first line\n"


EXPERIMENTS = ["badam", "badam_finetune", "data_mixing", "depth_expansion", "exfusion", "moe_design", "moe_disco",
               "muon_on_moe", "optimizers", "pad_net", "peft", "quantization", "upcycling", "scalability"]


def test_experiment_flags_are_checked_before_the_work():
  import importlib

  from research.experiments import common, pad_net
  for name in EXPERIMENTS:  # every experiment's defaults, full and smoke, pass
    config = importlib.import_module(f"research.experiments.{name}").Config
    common.check_config(config()), common.check_config(config(smoke=True))
  refusals = {"seeds": ((), "--seeds: give at least one value"),
              "steps": (0, "--steps must be at least 1, got 0"),
              "pretrain_steps": (-1, "--pretrain-steps must be at least 1, got -1"),
              "val_batch": (0, "--val-batch must be at least 1, got 0"),
              "lrs": ((1e-3, float("nan")), "--lrs: a learning rate must be a positive finite number, got nan"),
              "pretrain_lr": (0.0, "--pretrain-lr: a learning rate must be a positive finite number, got 0.0")}
  for field, (value, says) in refusals.items():
    with pytest.raises(entry.UsageError) as e:
      common.check_config(pad_net.Config(**{field: value}))
    assert str(e.value) == says
