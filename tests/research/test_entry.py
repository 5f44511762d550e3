"""The command lines' one error discipline (research/entry.py): an output path that cannot be written is refused in
one line before any work (bench, experiments, plot, soak); Ctrl-C is one line and exit 130, a second one ends the
process at once; a warning is one line without a source path (a file or unwritable $OPTLAB_CACHE included)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from research import entry
from research.experiments import NAMES

pytestmark = pytest.mark.xdist_group("entry")


def cli(*args, env=None):
  return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})})


def not_warnings(err: str) -> list[str]:
  """stderr's lines but one-line warnings (`warning: `; a library's unrelated warning on some machine is one too)."""
  return [line for line in err.strip().splitlines() if not line.startswith("warning: ")]


def one_error_line(p, timeout=300):
  out, err = p.communicate(timeout=timeout)
  lines = not_warnings(err)
  assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (p.args, p.returncode, err)
  return lines[0]


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
  """A file where a directory must be: each command answers in one line (seconds: its imports), writes nothing."""
  blocker = tmp_path / "a-file"
  blocker.write_text("kept")
  under = str(blocker / "sub")
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
  procs = {  # started together: their imports overlap
    "bench": cli("-m", "research.bench", "optim", "--out", f"{under}/optim.md"),
    "bench hf": cli("-m", "research.bench", "hf", "--out", f"{under}/hf.md"),  # its out inside an Args dataclass
    "experiment": cli("-m", "research.experiments.pad_net", "--out", under),
    "no seeds": cli("-m", "research.experiments.exfusion", "--smoke", "--seeds"),
    "plot": cli("-m", "research.plot", str(tmp_path / "run"), "--out", f"{under}/curves.png"),
    "soak": cli("-m", "research.soak", "--out", under),
  }
  lines = {name: one_error_line(p) for name, p in procs.items()}
  assert f"{blocker} is a file, not a directory" in lines["bench"] and lines["bench hf"] == lines["bench"].replace(
      "optim.md", "hf.md")
  assert lines["experiment"] == f"error: --out {under}: {blocker} is a file, not a directory"
  assert lines["no seeds"] == "error: --seeds: give at least one value"
  assert f"{blocker} is a file" in lines["plot"] and f"{blocker} is a file" in lines["soak"]
  assert sorted(os.listdir(tmp_path)) == ["a-file", "run"] and os.listdir(tmp_path / "run") == ["metrics.jsonl"]
  assert blocker.read_text() == "kept"


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


def _can_bind() -> bool:
  """Whether a file can be bind-mounted over itself in a user and mount namespace (the probe file is removed)."""
  if not shutil.which("unshare"):
    return False
  fd, probe = tempfile.mkstemp(prefix="optlab-bind-")
  os.close(fd)
  try:
    return subprocess.run(["unshare", "-rm", "sh", "-c", 'mount --bind "$0" "$0"', probe],
                          capture_output=True).returncode == 0
  finally:
    os.remove(probe)


BIND = _can_bind()


@pytest.mark.skipif(not BIND, reason="needs a user and mount namespace (unshare -rm) to bind a file read-only")
def test_an_existing_read_only_file_is_refused_before_any_work(tmp_path):
  """A report file that cannot be overwritten (bound read-only: root ignores file modes) is refused in one line, in
  a writable folder, and is left as it was."""
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
  out = tmp_path / "curves.png"
  out.write_text("kept")
  p = subprocess.Popen(
      ["unshare", "-rm", "sh", "-c", f'mount --bind "{out}" "{out}" && mount -o remount,bind,ro "{out}" && '
                                     f'exec "{sys.executable}" -m research.plot "{tmp_path / "run"}" --out "{out}"'],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert one_error_line(p) == f"error: --out {out} is not writable"
  assert out.read_text() == "kept"


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
  assert p.returncode == 130 and not_warnings(err) == [want], err


def test_an_experiment_stopped_by_ctrl_c_says_so_in_one_line(tmp_path):
  p = cli("-c", "from research.experiments import common, exfusion\n"
               "def main(cfg):\n  print('working', flush=True)\n  return exfusion.main(cfg)\n"
               "common.cli(main, exfusion.Config)", "--smoke")
  assert p.stdout.readline() == "working\n"  # in its main, the handlers set
  p.send_signal(signal.SIGINT)
  _, err = p.communicate(timeout=120)
  assert p.returncode == 130 and not_warnings(err) == ["error: interrupted (Ctrl-C)"], err


KEPT = """
import os, time
from research.experiments import common, exfusion

def main(cfg):
  if os.environ.get("SAVE"):
    common.save_partial(cfg, runs={})  # what a full run saves once its first seeds finished
  print("working", flush=True)
  time.sleep(60)

