"""research/experiments/pad_net: the smoke run's invariants (as notebooks/pad_net.ipynb ran it) and the refusal of a
ratio PAD-Net cannot use. (Resuming a stopped full run: `common.run_seeds`,
tests/research/test_experiments_common.py.)"""

import math

import pytest

from models import padnet
from research.experiments import pad_net


@pytest.fixture(scope="module")
def result(notebooks):
  """`pad_net.main(pad_net.Config(smoke=True))`, as notebooks/pad_net.ipynb ran it."""
  return notebooks.run("pad_net").result


def test_every_arm_starts_from_the_same_pretrained_moe_and_sees_equal_tokens(result):
  s = pad_net.SMOKE
  run = result["seeds"][0]
  assert list(run["arms"]) == ["moe", "pad30"] and list(result["seeds"]) == [0]
  assert result["tokens"]["finetune"] == s["steps"] * s["batch_size"] * s["seq_len"]
  assert run["arms"]["moe"]["start"] == run["pretrained"]  # the MoE arm is the pretrained model itself
  for arm, r in run["arms"].items():
    steps = [step for step, _ in r["curve"]]
    assert steps[0] == 0 and steps[-1] == s["steps"], arm
    assert math.isfinite(r["final"]) and math.isfinite(r["stdlib_final"])


def test_the_partition_reached_its_share_and_changed_the_function(result):
  run = result["seeds"][0]
  moe, pad = run["arms"]["moe"], run["arms"]["pad30"]
  total = moe["counts"]["dynamic"]
  assert total == 2 * 3 * 8 * 64 * 64  # 2 layers x 3 stacks x 8 experts x D 64 x F 64
  kept = total - int((1.0 - 0.3) * total)  # the code's count: int((1 − d)·n) made static (58983, round(d·n) = 58982)
  assert pad["counts"]["dynamic"] == kept and pad["counts"]["masked"] == total - kept
  assert pad["counts"]["static"] == 2 * 3 * 64 * 64
  assert len(pad["shares"]) == pad_net.SMOKE["rounds"] and pad["shares"][-1] == pytest.approx(0.3, abs=1e-5)
  assert pad["shares"][0] == pytest.approx(0.3 ** 0.5, abs=1e-5)  # exponential: r^(t/T)
  assert pad["start"]["docs"] != moe["start"]["docs"]  # 70% of the entries now take the experts' mean
  assert len(pad["phi"]) == 2 and all(0 < x < 2 for x in pad["phi"])


def test_tables_findings_and_plot(result):
  lines = pad_net.tables(result)
  assert sum(line.startswith("| PAD-Net, 30% dynamic") for line in lines) == 2  # the arm and its lr-grid row
  assert len(pad_net.findings(result)) == 2
  fig = pad_net.plot(result)
  assert len(fig.axes) == 2 and all(ax.lines for ax in fig.axes)


def test_a_ratio_padnet_cannot_use_is_refused():
  with pytest.raises(padnet.PadNetError, match="dynamic ratio must lie in"):
    pad_net.sized(pad_net.Config(ratios=(0.5, 0.0)))


def test_a_ratio_outside_0_1_is_one_line_before_any_work(tmp_path):
  """--ratios 2.0 was a 23-line PadNetError traceback raised mid-run; the flag's rule now refuses it first."""
  import subprocess
  import sys
  run = subprocess.run([sys.executable, "-m", "research.experiments.pad_net", "--ratios", "2.0", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True)
  assert run.returncode == 2 and run.stderr.strip() == "error: --ratios must be in (0, 1], got 2.0"
  assert not (tmp_path / "out").exists()
