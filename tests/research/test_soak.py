"""The kill-anywhere soak, short: a run signalled at random instants (seeded) and restarted ends with the losses of
an uninterrupted run, bit for bit, each step logged once, no damaged checkpoint, disk use within keep + 1; under
SIGTERM every stop exits 143 with the step it reached committed. (The committed figure, N >= 50 signals:
research/results/soak_*.md.)"""

import json

import pytest

from research import soak


@pytest.mark.parametrize("how", ["kill", "term"])
def test_signalled_and_restarted_runs_end_exactly_like_an_uninterrupted_one(tmp_path, capsys, how):
  report = tmp_path / "new" / "report.md"  # --report's folders are made
  status = soak.main(["--signal", how, "--kills", "2", "--steps", "10", "--out", str(tmp_path),
                      "--report", str(report)])
  text = capsys.readouterr().out
  assert report.read_text().strip() == text.strip()
  rounds = [json.loads(line) for line in open(tmp_path / f"rounds_{how}_10steps_seed0.jsonl")]
  assert status == 0 and "| 2 | " in text and "No problems" in text, text
  assert sum(len(r["stops"]) for r in rounds) == 2 and all(r["exact"] and not r["problems"] for r in rounds)
  if how == "term":
    assert all(s["exit"] == 143 and "stopped_at" in s for r in rounds for s in r["stops"])


def test_the_report_lists_every_problem():
  rounds = [{"round": 0, "lives": 3, "exact": False, "problems": ["metrics differ from the uninterrupted run"],
             "stops": [{"where": "steps", "committed": [2, 4, 6], "exit": -9}]}]
  text = soak.report(soak.Config(kills=1), rounds, 10.0)
  assert "| 1 | 1 | 0/1 | 0 | 1 | 0 | 3 (keep 2) | 1 |" in text and "- round 0: metrics differ" in text
