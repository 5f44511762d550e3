"""The train CLI: determinism, exact resume, clean stops, and a clear error for every bad input."""

import json
import os
import shutil

import numpy as np
import pytest
from refusals import bad
from runs import trace

from research.train import RunError, TrainConfig, run

TINY = dict(model="tiny", steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=4,
            warmup_steps=2, eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2")


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  out = tmp_path_factory.mktemp("ref")
  return out, run(cfg(out))


def test_same_config_same_losses_and_logs(reference, tmp_path):
  out, ref = reference
  assert len(ref) == 8 and ref[-1]["val_loss"] < ref[0]["loss"]
  assert trace(run(cfg(tmp_path))) == trace(ref)
  with open(out / "metrics.jsonl") as f:
    assert trace(map(json.loads, f)) == trace(ref)
  meta = json.load(open(out / "config.json"))
  assert len(meta["corpus"]["fingerprint"]) == 64 and meta["mesh"] == "data=2,fsdp=2,tensor=2"


@pytest.mark.parametrize("mesh, attention", [("context=8", "ring"), ("context=2,stage=2,data=2", "allgather")])
def test_context_parallel_runs_follow_the_same_trajectory(reference, tmp_path, mesh, attention):
  """The sequence split over `context` (zig-zag, ring or all-gather attention; with a pipeline too) trains the same
  model: the same losses, gradient norms and held-out losses, to float32 rounding."""
  _, ref = reference
  got = run(cfg(tmp_path, mesh=mesh, attention=attention))
  np.testing.assert_allclose(np.array(trace(got), float), np.array(trace(ref), float), rtol=2e-5)
  meta = json.load(open(tmp_path / "config.json"))
  assert "context=" in meta["mesh"] and meta["model_config"]["attention"] == attention


def test_resume_continues_exactly(reference, tmp_path):
  _, ref = reference
  first = run(cfg(tmp_path, stop_at=4))
  assert [r["step"] for r in first] == [1, 2, 3, 4]
  resumed = run(cfg(tmp_path))
  assert trace(resumed) == trace(ref)  # the records of the whole run, the pre-stop ones included


def test_resume_drops_metrics_logged_after_the_checkpoint(reference, tmp_path):
  _, ref = reference
  run(cfg(tmp_path, stop_at=4))
  with open(tmp_path / "metrics.jsonl", "a") as f:  # an interrupted run logged step 5 but never saved it
    f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n")
  assert trace(run(cfg(tmp_path))) == trace(ref)


def test_resume_refuses_a_shape_change_and_keeps_the_checkpoint(tmp_path):
  run(cfg(tmp_path, stop_at=4))
  before = sorted((p, os.path.getsize(os.path.join(d, p))) for d, _, ps in os.walk(tmp_path) for p in ps)
  with pytest.raises(RunError, match=r"different model/optimizer \(d_model: 64 -> 32\)"):
    run(cfg(tmp_path, d_model=32))
  after = sorted((p, os.path.getsize(os.path.join(d, p))) for d, _, ps in os.walk(tmp_path) for p in ps)
  assert before == after
  # the same shapes spelled out explicitly (and a compute dtype, which is not in the state) resume fine
  assert run(cfg(tmp_path, d_model=64, compute_dtype="float32"))[-1]["step"] == 8


@pytest.mark.parametrize("args, message", [
    (["--mesh", "data=3"], "needs 3 devices but 8 are available"),
    (["--mesh", "model=8"], "unknown mesh axis 'model'"),
    (["--mesh", "data=0,fsdp=-1"], "must have a positive size"),
    (["--batch-size", "6", "--mesh", "data=8"], "size 6.*does not divide"),
    (["--n-heads", "3", "--mesh", "fsdp=4,tensor=2"], "n_heads=3 must be a multiple of n_kv_heads=2"),
    (["--d-ff", "99", "--mesh", "data=4,tensor=2"], "size 99.*does not divide by mesh axes \\('tensor',\\)"),
    (["--optimizer", "adamax"],
     "unknown optimizer .adamax.; registered: adamuon, adamw, badam, bread, cautious_adamw, "),
    (["--opt", "beta1=0.8"], "optimizer 'adamw' has no hyperparameter beta1"),
    (["--data", "/nonexistent/corpus.txt"], "data path does not exist: /nonexistent/corpus.txt"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--warmup-steps", "50", "--steps", "10"], "--warmup-steps \\(50\\) must lie in"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "-1"], "--lr must be >= 0, got -1"),
    (["--b2", "1.5"], r"--b2 must lie in \[0, 1\]"),
    (["--grad-clip", "inf"], "--grad-clip must be a finite number"),
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--keep", "0"], "--keep must be positive"),
    (["--optimizer", "muon", "--opt", "ns_steps=abc"], "ns_steps='abc' must be an integer"),
    (["--opt", "b1=NaN"], "b1=nan must be finite"),
    (["--mesh", "data=2,data=4"], "mesh axis 'data' is given twice"),
    (["--mesh", "context=8", "--seq-len", "40"], "--mesh context=8: seq_len=40 does not split into the 2\\*context=16 "
                                                 "zig-zag chunks of context=8; use a seq_len that is a multiple of 16"),
    (["--mesh", "context=4,data=2", "--attention", "flash"], "attention 'flash' does not split the sequence, but the "
                                                             "mesh has context=4; use attention ring or allgather"),
    (["--optimizer", "mgup_adamw", "--opt", "tau=2"], r"--optimizer mgup_adamw: .*tau.*must lie in"),
])
def test_bad_input_gives_one_clear_line_and_exit_2(tmp_path, capsys, args, message):
  import re
  assert re.search(message, bad(tmp_path, capsys, *args))


def test_an_out_that_cannot_be_a_run_directory_is_refused_and_left_alone(tmp_path, capsys):
  file = tmp_path / "notes.txt"
  file.write_text("keep me")
  assert "is a file, not a run directory" in bad(tmp_path, capsys, out=str(file))
  assert "cannot be created: " in bad(tmp_path, capsys, out=str(file / "run"))
  assert file.read_text() == "keep me"


def test_a_ckpt_that_is_a_file_is_refused_before_training_and_the_records_kept(tmp_path, capsys):
  """ckpt/ replaced by a regular file (a mistaken cp): the run used to train from step 0, fail to save and leave
  metrics.jsonl empty; now it is refused before anything is read or written."""
  out = tmp_path / "run"
  run(cfg(out, stop_at=4))
  shutil.rmtree(out / "ckpt")
  (out / "ckpt").write_text("not a checkpoint")
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  assert "ckpt is not a directory" in bad(tmp_path, capsys, out=str(out))
  assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
  assert len((out / "metrics.jsonl").read_text().splitlines()) == 4


def test_out_of_memory_is_one_line_and_leaves_no_run_directory(tmp_path, capsys):
  """--seq-len 100000 asks the attention for terabytes: with the memory pre-flight off (--memory-limit 0; it refuses
  this run before it starts, tests/research/test_memory.py) XLA refuses the allocation at the first step."""
  assert "out of memory" in bad(tmp_path, capsys, "--seq-len", "100000", "--steps", "2", "--batch-size", "8",
                                "--memory-limit", "0")


def test_a_run_directory_in_use_is_refused_without_touching_it(tmp_path, capsys):
  from research.train.store import rundir
  run(cfg(tmp_path / "run", stop_at=4))
  before = sorted(os.listdir(tmp_path / "run" / "ckpt"))
  with rundir.claim(str(tmp_path / "run")):  # another run holds the directory
    assert "is in use by another run (pid " in bad(tmp_path, capsys, *_tiny_flags())
  assert sorted(os.listdir(tmp_path / "run" / "ckpt")) == before
  assert run(cfg(tmp_path / "run"))[-1]["step"] == 8  # free again once it ends


def _tiny_flags():
  return sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in TINY.items() if k not in ("model", "progress")), [])


