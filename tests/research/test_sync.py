"""The train CLI's --sync modes (research/train/steps/sync.py): the equalities that pin them to data parallelism, exact
resume, the metrics, and the refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from refusals import bad

import sharding
from research.train import RunError, TrainConfig, main, run
from research.train.steps import sync
from research.train.steps.train_state import TrainState
from research.train.store import rundir
from sharding import replicas as rep

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
  for text in ("local", "local:0", "local:x", "stale", "stale:-1", "stale:2:sometimes", "stale:2:", "ring",
               "allreduce:2"):
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
  assert all(r["consensus"] > 0 for r in local[1:])  # the replicas' distance before each averaging (step 1: lr 0)


def test_stale_zero_is_synchronous(tmp_path):
  """tau = 0: every replica's gradient at the current parameters, averaged: AdamW with clipping as the plain step."""
  plain = run(cfg(tmp_path / "a"))
  stale = run(cfg(tmp_path / "b", sync="stale:0"))
  np.testing.assert_allclose(losses(stale), losses(plain), rtol=2e-5)
  assert all(r["delay"] == [0, 0] for r in stale)


@pytest.mark.parametrize("mode", ["local:3", "gossip", "stale:2:random"])
def test_every_mode_resumes_exactly_and_logs_its_metrics(tmp_path, mode):
  """Interrupted after step 2 (local:3: inside a period, the replicas apart) and resumed: the same losses, replica
  losses, consensus and bytes as the uninterrupted run (replicas, outer state, history and delay key are in the
  checkpoint); bytes grow with the steps; replicas differ."""
  whole = run(cfg(tmp_path / "whole", sync=mode))
  run(cfg(tmp_path / "cut", sync=mode, stop_at=2))
  run(cfg(tmp_path / "cut", sync=mode))
  resumed = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
  keys = ("loss", "replica_loss", "comm_bytes", "comm_bytes_replicas", "val_loss", "consensus", "delay")
  assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in whole]
  assert all(len(r["replica_loss"]) == 2 and r["replica_loss"][0] != r["replica_loss"][1] for r in whole)
  assert all(b["comm_bytes_replicas"] > a["comm_bytes_replicas"] for a, b in zip(whole, whole[1:]))
  if mode == "gossip":  # (step 1 runs at the warmup's lr 0)
    assert all(r["consensus"] > 0 for r in whole[1:])
  if mode == "local:3":  # the replicas talk at the outer steps (step 3, and the last, 4); steps 1, 2 send a few
    sent = np.diff([0] + [r["comm_bytes_replicas"] for r in whole])  # scalars (the loss, the finite flag)
    assert sent[2] == sent[3] > 1000 * max(sent[0], sent[1]) and sent[0] == sent[1]
    assert whole[1]["consensus"] > 0 and whole[2]["consensus"] > 0  # apart after step 2; at 3 before averaging


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
    (["--sync", "gossip", "--mesh", "stage=2,data=4"], "a stage mesh axis"),
    (["--sync", "local:2", "--outer-momentum", "1.0"], "--outer-momentum must lie in [0, 1)"),
    (["--sync", "local:2", "--outer-lr", "nan"], "--outer-lr must be a finite number"),
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
  assert saved["sync"] == {"mode": "local:4", "outer_lr": 0.5, "outer_momentum": 0.8}


def test_runs_saved_before_the_sync_flags_existed_resume_as_allreduce():
  saved = {"train": {"lr": 0.1, "steps": 8}, "model_config": {}}
  meta = {"train": {"lr": 0.1, "steps": 8, "sync": "allreduce", "outer_lr": 0.7, "outer_momentum": 0.9,
                    "sampling": "random"}, "model_config": {}}
  assert rundir.changed_settings(saved, meta) == {}
  meta["train"]["sync"] = "gossip"
  assert rundir.changed_settings(saved, meta) == {"sync": ["allreduce", "gossip"]}


def test_resuming_with_another_sync_or_replica_count_is_refused(tmp_path):
  run(cfg(tmp_path, sync="gossip", steps=2))
  with pytest.raises(RunError, match=r"different model/optimizer \(sync: 'gossip' -> 'local:2'\)"):
    run(cfg(tmp_path, sync="local:2", steps=4, amend=True))
  with pytest.raises(RunError, match=r"replicas: 2 -> 4"):
    run(cfg(tmp_path, sync="gossip", steps=4, mesh="data=4,fsdp=2", amend=True))


# ---- the programs against float64 NumPy: least squares, W = 4 replicas of 2 rows, plain SGD --------------------------

