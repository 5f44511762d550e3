"""research/experiments/compare.py and base.py: each arm against a baseline (the paired differences' mean ± std, their
paired t statistic against scipy's, the 2-std verdict and the sign count), the markdown table, write_experiment's
order, and the flags every experiment's Config takes from `Base`."""

import dataclasses
import importlib
import json
import math

import numpy as np
import pytest
from scipy import stats

from research.experiments import NAMES, common

EXPERIMENTS = NAMES
RNG = np.random.default_rng(0)
BASE = 2.0 + 0.05 * RNG.standard_normal(6)
FINALS = {"base": BASE,
          "below": BASE - 0.1 + 0.01 * RNG.standard_normal(6),  # clearly lower in every seed
          "above": BASE + 0.1 + 0.01 * RNG.standard_normal(6),  # clearly higher in every seed
          "level": BASE + np.array([0.03, -0.02, 0.01, -0.04, 0.02, 0.0])}  # mean 0, spread 0.026
RESULT = {"seeds": {s: {"arms": {a: {"final": float(v[i]), "other": 2 * float(v[i])} for a, v in FINALS.items()}}
                    for i, s in enumerate((0, 1, 2, 3, 4, 5))}}


@pytest.mark.parametrize("arm,verdict,lower", [("below", "lower", 6), ("above", "higher", 0), ("level", "level", 2)])
def test_each_arm_against_the_baseline_matches_scipy(arm, verdict, lower):
  v = common.against(RESULT, "base")[arm]
  diffs = FINALS[arm] - FINALS["base"]
  d = stats.describe(diffs)  # mean and the unbiased (ddof 1) variance
  np.testing.assert_allclose(v.d, (d.mean, math.sqrt(d.variance)), rtol=1e-12)
  # the verdict reads |mean| against 2 std, i.e. the paired t statistic against 2·sqrt(n)
  t = stats.ttest_rel(FINALS[arm], FINALS["base"]).statistic
  np.testing.assert_allclose(v.d[0] / (v.d[1] / math.sqrt(v.n)), t, rtol=1e-10)
  assert (abs(t) > 2 * math.sqrt(v.n)) == (verdict != "level")
  assert (v.verdict, v.lower, v.n) == (verdict, lower, 6)
  assert v.pm() == f"{d.mean:+.4f} ± {math.sqrt(d.variance):.4f}"
  assert common.seed_paired(RESULT, arm, "base") == v.d


def test_against_skips_the_baseline_keeps_the_order_and_reads_a_key_or_a_function():
  vs = common.against(RESULT, "base")
  assert list(vs) == ["below", "above", "level"]
  assert common.delta_cell(vs, "base") == "–" and common.delta_cell(vs, "above") == vs["above"].pm()
  by_key = common.against(RESULT, "base", "other", arms=("level",))
  by_fn = common.against(RESULT, "base", lambda r: r["other"], arms=("level",))
  assert list(by_key) == ["level"] and by_key["level"].diffs == by_fn["level"].diffs
  np.testing.assert_allclose(by_key["level"].d, 2 * np.asarray(vs["level"].d), rtol=1e-12)


def test_one_seed_has_no_spread_and_reads_as_resolved():
  one = {"seeds": {0: RESULT["seeds"][0]}}
  v = common.versus(one, "level", "base")
  assert v.d[1] == 0.0 and v.n == 1 and v.verdict == ("level" if v.d[0] == 0 else "higher")


def test_table():
  assert common.table(["a", "b"], [["1", "2"], ["3", "4"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


def test_write_experiment_writes_the_raw_numbers_before_any_formatting(tmp_path):
  @dataclasses.dataclass
  class Config(common.Base):
    out: str = str(tmp_path)
    seeds: tuple[int, ...] = (0,)

  def broken(result):
    raise KeyError("a formatting bug")

  with pytest.raises(KeyError):
    common.write_experiment(Config(), "x", "Q?", {"n": 1}, broken, lambda r: [], lambda r: None)
  assert json.loads((tmp_path / "results.json").read_text()) == {"n": 1}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_config_extends_base_with_its_own_results_dir(name):
  config = importlib.import_module(f"research.experiments.{name}").Config
  assert issubclass(config, common.Base)
  names = [f.name for f in dataclasses.fields(config)]
  assert names[:2] == ["smoke", "out"]
  out = config().out
  assert out is None if name == "moe_disco" else out == f"research/results/{name}"
