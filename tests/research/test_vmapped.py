"""Vmapped groups (research/train/vmapped.py): each member's losses are its one-at-a-time run's (the trainer's), a
killed group resumes exactly, and what cannot share one program is refused in one line."""

import dataclasses
import json
import os

import numpy as np
import pytest

from research.train import RunError, TrainConfig, run
from research.train.vmapped import build, member_values, run_group

BASE = dict(model="tiny", n_layers=2, batch_size=8, seq_len=32, steps=8, log_every=1, eval_every=4, eval_batches=1,
            ckpt_every=4, warmup_steps=2, progress=False, tracker=("none",))


def _cfgs(tmp_path, members, **over):
  return [TrainConfig(**{**BASE, **over, **m, "out": str(tmp_path / f"m{i}")}) for i, m in enumerate(members)]


def _metrics(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


MEMBERS = [dict(lr=3e-3, seed=0), dict(lr=1e-2, seed=0), dict(lr=3e-3, seed=1, weight_decay=0.05)]


def test_each_member_trains_as_its_one_at_a_time_run(tmp_path):
  cfgs = _cfgs(tmp_path / "group", MEMBERS, optimizer="adamw", weight_decay=0.1)
  records = run_group(build(cfgs), str(tmp_path / "group" / "state"))
  assert [len(r) for r in records] == [8, 8, 8]
  for cfg, recs in zip(cfgs, records):
    alone = run(dataclasses.replace(cfg, out=cfg.checkpoint.out + "-alone", mesh="data=8"))
    mine = {r["step"]: r for r in recs}
    for r in alone:  # the trainer on 8 devices sums the batch in another order: equal to float32 rounding
      for key in ("loss", "val_loss", "lr"):
        if key in r:
          assert mine[r["step"]][key] == pytest.approx(r[key], rel=2e-5, abs=1e-6), (cfg.optim.lr, r["step"], key)
    assert _metrics(cfg.checkpoint.out) == recs
  # the members differ from each other (a vmapped group of copies would pass the test above with one member)
  finals = [r[-1]["val_loss"] for r in records]
  assert len(set(finals)) == 3


def test_muon_members_vary_their_lr_and_a_numeric_opt_value(tmp_path):
  members = [dict(lr=1e-2, opt=("beta=0.95",)), dict(lr=2e-2, opt=("beta=0.95",)), dict(lr=1e-2, opt=("beta=0.9",))]
  cfgs = _cfgs(tmp_path, members, optimizer="muon", steps=4, eval_every=4)
  assert member_values([c.optim for c in cfgs]) == ([{"beta": 0.95, "lr": 1e-2}, {"beta": 0.95, "lr": 2e-2},
                                  {"beta": 0.9, "lr": 1e-2}], ["beta", "lr"])
  records = run_group(build(cfgs), str(tmp_path / "state"))
  alone = run(dataclasses.replace(cfgs[1], out=str(tmp_path / "alone"), mesh="data=8"))
  assert records[1][-1]["val_loss"] == pytest.approx(alone[-1]["val_loss"], rel=2e-5)


def test_a_killed_group_resumes_exactly(tmp_path, monkeypatch):
  cfgs = _cfgs(tmp_path / "a", MEMBERS[:2], optimizer="adamw")
  whole = run_group(build(cfgs), str(tmp_path / "a" / "state"))
  cut = _cfgs(tmp_path / "b", MEMBERS[:2], optimizer="adamw")
  import research.train.vmapped as vm
  real = vm._save
  calls = []

  def kill_after_first_save(*a):  # the group dies after its step-4 checkpoint, having logged steps 5..6
    real(*a)
    calls.append(a[1])
    if a[1] == 4:
      raise KeyboardInterrupt
  monkeypatch.setattr(vm, "_save", kill_after_first_save)
  with pytest.raises(KeyboardInterrupt):
    run_group(build(cut), str(tmp_path / "b" / "state"))
  monkeypatch.setattr(vm, "_save", real)
  with open(os.path.join(cut[0].checkpoint.out, "metrics.jsonl"), "a") as f:  # a record past the checkpoint
    f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n")
  with open(os.path.join(cut[1].checkpoint.out, "metrics.jsonl"), "a") as f:  # a last line a kill cut short
    f.write('{"step": 5, "lo')
  rest = run_group(build(cut), str(tmp_path / "b" / "state"))
  assert [r["step"] for r in rest[0]] == [5, 6, 7, 8]
  strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # a time, not a result
  for k in range(2):
    assert strip(_metrics(cut[k].checkpoint.out)) == strip(whole[k])
    assert all(r["tokens_per_s"] > 0 for r in _metrics(cut[k].checkpoint.out))


@pytest.mark.parametrize("first, change, why", [
    ({}, dict(n_layers=3), "differ only in seed"),
    ({}, dict(opt=("coeffs=\"cubic\"",)), "some members only"),
    (dict(opt=("coeffs=\"quintic\"",)), dict(opt=("coeffs=\"cubic\"",)), "numeric optimizer values only"),
    (dict(opt=("ns_steps=5",)), dict(opt=("ns_steps=4",)), "integer"),
    ({}, dict(peft="lora"), "plain step only"),
])
def test_what_cannot_share_one_program_is_refused(tmp_path, first, change, why):
  cfgs = _cfgs(tmp_path, [dict(lr=1e-2, **first), dict(lr=2e-2, **change)], optimizer="muon")
  with pytest.raises(RunError, match=why):
    run_group(build(cfgs), str(tmp_path / "state"))
  assert not os.path.exists(tmp_path / "state")


def test_a_damaged_group_state_is_one_clear_error(tmp_path):
  cfgs = _cfgs(tmp_path, MEMBERS[:2], optimizer="adamw", steps=4)
  run_group(build(cfgs), str(tmp_path / "state"))
  (tmp_path / "state" / "state.npz").write_bytes(b"not a zip")
  before = _metrics(cfgs[0].checkpoint.out)
  with pytest.raises(RunError, match="unreadable"):
    run_group(build(cfgs), str(tmp_path / "state"))
  assert _metrics(cfgs[0].checkpoint.out) == before  # nothing already written is lost


def test_member_values_lists_what_varies():
  cfgs = [TrainConfig(**BASE, lr=1e-3, seed=s) for s in (0, 1)]
  assert member_values([c.optim for c in cfgs]) == ([{}, {}], [])
  cfgs = [TrainConfig(**BASE, optimizer="muon", lr=lr, opt=(f"beta={b}",)) for lr, b in ((1e-2, 0.9), (1e-2, 0.95))]
  assert member_values([c.optim for c in cfgs]) == ([{"beta": 0.9}, {"beta": 0.95}], ["beta"])
  np.testing.assert_equal(member_values([cfgs[0].optim])[1], [])


def test_a_second_learning_rate_follows_the_runs_schedule(monkeypatch):
  """--opt adam_learning_rate=X is a peak on the --lr schedule's shape (warmup, cosine), not a constant."""
  from research.train.setup import build
  got = {}
  monkeypatch.setattr(build, "get_optimizer", lambda name, lr, **hp: got.update(lr=lr, **hp))
  monkeypatch.setattr(build.frozen, "freeze", lambda tx, spec: (tx, None))
  cfg = TrainConfig(**{**BASE, "steps": 100, "warmup_steps": 10}, optimizer="muon", lr=0.02,
                    opt=("adam_learning_rate=0.004", "beta=0.9"), grad_clip=0.0)
  build.make_optimizer(cfg.optim, cfg.training.steps, build.optimizer_needs(cfg.optim))
  main, second = got["lr"], got["adam_learning_rate"]
  for step in (0, 5, 10, 50, 99):
    assert float(second(step)) == pytest.approx(float(main(step)) * 0.004 / 0.02, rel=1e-6)
  assert float(second(10)) == pytest.approx(0.004) and got["beta"] == 0.9


def test_the_bench_reports_its_ratios_from_its_measurements(tmp_path):
  from research.bench.vmap import vmap
  out = vmap(widths=(16,), members=2, steps=6, trainer=False, out=str(tmp_path / "bench.md"))
  row = out["rows"][0]
  assert row["speedup_steady"] == pytest.approx(2 * row["alone_step"] / row["group_step"])
  assert row["alone_step"] > 0 and row["group_step"] > 0 and row["flops_per_member_step"] > 0
  assert "| 16 |" in (tmp_path / "bench.md").read_text()