def test_resume_with_changed_settings_is_refused_or_recorded_with_amend(reference, tmp_path):
  _, ref = reference
  run(cfg(tmp_path, stop_at=4))
  with pytest.raises(RunError, match=r"trained with other settings \(lr: 0.003 -> 0.001; steps: 8 -> 10\); "
                                     r"rerun with the original flags, or add --amend"):
    run(cfg(tmp_path, lr=1e-3, steps=10))
  assert json.load(open(tmp_path / "config.json"))["train"]["optim"]["lr"] == 3e-3  # the record is unchanged
  resumed = run(cfg(tmp_path, lr=1e-3, amend=True))
  assert trace(resumed)[:4] == trace(ref)[:4] and trace(resumed)[4:] != trace(ref)[4:]
  meta = json.load(open(tmp_path / "config.json"))
  assert meta["train"]["optim"]["lr"] == 1e-3
  assert meta["history"] == [{"from_step": 4, "changed": {"lr": [3e-3, 1e-3]}}]


def test_data_edited_between_a_stop_and_a_resume_is_a_changed_setting(tmp_path):
  """The same --data whose files changed is other data: refused without --amend (config.json untouched), recorded in
  the history with the old and new fingerprints with it."""
  data = tmp_path / "data.txt"
  data.write_text("def f(x):\n  return x + 1\n" * 400)
  out = tmp_path / "run"
  run(cfg(out, data=(str(data),), stop_at=4))
  saved = json.load(open(out / "config.json"))
  data.write_text("class A:\n  pass\n" * 600)
  with pytest.raises(RunError, match=r"trained with other settings \(data \(corpus fingerprint\): '[0-9a-f]{16}' -> "
                                     r"'[0-9a-f]{16}'\); rerun with the original flags, or add --amend"):
    run(cfg(out, data=(str(data),)))
  assert json.load(open(out / "config.json")) == saved  # nothing rewritten
  run(cfg(out, data=(str(data),), amend=True))
  meta = json.load(open(out / "config.json"))
  old, new = saved["corpus"]["fingerprint"], meta["corpus"]["fingerprint"]
  assert meta["history"] == [{"from_step": 4, "changed": {"data (corpus fingerprint)": [old[:16], new[:16]]}}]


