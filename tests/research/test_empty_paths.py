"""A path flag given as "" (an unset shell variable: `--init-from "$BASE"`) is refused in one line before any work,
never read as "no flag" (a run from scratch) or as the working directory."""

import os

import pytest
from refusals import bad

from research.train import main


@pytest.mark.parametrize("flag", ["--init-from", "--tokenizer"])
def test_an_empty_path_is_refused_in_one_line(tmp_path, capsys, flag):
  msg = bad(tmp_path, capsys, flag, "", "--steps", "1")
  assert msg == f"error: {flag} is empty (an unset shell variable?): give a path, or leave the flag out", msg


def test_an_empty_out_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)  # where an empty path would have written
  with pytest.raises(SystemExit) as e:
    main(["--out", "", "--model", "tiny", "--steps", "1", "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err == ["error: --out is empty (an unset shell variable?): give a path, or leave the "
                                       "flag out"], err
  assert not os.listdir(tmp_path)
