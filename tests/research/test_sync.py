"""The train CLI's --sync modes (research/sync.py): the equalities that pin them to data parallelism, exact resume,
the metrics, and the refusals."""

import json

import numpy as np
import pytest

from refusals import bad
from research import sync
from research.train import TrainConfig, main, run

TINY = dict(model="tiny", steps=4, batch_size=8, seq_len=32, log_every=1, eval_every=2, ckpt_every=2, warmup_steps=1,
            eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2")


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


def losses(records):
  return [r["loss"] for r in records]


def test_parse_every_form_and_refuse_the_rest():
  assert sync.parse("allreduce") == sync.Sync()
  assert sync.parse("local:16") == sync.Sync("local", period=16)
  assert sync.parse("gossip") == sync.parse("gossip:ring") == sync.Sync("gossip", mixing="ring")
  assert sync.parse("gossip:w.npy").mixing == "w.npy"
  assert sync.parse("stale:0") == sync.Sync("stale", tau=0)
  assert sync.parse("stale:3:random") == sync.Sync("stale", tau=3, random=True)
  for text in ("local", "local:0", "local:x", "stale", "stale:-1", "stale:2:sometimes", "ring", "allreduce:2"):
    with pytest.raises(sync.SyncError, match="--sync"):
      sync.parse(text)


@pytest.fixture(scope="module")
def allreduce_sgd(tmp_path_factory):
  """Plain data parallelism with SGD and no clipping: what local:1 with outer SGD at lr 1 must equal."""
  return run(cfg(tmp_path_factory.mktemp("dp"), optimizer="sgd", lr=0.3, grad_clip=0.0))


def test_local_one_step_with_outer_lr_1_is_data_parallel_sgd(allreduce_sgd, tmp_path):
  """H = 1, outer SGD lr 1, no momentum: the outer parameters are the mean of the replicas' SGD steps from the same
  point, which is the step on the mean gradient (SGD is linear in the gradient; clipping off, as each replica would
  clip its own)."""
  local = run(cfg(tmp_path, optimizer="sgd", lr=0.3, grad_clip=0.0, sync="local:1", outer_lr=1.0, outer_momentum=0.0))
  np.testing.assert_allclose(losses(local), losses(allreduce_sgd), rtol=2e-5)
  np.testing.assert_allclose([r["val_loss"] for r in local if "val_loss" in r],
                             [r["val_loss"] for r in allreduce_sgd if "val_loss" in r], rtol=2e-5)
  assert all(r["consensus"] == 0 for r in local)  # every replica restarts from the outer parameters each step


def test_stale_zero_is_synchronous(tmp_path):
  """tau = 0: every replica's gradient at the current parameters, averaged: AdamW with clipping as the plain step."""
  plain = run(cfg(tmp_path / "a"))
  stale = run(cfg(tmp_path / "b", sync="stale:0"))
  np.testing.assert_allclose(losses(stale), losses(plain), rtol=2e-5)
  assert all(r["delay"] == [0, 0] for r in stale)


@pytest.mark.parametrize("mode", ["local:2", "gossip", "stale:2:random"])
def test_every_mode_resumes_exactly_and_logs_its_metrics(tmp_path, mode):
  """Interrupted after step 2 and resumed: the same losses, replica losses and bytes as the uninterrupted run (the
  replicas, the outer state and the history are in the checkpoint); bytes grow with the steps; replicas differ."""
  whole = run(cfg(tmp_path / "whole", sync=mode))
  run(cfg(tmp_path / "cut", sync=mode, stop_at=2))
  resumed = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
  run(cfg(tmp_path / "cut", sync=mode))
  resumed = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
  keys = ("loss", "replica_loss", "comm_bytes", "comm_bytes_replicas", "val_loss", "consensus", "delay")
  assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in whole]
  assert all(len(r["replica_loss"]) == 2 and r["replica_loss"][0] != r["replica_loss"][1] for r in whole)
  assert all(b["comm_bytes_replicas"] > a["comm_bytes_replicas"] or mode == "local:2"
             for a, b in zip(whole, whole[1:]))
  if mode == "gossip":  # (step 1 runs at the warmup's lr 0)
    assert all(r["consensus"] > 0 for r in whole[1:])
  if mode == "local:2":  # the replicas only talk at the outer step (steps 2, 4); steps 1 and 3 send them a few
    sent = np.diff([0] + [r["comm_bytes_replicas"] for r in whole])  # scalars (the loss, the finite flag)
    assert sent[1] == sent[3] > 1000 * max(sent[0], sent[2]) and sent[0] == sent[2]
    assert whole[1]["consensus"] == whole[3]["consensus"] == 0 and whole[2]["consensus"] > 0


def test_gossip_with_a_mixing_matrix_file(tmp_path):
  w = tmp_path / "w.txt"
  np.savetxt(w, [[0.5, 0.5], [0.5, 0.5]])
  records = run(cfg(tmp_path / "run", sync=f"gossip:{w}", steps=2))
  assert all(r["consensus"] < 1e-6 for r in records)  # the complete graph averages everything every step


@pytest.mark.parametrize("args, says", [
    (["--sync", "sometimes"], "the forms are allreduce, local:H"),
    (["--sync", "local:0"], "H >= 1"),
    (["--sync", "gossip:/no/such/w.npy"], "no such file"),
    (["--sync", "local:2", "--zero1"], "does not combine with --zero1"),
    (["--sync", "gossip", "--mesh", "stage=2,data=4"], "a pipeline (stage) mesh"),
])
def test_bad_sync_flags_exit_2_in_one_line(tmp_path, capsys, args, says):
  assert says in bad(tmp_path, capsys, *args)


def test_a_mixing_matrix_of_the_wrong_shape_or_not_doubly_stochastic(tmp_path, capsys):
  np.save(tmp_path / "w3.npy", np.full((3, 3), 1 / 3))
  assert "must be (2, 2)" in bad(tmp_path, capsys, "--sync", f"gossip:{tmp_path / 'w3.npy'}", "--mesh", "data=2,fsdp=4")
  np.save(tmp_path / "wbad.npy", np.array([[0.9, 0.9], [0.1, 0.1]]))
  assert "doubly stochastic" in bad(tmp_path, capsys, "--sync", f"gossip:{tmp_path / 'wbad.npy'}", "--mesh",
                                    "data=2,fsdp=4")


def test_main_accepts_the_flags(tmp_path):
  main(["--model", "tiny", "--steps", "1", "--batch-size", "8", "--seq-len", "32", "--no-progress", "--sync",
        "local:4", "--outer-lr", "0.5", "--outer-momentum", "0.8", "--out", str(tmp_path / "run")])
  saved = json.load(open(tmp_path / "run" / "config.json"))["train"]
  assert (saved["sync"], saved["outer_lr"], saved["outer_momentum"]) == ("local:4", 0.5, 0.8)
