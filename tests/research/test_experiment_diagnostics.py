"""research/experiments/diagnostics: the smoke run (as notebooks/diagnostics.ipynb ran it) reads every diagnostic out of
the train CLI's records: update sizes, spectra, sharpness against 2/lr and the noise scale, for each contender."""

import math

import pytest

from research.experiments import diagnostics


@pytest.fixture(scope="module")
def result(notebooks):
  """`diagnostics.main(diagnostics.Config(smoke=True))`, as notebooks/diagnostics.ipynb ran it."""
  return notebooks.run("diagnostics").result


def test_the_notebooks_run_reports_every_diagnostic(result):
  rows = {r["name"]: r for r in result["rows"]}
  assert rows, "no contender summarized"
  for name, r in rows.items():
    for key in ("val_loss", "update_rms_over_lr_early", "update_rms_over_lr_late", "relative_update_late",
                "lambda_max_late", "two_over_lr_late", "overlap_late", "b_simple_late"):
      assert math.isfinite(r[key]), (name, key)
    assert 0 <= r["overlap_late"] <= 1 and r["relative_update_late"] > 0


def test_summarize_reads_the_records_it_is_given():
  recs = [{"step": 10, "lr": 0.5, "val_loss": 2.0, "watch/updates/rms/blocks/w_DF": [1.0, 3.0],
           "watch/relative_update/blocks/w_DF": [0.1, 0.3], "sharpness/lambda_max": 4.0, "sharpness/overlap": 0.25,
           "gns/b_simple_ema": 7.0, "spectra/updates/orthogonality_error/blocks/w_DF": [0.5, 0.5],
           "spectra/updates/sv_quantiles/blocks/w_DF": [[0, 0, 1, 0, 2], [0, 0, 1, 0, 4]]}]
  row = diagnostics.summarize("x", recs, 0.5)
  assert row["update_rms_over_lr_late"] == 4.0  # mean over layers 2.0, over lr 0.5
  assert row["relative_update_late"] == pytest.approx(0.2) and row["two_over_lr_late"] == 4.0
  assert row["sv_max_over_median_late"] == 3.0 and row["lambda_max_late"] == 4.0 and row["b_simple_late"] == 7.0
