"""The check the CLI tests share for bad input: exit status 2, one line starting "error: ", no run directory left."""

import os

import pytest

from research.train import main


def bad(tmp_path, capsys, *args, out=None):
  """The one error line of a refused run of --model tiny; a run directory it would have created is not left behind."""
  out = out or str(tmp_path / "run")
  existed = os.path.exists(out)
  with pytest.raises(SystemExit) as e:
    main([*args, "--out", out, "--model", "tiny", "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
  assert existed or not os.path.exists(out), f"a refused run left {out} behind"
  return err[0]
