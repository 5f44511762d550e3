"""The train CLI as a new user meets it: a complete --help, flags that override one field, and console output
that reads line by line when stdout is not a terminal."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import tyro

from models import PRESETS
from optim import OPTIMIZERS
from research.bench.timing import trainer_plan
from research.train import RunError, TrainConfig, main
from research.train.config import MoEFlags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def help_text():
  env = {**os.environ, "COLUMNS": "120"}  # one column of groups (wider terminals get several side by side)
  p = subprocess.run([sys.executable, "-m", "research.train", "--help"], capture_output=True, text=True, env=env,
                     cwd=REPO)
  assert p.returncode == 0, p.stderr
  return p.stdout


def options(help_text):
  """{--flag: its description without the default}, from tyro's boxed help."""
  out, flag = {}, None
  for line in help_text.splitlines():
    body = line.strip("│ ").rstrip()
    m = re.match(r"(--[\w.-]+)", body)
    if m and line.lstrip().startswith("│ --"):
      flag = m.group(1)
      out[flag] = body[len(m.group(0)):]
    elif flag and line.startswith("│") and body and not body.startswith("─"):
      out[flag] += " " + body
    elif not line.startswith("│"):
      flag = None
  return {k: re.sub(r"\(default: .*?\)|\(repeatable\)|\{.*?\}\|?\w*|\b[A-Z]+\b|\[.*?\]", "", v).strip()
          for k, v in out.items()}


def test_help_describes_every_flag_and_lists_the_registries(help_text):
  assert help_text.startswith("usage: python -m research.train")
  assert REPO not in help_text and "/research/train/" not in help_text  # no machine paths
  opts = options(help_text)
  assert len(opts) >= 60
  undocumented = [k for k, v in opts.items() if len(v.split()) < 2 and k != "--help"]
  assert not undocumented, undocumented
  model_help = opts["--model"]
  assert all(p in model_help for p in PRESETS)
  assert all(o in opts["--optimizer"] for o in OPTIMIZERS)
  assert not re.search(r"\(default[^)]*\)[^│\n]*\(default", help_text)  # a default is shown once


def _mcfg(cfg):
  return trainer_plan(cfg).model


def test_moe_flags_override_single_fields_of_the_preset():
  base = PRESETS["moe_tiny"].moe
  c = _mcfg(TrainConfig(model="moe_tiny", moe=MoEFlags(num_experts=4)))
  assert (c.moe.num_experts, c.moe.d_expert, c.moe.top_k) == (4, base.d_expert, base.top_k)
  c = _mcfg(TrainConfig(model="moe_tiny", moe=MoEFlags(router="sigmoid", bias_rate=1e-3)))
  assert (c.moe.router, c.moe.bias_rate, c.moe.num_experts, c.moe.d_expert) == ("sigmoid", 1e-3, 8, base.d_expert)
  assert _mcfg(TrainConfig(model="moe_tiny", moe=MoEFlags(num_experts=0))).moe is None
  c = _mcfg(TrainConfig(model="tiny", d_ff=96, moe=MoEFlags(num_experts=4, top_k=1)))
  assert (c.moe.num_experts, c.moe.top_k, c.d_ff, c.d_model) == (4, 1, 96, PRESETS["tiny"].d_model)
  with pytest.raises(RunError, match="--model tiny is dense: give --moe.num-experts"):
    _mcfg(TrainConfig(model="tiny", moe=MoEFlags(top_k=1)))
  # every --moe.* flag is one MoEConfig field, but PAD-Net's partition flags (research/train/setup/padnet.py)
  flags = {f.name for f in dataclasses.fields(MoEFlags)} - set(MoEFlags.PARTITION)
  assert flags == set(PRESETS["moe_tiny"].moe.__dataclass_fields__)


