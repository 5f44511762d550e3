"""Bad-step safety: a step with a non-finite loss or non-finite gradients leaves parameters and optimizer state
exactly as they were (so the run goes on as if that batch had never been drawn), is counted in the metrics, and
too many in a row stop the run with its last good checkpoint; loss spikes over a running median are logged.

Faults come with the data, as in a real run: a batch whose targets hold a token id past the vocabulary gives a
NaN loss (the gather fills NaN) with finite gradients; one whose inputs do gives NaN everywhere; targets that are
all a byte the UTF-8 corpus never has (0xFD) give a loss spike. A finite loss with NaN gradients cannot come from
data, so one test poisons the gradient of the loss itself."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research.train.setup.checks
import research.train.steps.step
from models import Transformer, cross_entropy
from research.bench.timing import trainer_optimizer, trainer_plan
from research.data import get_batch, load_corpus
from research.train import TrainConfig, main, make_steps, run
from research.train.feed import Feed, make_loader
from research.train.steps import train_state
from research.train.steps.health import Monitor
from sharding import batch_sharding, local_batch, make_mesh

# The programs of tests/research/test_crash.py and test_multiprocess.py (same model, optimizer, schedule, mesh):
# compiled once per session.
# `sampling="random"`: the batches the spike thresholds below were measured on.
TINY = dict(model="tiny", n_layers=1, steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=2,
            warmup_steps=1, eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12,
            sampling="random")
VOCAB = 256


def spoil(x, y, mark):
  """A batch spoiled as `mark` says: "nan_loss" (row 0's targets past the vocabulary), "nan_all" (row 0's inputs past
  it), "spike" (every target 0xFD), None (kept)."""
  x, y = x.copy(), y.copy()
  if mark == "nan_loss":
    y[0] = VOCAB
  elif mark == "nan_all":
    x[0] = VOCAB
  elif mark == "spike":
    y[:] = 0xFD
  return x, y


def poisoned_batches(marks: dict[int, str], order=None):
  """The trainer's Feed.next with the batch of (1-based) step s spoiled as marks[s] says; `order` maps this run's
  step index to the step whose batch it replays. The batches are the run's own loader's."""
  def next_(feed):
    src = order[feed.step] - 1 if order else feed.step
    x, y = spoil(*make_loader(feed.corpus, feed.training, feed.data, feed.options, feed.rows).batch(src),
                 marks.get(src + 1))
    next(feed.iterator)  # the iterator (whose state checkpoints keep) moves on as in a clean run
    feed.step += 1
    return local_batch((x, y), feed.mesh, feed.rows, feed.training.batch_size)
  return next_


@pytest.fixture
def poison(monkeypatch):
  return lambda *args, **kw: monkeypatch.setattr(Feed, "next", poisoned_batches(*args, **kw))


@jax.custom_vjp
def _grad_times(loss, factor):
  return loss


_grad_times.defvjp(lambda loss, factor: (loss, factor), lambda factor, g: (g * factor, jnp.zeros_like(factor)))


def nan_grads_cross_entropy(logits_BTV, y_BT):
  """The cross entropy; its gradient is NaN when row 0 of the targets is all 0xFE."""
  return _grad_times(cross_entropy(logits_BTV, y_BT), jnp.where(jnp.all(y_BT[0] == 0xFE), jnp.nan, 1.0))


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


def test_a_skipped_step_leaves_params_and_optimizer_state_bit_for_bit(monkeypatch):
  monkeypatch.setattr(research.train.steps.step, "cross_entropy", nan_grads_cross_entropy)
  c = cfg("unused")
  mesh, tx = make_mesh(c.mesh.spec), trainer_optimizer(c)[0]
  model = lambda: Transformer(trainer_plan(c, mesh=mesh).model, rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, state, shardings = train_state.create(model, tx, mesh)
  train_step, _ = make_steps(graphdef, tx, shardings, batch_sharding(mesh, (8, 32)))
  tokens = load_corpus().train

  def batch(s):
    x, y = spoil(*get_batch(tokens, 0, s - 1, 8, 32), {2: "nan_loss", 3: "nan_all"}.get(s))
    if s == 4:
      y[0] = 0xFE  # NaN gradients, finite loss
    return jax.device_put((x, y), batch_sharding(mesh, (8, 32)))

  with jax.set_mesh(mesh):
    state, out = train_step(state, *batch(1))
    assert bool(out["finite"]) and int(state.step) == 1
    before = jax.device_get(state)
    for s, loss_finite in ((2, False), (3, False), (4, True)):
      state, out = train_step(state, *batch(s))
      after = jax.device_get(state)
      assert not bool(out["finite"]) and int(after.step) == s
      assert math.isfinite(out["loss"]) == loss_finite
      assert math.isfinite(out["grad_norm"]) == (s == 2)  # the filled NaN targets have no gradient
      jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
      jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
    state, out = train_step(state, *batch(5))
    assert bool(out["finite"])
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), jax.device_get(state).params, before.params)
    assert all(jax.tree.leaves(changed))


def test_bad_steps_are_skipped_and_counted_and_a_spike_is_logged(poison, tmp_path):
  # A: steps 3 (NaN loss) and 5 (NaN loss and gradients) are skipped; 7 (an unseen byte as every target) spikes
  marks = {3: "nan_loss", 5: "nan_all", 7: "spike"}
  poison(marks)
  a = run(cfg(tmp_path / "a", spike_window=3, spike_factor=1.05))  # 5.74 over a median of 5.19
  # B, the oracle: the batches A applied, in order, without the bad ones. If a skip changed nothing (moments,
  # step count, schedule position), A after step s equals B after its (s - skipped)-th step, bit for bit.
  kept = [1, 2, 4, 6, 7, 8]
  poison(marks, order=dict(enumerate(kept)))
  b = run(cfg(tmp_path / "b", stop_at=6))
  assert [(r["loss"], r["grad_norm"]) for r in a if r["step"] in kept] == [(r["loss"], r["grad_norm"]) for r in b]

  by_step = {r["step"]: r for r in a}
  assert math.isnan(by_step[3]["loss"]) and math.isfinite(by_step[3]["grad_norm"])
  assert math.isnan(by_step[5]["loss"]) and math.isnan(by_step[5]["grad_norm"])
  assert by_step[3]["nonfinite_steps"] == [3] and by_step[5]["nonfinite_steps"] == [5]
  assert by_step[7]["spike"] is True and by_step[7]["spike_steps"] == [7]
  assert [(r["skipped"], r["spikes"]) for r in a] == [(0, 0), (0, 0), (1, 0), (1, 0), (2, 0), (2, 0), (2, 1), (2, 1)]
  assert [r["step"] for r in a if "spike" in r or "nonfinite_steps" in r] == [3, 5, 7]
  with open(tmp_path / "a" / "metrics.jsonl") as f:
    assert [json.loads(line).get("nonfinite_steps") for line in f][2:5] == [[3], None, [5]]


def test_consecutive_bad_steps_stop_the_run_and_keep_its_last_good_checkpoint(poison, tmp_path, capsys):
  poison({3: "nan_loss", 4: "nan_all", 5: "nan_loss"})
  with pytest.raises(SystemExit) as e:
    main([f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"] +
         ["--no-progress", "--max-bad-steps=3", f"--out={tmp_path}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 3 and len(err) == 1, err
  assert err[0].startswith("error: 3 non-finite steps in a row (steps 3-5, none applied; --max-bad-steps 3): "
                           "stopped at step 5, its last checkpoint (step 2) is kept")
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2"]  # no save at step 4, amid the bad steps
  with open(tmp_path / "metrics.jsonl") as f:
    assert [(r["step"], r["skipped"]) for r in map(json.loads, f)][-1] == (5, 3)


def test_nonfinite_parameters_after_an_update_are_a_bad_step_and_never_saved(monkeypatch, tmp_path, capsys):
  """--lr nan gets past the flag checks here (they refuse it): the warmup's lr = nan * 0 spoils every update while
  the loss and gradients stay finite; each such step is skipped and nothing NaN is checkpointed."""
  monkeypatch.setattr(research.train.setup.checks, "check_numbers", lambda *sections: None)
  with pytest.raises(SystemExit) as e:
    main([f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"] +
         ["--no-progress", "--max-bad-steps=3", "--lr=nan", f"--out={tmp_path}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 3 and err[-1].startswith("error: 3 non-finite steps in a row (steps 1-3"), err
  assert "no checkpoint was saved" in err[-1]
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
  assert records[-1]["skipped"] == 3 and not os.listdir(tmp_path / "ckpt")


def test_max_bad_steps_counts_every_step_not_only_logged_ones(poison, tmp_path, capsys):
  """Logging every 10 steps, 3 bad steps in a row stop the run at once (one step later at most: the flags are read
  one step behind), not at the next logged step."""
  poison({s: "nan_loss" for s in range(3, 9)})
  with pytest.raises(SystemExit) as e:
    main([f"--{k.replace('_', '-')}={v}"
          for k, v in {**TINY, "log_every": 10, "eval_every": 10, "ckpt_every": 10}.items() if k != "progress"]
         + ["--no-progress", "--max-bad-steps=3", f"--out={tmp_path}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 3 and len(err) == 1, err
  assert err[0].startswith("error: 3 non-finite steps in a row (steps 3-5, none applied; --max-bad-steps 3): "
                           "stopped at step 6, no checkpoint was saved"), err


def reference_spikes(losses, factor, window):
  """Independent float64 NumPy statement of the rule: t spikes iff losses[t] > factor * median of the `window`
  finite losses before it (none until there are `window`)."""
  finite = [(t, x) for t, x in enumerate(losses) if np.isfinite(x)]
  return [t for i, (t, x) in enumerate(finite)
          if i >= window and x > factor * np.median(np.array([v for _, v in finite[i - window:i]], np.float64))]


def test_spike_detector_and_bad_run_counter_on_a_synthetic_sequence():
  rng = np.random.default_rng(0)
  losses = 4.0 * np.exp(-np.arange(300) / 80) + 1.0 + 0.05 * rng.standard_normal(300)
  losses[[40, 41, 120, 250]] *= [2.0, 1.9, 3.0, 1.3]  # three spikes over 1.5x, one under
  losses[[60, 61, 200]] = [np.nan, np.inf, np.nan]
  losses[270:] += 2.0  # a lasting level shift: a spike until it is the median (window/2 steps)
  m = Monitor(max_bad_steps=3, spike_factor=1.5, spike_window=20)
  for t, x in enumerate(losses):
    m.update(t, float(x), bool(np.isfinite(x)))
  flagged = m.take()
  want = reference_spikes(losses, 1.5, 20)
  assert flagged["spike_steps"] == want and m.spikes == len(want)
  assert {40, 41, 120, 250} & set(want) == {40, 41, 120} and 270 in want and max(want) < 270 + 11
  assert flagged["nonfinite_steps"] == [60, 61, 200] and m.skipped == 3 and not m.failed

  m = Monitor(max_bad_steps=3)
  for t, finite in enumerate([True, False, False, True, False, False]):
    m.update(t, 1.0, finite)
  assert m.bad_run == 2 and not m.failed
  m.update(6, math.nan, False)
  assert m.failed and m.bad_from == 4


def test_monitor_resumes_exactly_from_its_saved_state():
  losses = [5.0, 4.0, 3.5, 9.0, 3.0, math.nan, 2.9, 7.0, 2.8]
  whole = Monitor(spike_window=3)
  for t, x in enumerate(losses):
    whole.update(t, x, math.isfinite(x))
  first = Monitor(spike_window=3)
  for t, x in enumerate(losses[:5]):
    first.update(t, x, math.isfinite(x))
  second = Monitor(spike_window=3)
  second.load(json.loads(json.dumps(first.state())))
  for t, x in enumerate(losses[5:], 5):
    second.update(t, x, math.isfinite(x))
  assert second.state() == whole.state() and second.take() == whole.take()
  assert whole.state()["flagged"] == {"nonfinite": [], "spike": []}
