"""The scalability study's convex case (research/experiments/scalability/study.py runs it): multinomial logistic
regression on scikit-learn's handwritten digits (1,797 8×8 images shipped in the package, 10 classes), trained by W
workers with each --sync algorithm of the train CLI, on dataset variants whose characters differ.

Every run goes through the CLI's own programs (`research.train.steps.sync.Steps` on a mesh `data=W` of W devices, the
plain step below for allreduce): per-worker batch `batch` rows, plain SGD with a constant learning rate (inside the
workers for local SGD, with outer plain averaging: model-averaging SGD, outer lr 1, no momentum), `steps` steps.

Variants (the knobs of Cheng et al.'s characters; held-out data is the same 20% of the images for all):
  shuffled   rows drawn uniformly at random each step
  sorted     rows read as a stream through the training set sorted by class: consecutive samples alike (similarity),
             and each worker's contiguous rows from one or two classes (the workers' data differ)
  repeated   a tenth of the training images, each repeated 10 times (same size): low diversity
  binary     pixels thresholded to 0/1 at half intensity: higher sparsity and lower variance
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from research.data import datastats
from research.train.steps import sync
from research.train.steps.train_state import TrainState

VARIANTS = ("shuffled", "sorted", "repeated", "binary")


@dataclasses.dataclass(frozen=True)
class Data:
  x: np.ndarray  # (n, 64) float32 in [0, 1]
  y: np.ndarray  # (n,) int32 class
  val_x: np.ndarray
  val_y: np.ndarray
  order: str  # "random" | "sorted"


def digits(variant: str, seed: int = 0) -> Data:
  """The variant's training set and the common held-out 20% (a fixed permutation of the images)."""
  from sklearn.datasets import load_digits
  d = load_digits()
  x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)
  perm = np.random.default_rng(0).permutation(len(x))
  cut = len(x) // 5
  val_x, val_y, x, y = x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]
  if variant == "binary":
    x, val_x = (x >= 0.5).astype(np.float32), (val_x >= 0.5).astype(np.float32)
  if variant == "repeated":
    keep = np.random.default_rng(seed + 1).choice(len(x), len(x) // 10, replace=False)
    idx = np.resize(np.repeat(keep, 10), len(x))
    x, y = x[idx], y[idx]
  if variant == "sorted":
    idx = np.argsort(y, kind="stable")
    x, y = x[idx], y[idx]
  return Data(x, y, val_x, val_y, "sorted" if variant == "sorted" else "random")


def rows(data: Data, seed: int, step: int, batch: int) -> np.ndarray:
  """Indices of the global batch of `step` (worker w takes the w-th contiguous part): uniform draws, or the stream
  through the (sorted) training set from a seed-chosen offset."""
  n = len(data.x)
  if data.order == "sorted":
    offset = np.random.default_rng([seed]).integers(0, n)
    return (offset + step * batch + np.arange(batch)) % n
  return np.random.default_rng([seed, step]).integers(0, n, size=batch)


def characters(data: Data, seed: int = 0, samples: int = 1024) -> dict:
  """The dataset's characters (research/data/datastats.py) on `samples` rows in its sampling order."""
  idx = np.concatenate([rows(data, seed, s, 64) for s in range(samples // 64)])
  return datastats.characters(data.x[idx])


def loss_fn(params, x, y, buffers):
  """Mean cross entropy of softmax(x W + b): the research/train/steps/sync.py loss signature (total, (loss, aux))."""
  logits = x @ params["w"] + params["b"]
  ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))
  return ce, (ce, {})


class Runner:
  """Compiled programs for one (algorithm, W): runs of any learning rate and seed reuse them (the learning rate is
  in the optimizer state, `optax.inject_hyperparams`)."""

  def __init__(self, algorithm: str, workers: int, batch: int):
    self.mode, self.workers, self.batch = sync.parse(algorithm), workers, batch * workers
    self.mesh = sharding.make_mesh(f"data={workers}", devices=jax.devices()[:workers])
    self.tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    self.outer_tx = sync.outer_optimizer(1.0, 0.0)  # model averaging
    rep = NamedSharding(self.mesh, P())
    self.p_sh = {"w": rep, "b": rep}
    self.batch_sh = NamedSharding(self.mesh, P(sharding.DATA))
    self.shardings = None
    self.steps = None
    self.evaluate = jax.jit(lambda p, x, y: loss_fn(p, x, y, {})[0])

  def _state(self, lr: float, seed: int):
    params = {"w": jnp.zeros((64, 10), jnp.float32), "b": jnp.zeros((10,), jnp.float32)}
    params = jax.device_put(params, self.p_sh)
    opt = self.tx.init(params)
    opt.hyperparams["learning_rate"] = jnp.float32(lr)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=opt)
    shardings = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state)
    state = jax.device_put(state, shardings)
    return sync.init_state(self.mode, state, shardings, self.outer_tx, seed=seed)

  def _plain(self, shardings):
    def step(state, x, y):
      (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y, {})
      updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
      return (state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state), {"loss": loss})
    return jax.jit(step, in_shardings=(shardings, self.batch_sh, self.batch_sh), out_shardings=(shardings, None),
                   donate_argnums=0)

  def run(self, data: Data, lr: float, seed: int, steps: int, eval_every: int) -> dict:
    """One run: the held-out loss every `eval_every` steps, the bytes between replicas at those steps, and the final
    parameters (host arrays)."""
    with jax.set_mesh(self.mesh):
      state, shardings = self._state(lr, seed)
      if self.steps is None:
        self.steps = sync.Steps(self.mode, loss_fn, self.tx, self.outer_tx, shardings, self.batch_sh,
                                plain=self._plain(shardings) if self.mode.kind == "allreduce" else None)
      curve, sent = [], []
      val = [jnp.asarray(data.val_x), jnp.asarray(data.val_y)]
      for t in range(steps + 1):
        if t % eval_every == 0:
          params = self.steps.model(state).params
          curve.append((t, float(self.evaluate(params, *val))))
          sent.append((t, self.steps.comm_bytes(t)[1]))
        if t == steps:
          break
        idx = rows(data, seed, t, self.batch)
        x, y = (jax.device_put(a, self.batch_sh) for a in (data.x[idx], data.y[idx]))
        state, _ = self.steps.step(state, x, y)
        state = self.steps.after(state, t + 1)
    return {"curve": curve, "bytes": sent, "params": jax.device_get(params)}


__all__ = ["Data", "Runner", "VARIANTS", "characters", "digits", "loss_fn", "rows"]