common.cli(main, exfusion.Config)
"""


@pytest.mark.parametrize("saved", [False, True])
def test_a_full_experiment_stopped_by_ctrl_c_says_what_it_kept(tmp_path, saved):
  """The line says partial.json keeps what finished only when this config's partial.json is there."""
  p = cli("-c", KEPT, "--out", str(tmp_path), env={"SAVE": "1"} if saved else None)
  assert p.stdout.readline() == "working\n"
  p.send_signal(signal.SIGINT)
  _, err = p.communicate(timeout=60)
  kept = (f"what finished is kept in {tmp_path / 'partial.json'}; rerun the same command to go on" if saved else
          "nothing finished was kept: a rerun starts over")
  assert p.returncode == 130 and not_warnings(err) == [f"error: interrupted (Ctrl-C); {kept}"], err


def test_a_cache_that_is_a_file_is_one_warning_line_and_the_run_goes_on(tmp_path):
  (tmp_path / "cache").write_text("not a directory")
  p = cli("-m", "research.train", "--model=tiny", "--n-layers=1", "--steps=2", "--batch-size=8", "--seq-len=32",
          "--eval-every=2", "--eval-batches=1", "--peak-flops=1e12", "--no-progress", f"--out={tmp_path / 'run'}",
          env={"OPTLAB_CACHE": str(tmp_path / "cache")})
  _, err = p.communicate(timeout=300)
  assert p.returncode == 0, err
  lines = err.strip().splitlines()  # one warning line for the cache (another library's would be one line too)
  assert all(line.startswith("warning: ") for line in lines) and lines.count(
      f"warning: the cache {tmp_path / 'cache'} cannot be written (a file, not a directory): nothing is cached there "
      f"this run (built corpora, compiled programs); set $OPTLAB_CACHE to a writable directory") == 1, err
  assert (tmp_path / "cache").read_text() == "not a directory"


def test_a_warning_is_shown_as_one_line_without_its_source():
  import io
  f = io.StringIO()
  entry.show_warning(UserWarning("first line\nsecond"), UserWarning, "/some/path.py", 3, file=f)
  assert f.getvalue() == "warning: first line\n"


EXPERIMENTS = NAMES


def test_experiment_flags_are_checked_before_the_work():
  import importlib

  from research.experiments import common, pad_net
  for name in EXPERIMENTS:  # every experiment's defaults, full and smoke, pass
    config = importlib.import_module(f"research.experiments.{name}").Config
    common.check_config(config()), common.check_config(config(smoke=True))
  refusals = {"seeds": ((), "--seeds: give at least one value"),
              "steps": (0, "--steps must be >= 1, got 0"),
              "pretrain_steps": (-1, "--pretrain-steps must be >= 1, got -1"),
              "val_batch": (0, "--val-batch must be >= 1, got 0"),
              "lrs": ((1e-3, float("nan")), "--lrs: a learning rate must be a positive finite number, got nan"),
              "pretrain_lr": (0.0, "--pretrain-lr: a learning rate must be a positive finite number, got 0.0")}
  for field, (value, says) in refusals.items():
    with pytest.raises(entry.UsageError) as e:
      common.check_config(pad_net.Config(**{field: value}))
    assert str(e.value) == says
  others = {("scalability", "lm_lrs", ()): "--lm-lrs: give at least one value",
            ("peft", "adapter_lrs", ()): "--adapter-lrs: give at least one value",
            ("pad_net", "score_batches", 0): "--score-batches must be >= 1, got 0",
            ("moe_disco", "evals", 0): "--evals must be >= 1, got 0",
            ("data_mixing", "every", -2): "--every must be >= 1, got -2",
            ("peft", "rank", 0): "--rank must be >= 1, got 0"}
  for (name, field, value), says in others.items():
    config = importlib.import_module(f"research.experiments.{name}").Config
    with pytest.raises(entry.UsageError) as e:
      common.check_config(config(**{field: value}))
    assert str(e.value) == says
  from research.experiments import muon_on_moe, scalability
  common.check_config(muon_on_moe.Config(also_lrs=()))  # no extra lrs: the tuned grid alone
  common.check_config(scalability.Config(tune_seed=0))  # a seed may be 0


def test_the_librarys_refusals_of_a_commands_values_are_one_line(capsys):
  """An experiment's or bench's work calls the library with its user's values: the library's own refusal (a
  ValueError class of optim, models, sharding, research.data or research.train) is one `error:` line, exit 2 (the
  train CLI's discipline); a ValueError of anything else is a bug and keeps its traceback."""
  from models.padnet import PadNetError
  from optim import UnknownOptimizerError
  from sharding import ShardingError
  for error in (PadNetError("the dynamic ratio 2.0 must lie in (0, 1]\nmore"), UnknownOptimizerError("x"),
                ShardingError("y")):
    with pytest.raises(SystemExit) as e:
      with entry.one_line_errors(library=True):
        raise error
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err == [f"error: {str(error).splitlines()[0]}"], err
  with pytest.raises(ValueError, match="a bug"):  # numpy's, jax's, a plain one: not bad input
    with entry.one_line_errors(library=True):
      raise ValueError("a bug")
  with pytest.raises(PadNetError):  # without `library` only the errors named
    with entry.one_line_errors():
      raise PadNetError("z")
