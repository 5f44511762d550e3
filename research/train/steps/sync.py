"""The train CLI's `--sync`: how the replicas on the `data` axis agree (sharding/replicas.py has the algorithms).

  allreduce        one copy of the parameters, every step's gradient averaged over `data` (the default; the plain
                   train step of research/train/, not this module)
  local:H          local SGD / DiLoCo: every replica takes H steps of --optimizer on its own rows of the batch with
                   its own optimizer state, then the outer step (Nesterov SGD, --outer-lr, --outer-momentum) on the
                   mean change, and after the run's last step; H = 1 with --outer-lr 1 --outer-momentum 0 and SGD
                   inside is data parallelism. Evaluated between outer steps, the model is the last outer one
  gossip[:W]       decentralized SGD: a step apart, then each replica averages with its neighbours; W is `ring`
                   (default, two ppermutes), `complete` (everyone's mean) or a file with an (R, R) doubly stochastic
                   matrix (.npy, or text rows)
  stale:TAU[:random]  one copy; replica w's gradient is taken at the parameters TAU steps old (or, with `random`, a
                   delay drawn per replica and step from {0..TAU} with --seed), the mean of the replicas' delayed
                   gradients applied synchronously (delayed / stale-synchronous SGD); TAU = 0 is synchronous

State (a `TrainState`, checkpointed whole, so a resumed run continues exactly): local and gossip add `replicas` =
{"params", "opt_state"}, each leaf (R, ...) split over `data`; local keeps the outer parameters in `params` and the
outer optimizer's state in `outer_state`; gossip's `params` is the replicas' mean, refreshed before every save and
evaluation (what export, sampling and --init-from read); stale adds `history`, the last TAU + 1 parameter versions
(and with :random `delay_key`, the delays' PRNG key).

Metrics: each replica's loss ("replica_loss"), the consensus distance sqrt((1/R) sum_i ||x_i - x_bar||^2)
("consensus", at logged steps, by a program of its own that the byte count leaves out), and the collective bytes per
device the run's programs have moved so far ("comm_bytes": each program's wire bytes read from its compiled HLO by
`sharding.collectives`, times the times it ran; "comm_bytes_replicas": only the collectives between replicas, not the
fsdp / tensor traffic inside one; every mode, allreduce included).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from research.train.steps import update_args as update_args_
from research.train.steps.contract import outputs, step_result
from research.train.steps.health import keep_if_finite
from research.train.steps.train_state import TrainState
from sharding import collectives, shardings_like_params
from sharding import replicas as rep
from sharding.replicas import ReplicaError


class SyncError(ValueError):
  """A --sync value the run cannot use."""


@dataclasses.dataclass(frozen=True)
class Sync:
  kind: str = "allreduce"  # allreduce | local | gossip | stale
  period: int = 1  # local: H
  mixing: str = "ring"  # gossip: ring | complete | a path
  tau: int = 0  # stale
  random: bool = False  # stale: a random delay per replica

  @property
  def replicated(self) -> bool:
    """Whether each replica keeps its own copy of the parameters (local, gossip)."""
    return self.kind in ("local", "gossip")


FORMS = "allreduce, local:H, gossip[:ring|complete|FILE], stale:TAU[:random]"


def parse(text: str) -> Sync:
  """A --sync value -> Sync, or SyncError naming the forms."""
  kind, _, rest = text.partition(":")
  bad = SyncError(f"--sync {text!r}: the forms are {FORMS}")
  if kind == "allreduce" and not rest:
    return Sync()
  if kind == "local":
    if not rest.isdigit() or int(rest) < 1:
      raise SyncError(f"--sync {text!r}: local:H needs a whole number of inner steps H >= 1")
    return Sync("local", period=int(rest))
  if kind == "gossip":
    return Sync("gossip", mixing=rest or "ring")
  if kind == "stale":
    tau, _, how = rest.partition(":")
    if not tau.isdigit() or how not in ("", "random") or rest.endswith(":"):
      raise SyncError(f"--sync {text!r}: stale:TAU needs a whole number of steps TAU >= 0, then optionally :random")
    return Sync("stale", tau=int(tau), random=how == "random")
  raise bad


def mixing_matrix(sync: Sync, r: int) -> np.ndarray | None:
  """Gossip's W (R, R), checked doubly stochastic; None for the ring (done by ppermutes, `replicas.ring_mix`)."""
  if sync.mixing == "ring":
    return None
  if sync.mixing == "complete":
    return np.full((r, r), 1 / r)
  if not os.path.isfile(sync.mixing):
    raise SyncError(f"--sync gossip:{sync.mixing}: no such file (ring, complete, or a file with an ({r}, {r}) matrix)")
  try:
    w = np.load(sync.mixing) if sync.mixing.endswith(".npy") else np.loadtxt(sync.mixing, ndmin=2)
    return rep.check_mixing(w, r)
  except ReplicaError as e:
    raise SyncError(f"--sync gossip:{sync.mixing}: {e}") from None
  except ValueError as e:
    raise SyncError(f"--sync gossip:{sync.mixing}: not a matrix of numbers ({e})") from None