R, ROWS, D, LR = 4, 2, 3, 0.2
RNG = np.random.default_rng(0)


def ls_loss(params, x, y, buffers):
  loss = 0.5 * jnp.mean(jnp.square(x @ params["w"] - y))
  return loss, (loss, {})


def ls_grad(w, x, y):  # of the mean over x's rows
  return x.T @ (x @ w - y) / len(x)


def steps_of(mode: str, w0):
  mesh = sharding.make_mesh(f"data={R}", devices=jax.devices()[:R])
  rep_sh = NamedSharding(mesh, P())
  tx = optax.sgd(LR)
  params = {"w": jax.device_put(jnp.asarray(w0, jnp.float32), rep_sh)}
  state = TrainState(step=jax.device_put(jnp.int32(0), rep_sh), params=params, opt_state=tx.init(params))
  shardings = jax.tree.map(lambda _: rep_sh, state)
  outer_tx = sync.outer_optimizer(0.7, 0.9)
  state, shardings = sync.init_state(sync.parse(mode), state, shardings, outer_tx, seed=3)
  return mesh, state, sync.Steps(sync.parse(mode), ls_loss, tx, outer_tx, shardings, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("mode", ["stale:2", "stale:3:random", "gossip", "local:2"])
def test_the_step_programs_equal_a_float64_numpy_simulation(mode):
  """6 steps of each program on fresh rows per step against the algorithm written out in NumPy: delayed SGD with the
  delays the program reports (so the history's slots are checked, not just the delays' law), adapt-then-combine ring
  gossip, and DiLoCo (inner SGD, outer Nesterov SGD 0.7 / 0.9 on the mean change every 2 steps)."""
  w0 = RNG.normal(size=D)
  mesh, state, steps = steps_of(mode, w0)
  kind = sync.parse(mode)
  hist, reps, outer, velocity = [w0], np.tile(w0, (R, 1)), w0.copy(), np.zeros(D)
  with jax.set_mesh(mesh):
    for t in range(6):
      x, y = RNG.normal(size=(R * ROWS, D)), RNG.normal(size=R * ROWS)
      put = lambda a: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, P("data")))
      state, out = steps.step(state, put(x), put(y))
      state = steps.after(state, t + 1)
      xs, ys = x.reshape(R, ROWS, D), y.reshape(R, ROWS)
      if kind.kind == "stale":
        d = np.asarray(out["delay"])
        assert ((0 <= d) & (d <= min(kind.tau, t))).all() and (kind.random or (d == min(kind.tau, t)).all())
        grads = [ls_grad(hist[t - d[i]], xs[i], ys[i]) for i in range(R)]
        hist.append(hist[t] - LR * np.mean(grads, axis=0))
        got, want = state.params["w"], hist[-1]
      else:
        reps = reps - LR * np.stack([ls_grad(reps[i], xs[i], ys[i]) for i in range(R)])
        if kind.kind == "gossip":
          reps = rep.ring_matrix(R) @ reps
          got, want = state.replicas["params"]["w"], reps
        else:
          if (t + 1) % 2 == 0:
            delta = outer - reps.mean(0)
            velocity = 0.9 * velocity + delta
            outer = outer - 0.7 * (delta + 0.9 * velocity)
            reps = np.tile(outer, (R, 1))
          got, want = np.asarray(state.replicas["params"]["w"]), reps
          np.testing.assert_allclose(np.asarray(state.params["w"]), outer, rtol=0, atol=2e-5)
      np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5)
  if kind.random:
    assert len({tuple(h) for h in hist}) == len(hist)  # sanity: the runs moved


@pytest.mark.parametrize("mode", ["local:2", "stale:1"])
def test_an_optimizer_that_declares_max_logits_gets_them_in_every_sync_mode(mode, tmp_path):
  """MuonClip (`Needs(update_args={"max_logits"})`) through the per-replica step (local, gossip) and the stale one:
  the logit maxima reach its update, so a clipping threshold below them changes the third step's loss (stale:1's
  losses are taken at parameters one step old) against one far above them, which never clips (the plain step's
  supplier, `update_args.supply`, serves these programs too)."""
  def second_loss(threshold, out):
    records = run(cfg(tmp_path / out, optimizer="muonclip", qk_norm=False, sync=mode, steps=3, log_every=1,
                      warmup_steps=0, opt=(f"clip_threshold={threshold}",)))
    assert all(np.isfinite(r["loss"]) for r in records)
    return records[2]["loss"]
  assert second_loss(1e-3, "clipped") != second_loss(1e6, "free")