def test_sequence_longer_than_data_and_empty_data(tmp_path, capsys):
  short = tmp_path / "short.txt"
  short.write_text("x = 1\n" * 200)
  assert "sequence length 128 is longer than the data" in bad(tmp_path, capsys, "--data", str(short))
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  assert "empty" in bad(tmp_path, capsys, "--data", str(empty))


def test_corrupt_checkpoint_is_reported_and_left_alone(tmp_path, capsys):
  """Every saved step damaged: one error line, exit 2, nothing touched (one damaged step among good ones is
  skipped for the previous good one: tests/research/test_crash.py)."""
  run(cfg(tmp_path / "run", stop_at=4))
  ckpt = tmp_path / "run" / "ckpt"
  steps = [d for d in os.listdir(ckpt) if d.isdigit()]
  victims = [os.path.join(d, p) for s in steps for d, _, ps in os.walk(ckpt / s / "state") for p in ps]
  assert "4" in steps and victims
  for v in victims:
    with open(v, "wb") as f:
      f.write(b"garbage")
  msg = bad(tmp_path, capsys, *_tiny_flags())
  assert "checkpoint" in msg
  assert all(open(v, "rb").read() == b"garbage" for v in victims)  # nothing overwritten


def test_help_lists_every_optimizer_with_its_hyperparameters(capsys):
  import optim
  from research.train import main
  with pytest.raises(SystemExit):
    main(["--help"])
  out = capsys.readouterr().out
  for name in optim.OPTIMIZERS:
    assert f"  {name}: " in out
  assert "mgup_adamw: b1=0.9 b2=0.95 eps=1e-08 weight_decay=0.1 tau=0.5 alpha=2.0 gamma=0.1" in out