def outer_optimizer(lr: float, momentum: float) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD at momentum 0); SyncError unless 0 <= lr < inf
  and 0 <= momentum < 1."""
  if not (np.isfinite(lr) and lr >= 0):
    raise SyncError(f"--outer-lr must be a finite number >= 0, got {lr}")
  if not 0 <= momentum < 1:
    raise SyncError(f"--outer-momentum must lie in [0, 1), got {momentum}")
  return optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum))


def init_state(sync: Sync, state: TrainState, shardings: TrainState, outer_tx, seed: int = 0):
  """(state, shardings): a plain train state and its shardings laid out for `sync` (`seed`: stale:TAU:random's
  delays, kept in the state as `delay_key`)."""
  p_sh = shardings.params
  mesh = jax.tree.leaves(p_sh)[0].mesh
  if sync.replicated:  # the optimizer's state moves into the replicas
    stacked, stacked_sh = rep.stack({"params": state.params, "opt_state": state.opt_state},
                                    {"params": p_sh, "opt_state": shardings.opt_state})
    state, shardings = (state.replace(opt_state=None, replicas=stacked),
                        shardings.replace(opt_state=None, replicas=stacked_sh))
  if sync.kind == "local":
    o_sh = shardings_like_params(jax.eval_shape(outer_tx.init, state.params), state.params, p_sh, mesh)
    state = state.replace(outer_state=jax.jit(outer_tx.init, out_shardings=o_sh)(state.params))
    shardings = shardings.replace(outer_state=o_sh)
  if sync.kind == "stale":
    h_sh = jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), p_sh)
    copies = lambda p: jax.tree.map(lambda x: jnp.broadcast_to(x, (sync.tau + 1,) + x.shape), p)
    state, shardings = state.replace(history=jax.jit(copies, out_shardings=h_sh)(state.params)), \
        shardings.replace(history=h_sh)
    if sync.random:
      replicated = NamedSharding(mesh, P())
      key = jax.random.key_data(jax.random.key(seed))
      state = state.replace(delay_key=jax.device_put(key, replicated))
      shardings = shardings.replace(delay_key=replicated)
  return state, shardings


class Steps:
  """The jitted programs of a --sync run: `step` (every step), `after` (DiLoCo's outer step every H), `model` (the
  state with "params" the model to evaluate and save), `metrics`, and the bytes each program moves.

  Args:
    loss_fn: (params, x, y, buffers) -> (total loss, (cross entropy, aux)), research/train/'s.
    tx: the per-replica (local, gossip) or global (stale) optimizer; outer_tx: DiLoCo's outer one.
    shardings: of the state `init_state` laid out; batch_sh: of a batch (the rows split over `data`).
    update_args: the extra `tx.update` arguments the optimizer declared (`optim.Needs.update_args`), supplied as
      research/train/steps/update_args.py declares them (a stale step's from the aux entries each reads, combined
      over the replicas as it declares).
    mixing: gossip's W (`mixing_matrix`; None: the ring).
    plain: allreduce's step, research/train/steps/step.py `make_steps`'s.
  """

  def __init__(self, sync: Sync, loss_fn: Callable, tx, outer_tx, shardings: TrainState, batch_sh, *,
               update_args=frozenset(), mixing: np.ndarray | None = None, plain: Callable | None = None):
    self.sync, self.loss_fn, self.tx, self.mixing = sync, loss_fn, tx, mixing
    self.update_args = frozenset(update_args)
    self.mesh, self.r = batch_sh.mesh, rep.replica_count(batch_sh.mesh)
    self.bytes: dict[str, tuple[float, float]] = {}  # program -> (all, cross-replica) bytes of one run
    self.counting = True  # comm_bytes is logged while every step ran one known program
    self.drift: tuple[int, Any] | None = None  # local: (step, consensus distance before that step's outer averaging)
    if sync.kind == "allreduce":
      self.train = plain
      return
    make = {"local": self._replica_step, "gossip": self._gossip_step, "stale": self._stale_step}[sync.kind]
    self.train = jax.jit(make, in_shardings=(shardings, batch_sh, batch_sh), out_shardings=(shardings, None),
                         donate_argnums=0)
    if sync.kind == "local":
      def outer(state):
        params, outer_state, stacked = rep.outer_step(outer_tx, state.params, state.outer_state,
                                                      state.replicas["params"])
        return state.replace(params=params, outer_state=outer_state, replicas={**state.replicas, "params": stacked})
      self.outer = jax.jit(outer, in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0)
    if sync.replicated:
      self.mean = jax.jit(lambda s: rep.mean(s.replicas["params"]), in_shardings=(shardings,),
                          out_shardings=shardings.params)
      self.consensus = jax.jit(lambda s: rep.consensus_distance(s.replicas["params"]), in_shardings=(shardings,))

  def _local_train(self, params, opt_state, x, y, buffers):
    """One replica's step of the inner optimizer on its rows; a non-finite step leaves that replica as it was."""
    (total, (loss, aux)), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(params, x, y, buffers)
    extra = update_args_.supply(self.update_args, update_args_.Context(self.loss_fn, None, x, y, buffers, aux))
    updates, new_opt = self.tx.update(grads, opt_state, params, **extra)
    r = step_result(params, grads, updates, new_opt, aux, loss, total)
    new = jax.tree.map(lambda n, o: jnp.where(r.finite, n, o), {"params": optax.apply_updates(params, updates),
                                                                "opt_state": new_opt},
                       {"params": params, "opt_state": opt_state})
    return new, outputs(r)

  def _replica_step(self, state, x, y):
    kinds = ("stacked", "stacked", "rows", "rows", "shared")
    new, out = rep.map_replicas(self._local_train, (state.replicas["params"], state.replicas["opt_state"], x, y,
                                                    state.model_buffers), kinds)
    return state.replace(step=state.step + 1, replicas=new), _summary(out)

  def _gossip_step(self, state, x, y):
    state, out = self._replica_step(state, x, y)
    stacked = state.replicas["params"]
    mixed = rep.ring_mix(stacked) if self.mixing is None else rep.mix(stacked, self.mixing)
    return state.replace(replicas={**state.replicas, "params": mixed}), out

  def _stale_step(self, state, x, y):
    step, buffers = state.step, state.model_buffers
    key = jax.random.wrap_key_data(state.delay_key) if self.sync.random else None
    delay = rep.delays(key, step, self.r, self.sync.tau, self.sync.random)

    def worker(history, d, step, x, y, buffers):  # one replica: the gradient at its stale parameters
      params = rep.stale_params(history, step, d)
      (total, (loss, aux)), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(params, x, y, buffers)
      return grads, {"loss": loss, "total": total, "aux": update_args_.forwarded(self.update_args, aux)}

    grads_r, out = rep.map_replicas(worker, (state.history, delay, step, x, y, buffers),
                                    ("shared", "stacked", "shared", "rows", "rows", "shared"))
    grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads_r)  # the all-reduce over `data`
    seen = update_args_.combined(self.update_args, out["aux"])  # over the replicas, as each argument declares
    extra = update_args_.supply(self.update_args, update_args_.Context(self.loss_fn, None, x, y, buffers, seen))
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
    r = step_result(state.params, grads, updates, opt_state, seen, jnp.mean(out["loss"]), out["total"],
                    {"replica_loss": out["loss"], "delay": delay})
    new = keep_if_finite(r.finite, state.replace(step=step + 1, params=params, opt_state=opt_state), state)
    new = new.replace(history=rep.record(state.history, step, new.params))  # a skipped step's version is the old one
    return new, outputs(r)

  def _audit(self, name: str, fn, *args):
    if name not in self.bytes:
      audit = collectives(fn.lower(*args).compile())
      self.bytes[name] = (audit.wire_bytes(), rep.cross_replica_bytes(audit, self.mesh))

  def step(self, state, x, y):
    if self.counting and "step" not in self.bytes:  # every program's bytes, before the first step (a resumed run's
      self._audit("step", self.train, state, x, y)  # first outer step may be steps away)
      if self.sync.kind == "local":
        self._audit("outer", self.outer, state)
    return self.train(state, x, y)

  def switched(self, plain: Callable):
    """allreduce's step on the mesh --switch-at moved to; comm_bytes is no longer logged (two programs' mix)."""
    self.train, self.counting = plain, False

  def after(self, state, step: int, last: bool = False):
    """The state after `step` (1-based) is done: DiLoCo's outer step every H steps and after the run's `last` step
    (so a run whose length H does not divide ends on averaged parameters). The replicas' consensus distance just
    before the outer step is kept for `metrics` (after it, it is 0)."""
    if self.sync.kind == "local" and (step % self.sync.period == 0 or last):
      self.drift = (step, self.consensus(state))
      state = self.outer(state)
    return state

  def model(self, state):
    """The state with `params` the model (gossip: the replicas' mean; else already so)."""
    return state.replace(params=self.mean(state)) if self.sync.kind == "gossip" else state

  def comm_bytes(self, step: int, last: bool = False) -> tuple[float, float]:
    """Collective wire bytes per device of steps 1..`step` (each program's bytes times its runs; `last`: `step` ended
    the run, with its outer step): (all, those that cross replicas)."""
    outer = step // self.sync.period + (last and step % self.sync.period > 0) if self.sync.kind == "local" else 0
    runs = {"step": step, "outer": outer}
    total = lambda i: sum(runs[k] * b[i] for k, b in self.bytes.items())
    return total(0), total(1)

  def metrics(self, state, step: int, out, last: bool = False) -> dict:
    """A logged step's record entries: replica losses, consensus distance (local: at an outer step, the replicas'
    distance just before they were averaged), cumulative collective bytes."""
    rec: dict = dict(zip(("comm_bytes", "comm_bytes_replicas"), self.comm_bytes(step, last))) if self.counting else {}
    if "replica_loss" in out:
      rec["replica_loss"] = [float(v) for v in np.asarray(out["replica_loss"])]
    if self.sync.replicated:
      drift = self.drift[1] if self.drift is not None and self.drift[0] == step else self.consensus(state)
      rec["consensus"] = float(drift)
    if "delay" in out:
      rec["delay"] = [int(v) for v in np.asarray(out["delay"])]
    return rec


def _summary(out: dict) -> dict:
  """Per-replica (R,) step outputs -> the step's: mean loss and gradient norm, finite only if every replica was."""
  return {"loss": jnp.mean(out["loss"]), "grad_norm": jnp.mean(out["grad_norm"]), "finite": jnp.all(out["finite"]),
          "replica_loss": out["loss"]}


__all__ = ["FORMS", "Steps", "Sync", "SyncError", "init_state", "mixing_matrix", "outer_optimizer", "parse"]
