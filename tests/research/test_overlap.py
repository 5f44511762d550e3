"""No idle device between steps: the host reads nothing of the step it just dispatched (a step that is not logged
reads two scalars, the loss and finite flag of the step before, one step late), and the next batch is read and put
on the devices on the feed thread while a step runs, without changing which batches a run trains on.

Device-to-host transfers are counted where jax makes them (`ArrayImpl._value`: `float()`, `np.asarray`,
`jax.device_get` all read through it), and attributed to the step whose outputs they read."""

import threading

import numpy as np
import pytest
from jax._src import array as jax_array

from research.data import load_corpus
from research.data.loader import Loader
from research.train import TrainConfig, run
from research.train import feed as feed_module
from research.train.steps import health
from sharding import make_mesh

STEPS, LOG = 12, 6
TINY = dict(model="tiny", n_layers=1, steps=STEPS, batch_size=8, seq_len=32, log_every=LOG, eval_every=STEPS,
            ckpt_every=STEPS, eval_batches=1, progress=False, peak_flops=1e12, mesh="data=-1")


def test_a_step_that_is_not_logged_reads_only_the_previous_steps_health(tmp_path, monkeypatch):
  events, owner = [], {}  # owner: id of a step output -> (step, name)
  value = jax_array.ArrayImpl._value

  def counted(self):
    if self._npy_value is None:  # a transfer (a second read is served from the host copy)
      events.append(("read", owner.get(id(self), ("?", self.shape))))
    return value.fget(self)
  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted))
  push = health.Monitor.push

  def pushed(self, step, out):
    owner.update({id(out["loss"]): (step, "loss"), id(out["finite"]): (step, "finite")})
    return push(self, step, out)
  monkeypatch.setattr(health.Monitor, "push", pushed)
  next_batch = feed_module.Feed.next

  def dispatched(self):
    events.append(("step", self.step + 1))
    return next_batch(self)
  monkeypatch.setattr(feed_module.Feed, "next", dispatched)
  records = run(TrainConfig(out=str(tmp_path), **TINY))

  assert [r["step"] for r in records] == [LOG, STEPS]
  reads, step = {}, None
  for kind, what in events:
    if kind == "step":
      step = what
    else:
      reads.setdefault(step, []).append(what)
  for t in range(1, STEPS):
    if t == 1 or t - 1 == LOG:  # the first step (compiled and waited for), or the step after a record: nothing
      assert t not in reads, (t, reads[t])
    elif t % LOG:  # between dispatching step t and step t + 1: step t - 1's loss and flag, nothing else
      assert reads[t] == [(t - 1, "loss"), (t - 1, "finite")], (t, reads[t])
    else:  # a logged step reads its own outputs (and the step before's): the record
      assert {(t - 1, "loss"), (t, "loss"), (t, "finite")} <= set(reads[t])


def test_the_next_batch_is_read_ahead_on_the_feed_thread_and_the_state_names_the_next_step(monkeypatch):
  threads = []
  put = feed_module.local_batch
  monkeypatch.setattr(feed_module, "local_batch", lambda *a: threads.append(threading.current_thread().name) or put(*a))
  cfg, corpus = TrainConfig(**TINY), load_corpus()
  mesh = make_mesh(cfg.mesh.spec)
  # read in the loop
  want = Loader(corpus.train, batch_size=cfg.training.batch_size, seq_len=cfg.training.seq_len, seed=cfg.training.seed)
  feed = feed_module.Feed(corpus, cfg.training, cfg.data, cfg.data_options, mesh, 0)
  for t in range(3):
    np.testing.assert_array_equal(np.asarray(feed.next()[0]), want.batch(t)[0])
  assert feed.state()["next_index"] == 3  # the batch read ahead (the fourth) is not counted as trained on
  assert len(threads) == 4 and all(name.startswith("optlab-feed") for name in threads)
  resumed = feed_module.Feed(corpus, cfg.training, cfg.data, cfg.data_options, mesh, 3, feed.state())
  np.testing.assert_array_equal(np.asarray(resumed.next()[0]), want.batch(3)[0])
  np.testing.assert_array_equal(np.asarray(feed.next()[0]), want.batch(3)[0])
  feed.close(), resumed.close()


def test_a_switched_mesh_reads_on_from_the_same_step_and_a_failed_read_still_closes(monkeypatch):
  """--switch-at: the batch read ahead for the old mesh is dropped and the next one is the same step's, placed on the
  new mesh. A read that fails on the feed thread raises in the loop, and the feed still closes."""
  cfg, corpus = TrainConfig(**TINY), load_corpus()
  want = Loader(corpus.train, batch_size=cfg.training.batch_size, seq_len=cfg.training.seq_len, seed=cfg.training.seed)
  feed = feed_module.Feed(corpus, cfg.training, cfg.data, cfg.data_options, make_mesh("data=8"), 0)
  feed.next(), feed.next()
  feed.switched(make_mesh("data=2,fsdp=4"))
  x, _ = feed.next()
  assert x.sharding.mesh.shape["fsdp"] == 4 and feed.state()["next_index"] == 3
  np.testing.assert_array_equal(np.asarray(x), want.batch(2)[0])
  put = feed_module.local_batch
  monkeypatch.setattr(feed_module, "local_batch", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
  feed.next()  # the batch read ahead before the failure
  with pytest.raises(OSError, match="disk gone"):
    feed.next()
  feed.close()
  assert put is not feed_module.local_batch and feed.pool._shutdown
