"""Every experiment's smoke size runs and returns what its full size would tabulate."""

from research.experiments import muon_vs_adamw


def test_muon_vs_adamw_smoke():
  rows = muon_vs_adamw.main(muon_vs_adamw.Config(smoke=True))
  assert [r["optimizer"] for r in rows] == ["adamw", "muon"]
  for r in rows:  # both learn: below the uniform-byte loss ln 256 = 5.55 and falling between evaluations
    (_, first), (_, last) = r["val_curve"]
    assert last < first < 5.0 and last == r["final_val_loss"]
