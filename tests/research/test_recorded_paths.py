"""The paths a run records mean the same from anywhere (issue 48): --data, --tokenizer and --init-from are stored
absolute in config.json with the tokenizer's sha256; research.sample and research.export, run from another directory
that holds a different tok/tokenizer.json, use the recorded one; a recorded tokenizer edited since is one error line
naming it (exit 2) unless --tokenizer is given; a resume with the same relative paths, or their absolute forms, is no
change of settings; a run written before (relative paths) resolves them against the directory it started in."""

import json
import os
import shutil

import pytest
from tiny_text import byte_bpe

from research import export, sample
from research.train import TrainConfig, run
from research.train.config import paths
from research.train.store.rundir import changed_settings

TINY = dict(model="tiny", n_layers=1, steps=4, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=1,
            warmup_steps=1, eval_batches=1, progress=False, mesh="data=-1", tracker=("none",))
DOCS = [f"def f{i}(x):\n    return x * {i} + 1\n" * 20 for i in range(30)]


def _bpe(path, docs, vocab_size):
  byte_bpe(path, docs, vocab_size)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run trained from `home` with relative --data and --tokenizer (and --out), stopped at step 2, resumed from
  there with the same relative flags to step 3, then with their absolute forms to step 4; and `elsewhere`, another
  working directory whose tok/tokenizer.json is a different tokenizer."""
  root = tmp_path_factory.mktemp("recorded")
  home, elsewhere = root / "home", root / "elsewhere"
  (home / "data").mkdir(parents=True)
  for i, d in enumerate(DOCS):
    (home / "data" / f"d{i}.py").write_text(d)
  _bpe(home / "tok" / "tokenizer.json", DOCS, 200)
  _bpe(elsewhere / "tok" / "tokenizer.json", ["class Other:\n    pass\n" * 50, "import os, sys\n" * 50], 120)
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("OPTLAB_CACHE", str(root / "cache"))
    mp.chdir(home)
    relative = dict(data=("data",), tokenizer="tok/tokenizer.json", out="run", **TINY)
    run(TrainConfig(stop_at=2, **relative))
    run(TrainConfig(stop_at=3, **relative))  # refused as a change of settings if the paths compared as typed
    records = run(TrainConfig(**{**relative, "data": (str(home / "data"),),
                                 "tokenizer": str(home / "tok" / "tokenizer.json")}))
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  return home, elsewhere


def test_config_json_records_absolute_paths_and_the_tokenizers_sha256(trained):
  home, _ = trained
  meta = json.load(open(home / "run" / "config.json"))
  tok = str(home / "tok" / "tokenizer.json")
  assert meta["train"]["data"]["paths"] == [str(home / "data")] and meta["train"]["data"]["tokenizer"] == tok
  assert meta["files"]["tokenizer"] == {"path": tok, "sha256": paths.sha256(tok)}
  assert meta.get("history", []) == []  # neither resume changed a setting


def _sample(argv, capsys):
  capsys.readouterr()
  sample.main([*argv, "--prompt", "def f", "--max-new-tokens", "8", "--temperature", "0"])
  return capsys.readouterr().out


def test_tools_in_another_directory_use_the_recorded_tokenizer(trained, tmp_path, monkeypatch, capsys):
  home, elsewhere = trained
  run_dir, tok = str(home / "run"), str(home / "tok" / "tokenizer.json")
  monkeypatch.chdir(elsewhere)  # its tok/tokenizer.json is another tokenizer
  own, other = _sample([run_dir, "--tokenizer", tok], capsys), _sample([run_dir, "--tokenizer", "tok"], capsys)
  assert own != other  # the two tokenizers give different text: the check below can tell them apart
  assert _sample([run_dir], capsys) == own
  export.main([run_dir, str(tmp_path / "hf")])
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (home / "tok" / "tokenizer.json").read_bytes()


def test_a_recorded_tokenizer_edited_since_is_refused_in_one_line(trained, tmp_path, monkeypatch, capsys):
  home, elsewhere = trained
  run_dir, tok = home / "run", home / "tok" / "tokenizer.json"
  saved = tok.read_bytes()
  try:
    _bpe(tok, DOCS[:3], 100)  # the same path, another tokenizer
    monkeypatch.chdir(elsewhere)
    for main, argv in ((sample.main, [str(run_dir)]), (export.main, [str(run_dir), str(tmp_path / "hf")])):
      capsys.readouterr()
      with pytest.raises(SystemExit) as e:
        main(argv)
      err = capsys.readouterr().err
      assert e.value.code == 2 and err.count("\n") == 1 and str(tok) in err and "has changed since" in err, err
    assert not (tmp_path / "hf").exists()
    export.main([str(run_dir), str(tmp_path / "hf"), "--tokenizer", str(tok)])  # named explicitly: used as it is
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok.read_bytes()
  finally:
    tok.write_bytes(saved)


def test_a_run_that_recorded_relative_paths_resolves_them_where_it_started(trained, tmp_path, monkeypatch, capsys):
  """A run directory written before paths were recorded absolute (relative --tokenizer, relative --out, no "files"):
  the tools resolve its paths against the directory it was started in, told by the run directory's path less its
  --out; moved elsewhere, that cannot be told: one line asks for --tokenizer."""
  home, elsewhere = trained
  old = home / "old"  # a copy of the run as the old code wrote it, started from `home` with --out old
  shutil.copytree(home / "run", old)
  meta = json.load(open(old / "config.json"))
  meta["train"]["data"].update(paths=["data"], tokenizer="tok/tokenizer.json")
  meta["train"]["checkpoint"]["out"] = "old"
  del meta["files"]
  (old / "config.json").write_text(json.dumps(meta))
  monkeypatch.chdir(elsewhere)
  own = _sample([str(home / "run")], capsys)
  assert _sample([str(old)], capsys) == own
  moved = tmp_path / "moved"
  shutil.move(str(old), moved)
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    sample.main([str(moved)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and "--tokenizer tok/tokenizer.json relative" in err, err


def test_a_resume_compares_paths_absolute(tmp_path, monkeypatch):
  """What a checkpoint saved relative (a run written before) equals its absolute form from the directory the run was
  started in, told by the run directory and its saved --out, else the working directory."""
  monkeypatch.chdir(tmp_path)
  saved = {"train": {"data": ["d.txt"], "tokenizer": "tok.json", "out": "runs/a"}, "model_config": {}}
  now = {"train": {"data": [str(tmp_path / "d.txt")], "tokenizer": str(tmp_path / "tok.json"), "out": "runs/a"},
         "model_config": {}}
  assert changed_settings(saved, now) == {}
  monkeypatch.chdir(tmp_path / "..")  # the same run directory named from its parent: --out <name>/runs/a
  now["train"]["out"] = f"{tmp_path.name}/runs/a"
  assert changed_settings(saved, now) == {}
  now["train"]["tokenizer"] = str(tmp_path / "other.json")
  assert list(changed_settings(saved, now)) == ["tokenizer"]


def test_what_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  here = str(tmp_path)
  assert paths.absolute_data(("a.txt", "shards/*.parquet", "~/x.jsonl")) == (
      f"{here}/a.txt", f"{here}/shards/*.parquet", os.path.expanduser("~/x.jsonl"))
  assert paths.absolute_data(("code=src/", "docs=d.jsonl")) == (f"code={here}/src", f"docs={here}/d.jsonl")
  assert paths.absolute_data(("a=x,b=y",)) == (f"a={here}/x", f"b={here}/y")
  assert paths.absolute_data(("data/x=1.txt",)) == ("data/x=1.txt",)  # refused as given when the data is read
  assert paths.absolute_source("hf:models/llama") == f"hf:{here}/models/llama"
  assert paths.absolute_source("runs/a") == f"{here}/runs/a"
  for kept in (None, "", "  ", "s3://bucket/data", "hf://datasets/x"):
    assert paths.absolute(kept) == kept
  cfg = TrainConfig(data=("d.txt",), tokenizer="tok", init_from="hf:m")
  assert (cfg.data.paths, cfg.data.tokenizer, cfg.weights.init_from) == ((f"{here}/d.txt",), f"{here}/tok",
                                                                          f"hf:{here}/m")
  assert TrainConfig().data.paths is None and TrainConfig(tokenizer="").data.tokenizer == ""  # "" is refused later
  assert paths.start_dir(f"{here}/runs/a", "runs/a") == here and paths.start_dir(f"{here}/b", "runs/a") is None
