"""`python -m research.plot RUN_DIR`: a picture of the run's curves, and one-line errors."""

import json

import pytest

from research import plot


def _run(tmp_path, name, n=5):
  d = tmp_path / name
  d.mkdir()
  recs = [{"step": s, "loss": 5.0 - 0.3 * s, "lr": 1e-3, **({"tokens_per_s": 1e3} if s > 1 else {}),
           **({"val_loss": 5.0 - 0.25 * s} if s % 2 == 0 else {})} for s in range(1, n + 1)]
  (d / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + '\n{"step": 6, "lo')  # last line cut short
  return d


def test_plots_one_or_several_runs(tmp_path, capsys):
  a, b = _run(tmp_path, "a"), _run(tmp_path, "b", 3)
  plot.main([str(a)])
  assert capsys.readouterr().out.strip() == str(a / "curves.png")
  assert (a / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  plot.main([str(a), str(b), "--out", str(tmp_path / "cmp.png")])
  assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_a_missing_run_is_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    plot.main([str(tmp_path / "nope")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1


def test_an_out_in_new_folders_is_written(tmp_path, capsys):
  a = _run(tmp_path, "a")
  out = tmp_path / "figs" / "new" / "a.png"
  plot.main([str(a), "--out", str(out)])
  assert capsys.readouterr().out.strip() == str(out) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_file_with_other_lines_is_refused_before_the_out_is_checked(tmp_path, capsys):
  """A traceback pasted into metrics.jsonl (or another file's bytes) is not plotted as if the run logged it; the bad
  run is named even when the default --out could not be written either."""
  a = _run(tmp_path, "a")
  with open(a / "metrics.jsonl", "a") as f:
    f.write('\nTraceback (most recent call last):\n  File "x.py", line 1\n{"step": 7, "loss": 1.0, "lr": 0.1}\n')
  (a / "curves.png").mkdir()  # the default --out is a directory: refused too, but after the run
  with pytest.raises(SystemExit) as e:
    plot.main([str(a)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1
  assert err.startswith(f"error: {a / 'metrics.jsonl'}: 3 line(s) are not metrics records")