def test_console_output_is_plain_lines_off_a_terminal(tmp_path, capsys):
  main(["--model", "tiny", "--steps", "6", "--batch-size", "8", "--seq-len", "32", "--mesh", "data=-1",
        "--log-every", "2", "--eval-every", "3", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert "\r" not in out
  memory, *lines = out.strip().splitlines()
  assert memory.startswith("memory: the step needs an estimated "), memory  # the pre-flight's line, first
  assert [ln.split(" |")[0] for ln in lines[:-2]] == ["step 2/6", "step 3/6", "step 4/6", "step 6/6"]
  assert "val_loss" in lines[1] and "val_loss" in lines[3] and "val_loss" not in lines[0]
  assert "tokens/s" in lines[0]  # the window to step 2 holds one whole step after the compiling one
  assert re.match(r"memory: measured [\d.]+ (GiB|MiB) \(process peak RSS\) against the estimate [\d.]+ (GiB|MiB) "
                  r"\([\d.]+x\)$", lines[-2]), lines[-2]  # the pre-flight checked against what the run took
  assert re.match(r"done: step 6, val_loss [\d.]+ \(step 3\) -> [\d.]+ \(step 6\), [\d,]+ tokens/s and MFU "
                  r"[\d.]+% averaged over the run \(peak: ", lines[-1]), lines[-1]
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["6"]  # no step-1 checkpoint


def test_no_record_reports_throughput_from_less_than_a_whole_step(tmp_path):
  from research.train import run
  records = run(TrainConfig(model="tiny", steps=13, batch_size=8, seq_len=32, mesh="data=-1", log_every=1,
                            eval_every=13, progress=False, out=str(tmp_path)))
  assert "tokens_per_s" not in records[0] and "mfu" not in records[0]  # step 1 compiles: no window yet
  assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in records[1:])  # (a tiny model on a CPU)
  last = records[-1]
  assert 0 < last["run_mfu"] < 1 and "matmul rate measured on this cpu" in last["peak_source"]
  # the steady state: windows (11,12] and (12,13], which start 10 steps after the compiling step 1
  assert last["steady_after"] == 10 and last["steady_tokens_per_s"] > 0 and 0 < last["steady_mfu"] < 1
  assert "steady_tokens_per_s" not in records[-2]  # the last record only


def test_one_evaluation_reads_as_one(tmp_path, capsys):
  main(["--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--mesh", "data=-1",
        "--no-progress", "--out", str(tmp_path)])
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert re.match(r"done: step 2, val_loss [\d.]+ at step 2 \(one evaluation\)", last), last


def test_profile_traces_the_chosen_steps_and_names_their_top_ops(tmp_path, capsys):
  """--profile 3:2 writes a jax.profiler trace (xplane, readable by TensorBoard / XProf) into the run directory and
  prints the heaviest XLA ops of steps 3-4; a bad value is one line before anything starts."""
  import glob
  main(["--model", "tiny", "--n-layers", "1", "--steps", "5", "--batch-size", "8", "--seq-len", "32", "--mesh",
        "data=-1", "--eval-every", "5", "--eval-batches", "1", "--no-progress", "--peak-flops", "1e12",
        "--profile", "3:2", "--out", str(tmp_path / "run")])
  err = capsys.readouterr().err
  line, = [x for x in err.splitlines() if x.startswith("profile:")]
  assert line.startswith(f"profile: steps 3-4 traced in {tmp_path / 'run' / 'profile'} ")
  assert " ms" in line.split("top ops by device time, summed over devices: ")[1]  # at least one op with its time
  assert glob.glob(str(tmp_path / "run" / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  for bad, says in (("0:2", "STEP and COUNT must be at least 1"), ("x", "give STEP:COUNT"),
                    ("199:5", "steps 199-203 are not all within --steps 200")):
    with pytest.raises(SystemExit) as e:
      main(["--model", "tiny", "--profile", bad, "--out", str(tmp_path / bad)])
    out = capsys.readouterr().err
    assert e.value.code == 2 and out.count("\n") == 1 and says in out and not (tmp_path / bad).exists()


def test_an_on_off_model_flag_is_a_switch_and_still_takes_true_or_false():
  """--moe.pad, --qk-norm, ...: given bare they turn on; `--flag True` / `False` as before; left out, the preset's."""
  parse = lambda *argv: tyro.cli(TrainConfig, args=list(argv))
  assert (parse().moe.pad, parse().model.qk_norm) == (None, None)
  assert parse("--moe.pad").moe.pad is True and parse("--moe.pad", "--steps", "3").training.steps == 3
  assert parse("--moe.pad", "True").moe.pad is True and parse("--moe.pad", "False").moe.pad is False
  assert parse("--qk-norm").model.qk_norm is True and parse("--qk-norm", "false").model.qk_norm is False
  with pytest.raises(SystemExit):
    parse("--moe.pad", "maybe")
