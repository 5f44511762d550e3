"""Several runs of one shape in one compiled program: the members of a sweep that differ only in seed and in numeric
optimizer hyperparameters (peak lr, weight decay, betas, numeric --opt values) train side by side, the step
`jax.vmap`ped over them, on one device.

At the small rungs of a width ladder a step's fixed costs (dispatch, the host loop, small kernels) set the time, not
its FLOPs: K members in one program pay them once. Each member is the plain step of `research.train` (the one update
path, `make_update`; the non-finite guard; its own seed's initialization and batches, `make_loader`) with its own
optimizer built by `make_optimizer` from its values, so each member's losses equal its one-at-a-time run's up to
float rounding (tests/research/test_vmapped.py). What a member cannot vary: anything that changes a shape, a Python
branch or the program (model, batch, steps, schedule kind, warmup, optimizer name, non-numeric --opt values); what the
vmapped runner does not run: the trainer's other step kinds (--peft, --freeze, --sync, blockwise optimizers, an
optimizer that needs the previous gradients), observers and meshes.

Each member writes what the trainer's run directory holds for a sweep: config.json (its flags) and metrics.jsonl
(loss, grad_norm, lr every --log-every steps, val_loss every --eval-every and at the end; tokens_per_s is the
group's step time shared by its members). The group's state is saved to GROUP/state.npz every --ckpt-every steps;
rerunning continues exactly from it (members' records past it are dropped first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import Transformer
from optim import Needs
from research.train.config import RunError, TrainConfig
from research.train.config.sections import OptimSection, SyncSection, TrainsSection
from research.train.feed import held_out, make_loader
from research.train.hooks.source_weights import load_data
from research.train.runtime.xla import compiler_options
from research.train.setup.build import make_optimizer, model_config, opt_hparams, optimizer_needs
from research.train.steps import update_args
from research.train.steps.contract import outputs
from research.train.steps.step import eval_loss, make_update
from research.train.store.rundir import read_records

VARIED = ("lr", "weight_decay", "b1", "b2")  # besides --opt keys with numeric values, and the seed


def member_values(optims: Sequence[OptimSection]) -> tuple[list[dict], list[str]]:
  """Each member's varied values ({name: float}) and the names that vary, from the members' optim sections; RunError
  when a value varies that a vmapped program cannot vary (module docstring)."""
  if not optims:
    raise RunError("a vmapped group needs at least one run")
  hps = [{"lr": o.lr, **opt_hparams(o)} for o in optims]
  names = sorted({k for h in hps for k in h})
  varied = [k for k in names if len({json.dumps(h.get(k)) for h in hps}) > 1]
  for k in varied:
    if any(k not in h for h in hps):
      raise RunError(f"vmapped runs: --opt {k} is set for some members only; give it to every member")
    bad = [h.get(k) for h in hps if not isinstance(h.get(k), (int, float)) or isinstance(h.get(k), bool)]
    if bad:
      raise RunError(f"vmapped runs may differ in numeric optimizer values only: {k} takes {bad[0]!r}")
    if k not in VARIED and any(isinstance(h[k], int) for h in hps):  # a count (Newton-Schulz steps, a rank)
      raise RunError(f"vmapped runs may not differ in the integer --opt {k} (it sets the program): one at a time")
  return [{k: float(h[k]) for k in varied} for h in hps], varied


def same_program(flags: Sequence[dict]) -> None:
  """RunError when the members' flags (`TrainConfig.flags`) differ in anything but the seed, the varied optimizer
  values and where they write."""
  base = _shared(flags[0])
  for f in flags[1:]:
    if _shared(f) != base:
      diff = sorted(k for k in base if base[k] != _shared(f)[k])
      raise RunError(f"vmapped runs must differ only in seed and numeric optimizer values; they differ in {diff}")


def _shared(flags: dict) -> dict:
  """The flags every member must share (all but the seed, the varied optimizer values and where it writes)."""
  flags = dict(flags)
  flags["opt_keys"] = sorted(item.partition("=")[0] for item in flags["opt"])
  for k in (*VARIED, "seed", "opt", "out"):
    flags.pop(k, None)
  return {k: _plain(v) for k, v in flags.items()}


def _plain(v: Any) -> Any:
  return dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v


def check(trains: TrainsSection, init_from: str | None, sync: SyncSection, optim: OptimSection) -> Needs:
  """The member's optimizer's declared needs (computed here, once per member), from its trains, --init-from, sync and
  optim settings; RunError when it is a run the vmapped runner does not run (what the trains and sync sections declare
  they turn on: `features()`)."""
  why = [named for named in {**trains.features(), **sync.features()}.values() if named]
  why += ["--init-from"] if init_from else []
  needs = optimizer_needs(optim)
  if needs.blockwise is not None or update_args.keeps_prev_params(needs.update_args):
    why.append(f"--optimizer {optim.optimizer} (its own step kind)")
  if why:
    raise RunError(f"a vmapped group runs the plain step only, not {', '.join(why)}: run these one at a time")
  return needs


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@dataclasses.dataclass
class Group:
  """A vmapped group built (`build`): its state stacked over the members, its two programs and its data."""
  cfgs: list[TrainConfig]
  values: dict  # {varied name: float32 array of the members' values}
  state: tuple  # (params, buffers, opt_state, bad steps [in a row, most in a row]), each with a member axis
  step: Callable[..., Any]  # jitted: (values, params, buffers, opt_state, bad, xs, ys) -> (params, ..., bad, outputs)
  evaluate: Callable[..., Any]  # jitted: (params, buffers, x, y) -> the members' held-out cross entropies
  loaders: list
  val: list
  schedules: list


def build(cfgs: Sequence[TrainConfig]) -> Group:
  """The group's state at step 0 and its programs.

  Args:
    cfgs: the members' configs (each with its own --out: its run directory).

  Returns:
    The `Group`, for `run_group`; RunError when the runs cannot share one program.
  """
  cfgs = list(cfgs)
  each = [check(c.trains, c.weights.init_from, c.sync, c.optim) for c in cfgs]  # each member's, computed once
  rows, varied = member_values([c.optim for c in cfgs])
  same_program([c.flags() for c in cfgs])
  needs = each[0]  # the group's: its members share the optimizer and what it declares
  base = cfgs[0]
  mcfg = model_config(base.model, base.moe, base.weights.init_from, needs)
  corpus = load_data(base.data, base.data_options)
  if mcfg.vocab_size < corpus.vocab_size:
    raise RunError(f"the data has {corpus.vocab_size} token ids but the model's vocab_size is {mcfg.vocab_size}")
  splits = [nnx.split(Transformer(mcfg, rngs=nnx.Rngs(c.training.seed)), nnx.Param, ...) for c in cfgs]
  graphdef = splits[0][0]
  params = _stack([nnx.to_pure_dict(sp[1]) for sp in splits])
  buffers = _stack([nnx.to_pure_dict(sp[2]) for sp in splits])  # type: ignore[misc]  # (graphdef, Param, rest)
  values = {k: jnp.asarray([r[k] for r in rows], jnp.float32) for k in varied}
  declared = needs.update_args
  tx_of = lambda v: make_optimizer(base.optim, base.training.steps, needs, values=v)[0]

  def member_step(v, p, b, o, bad, x, y):
    r = make_update(graphdef, tx_of(v), update_args=declared)(p, b, o, x, y)
    ok = r.result.finite  # the trainer's guard: a non-finite step changes nothing
    keep = lambda new, old: jax.tree.map(lambda n, o_: jnp.where(ok, n, o_), new, old)
    run = jnp.where(ok, 0, bad[0] + 1)  # non-finite steps in a row, and the longest such run so far
    bad = jnp.stack([run, jnp.maximum(run, bad[1])])
    return keep(r.params, p), keep(r.buffers, b), keep(r.result.opt_state, o), bad, outputs(r.result)

  bad = jnp.zeros((len(cfgs), 2), jnp.int32)
  batch = jax.ShapeDtypeStruct((len(cfgs), base.training.batch_size, base.training.seq_len), jnp.int32)
  try:  # traced once here, before anything is written: a value the optimizer branches on cannot vary
    opt_state = jax.jit(jax.vmap(lambda v, p: tx_of(v).init(p)))(values, params)
    jax.eval_shape(jax.vmap(member_step), values, params, buffers, opt_state, bad, batch, batch)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
          jax.errors.TracerIntegerConversionError) as e:
    raise RunError(f"--optimizer {base.optim.optimizer} branches on one of {varied}, which the members vary: run "
                   f"them one at a time ({type(e).__name__})") from None
  opts = compiler_options()  # the trainer's (research/train/runtime/xla.py)
  step = jax.jit(jax.vmap(member_step), donate_argnums=(1, 2, 3, 4), compiler_options=opts)
  evaluate = jax.jit(jax.vmap(eval_loss(graphdef), in_axes=(0, None, None, 0)), compiler_options=opts)
  loaders = [make_loader(corpus, c.training, c.data, c.data_options) for c in cfgs]
  val = held_out(corpus, base.training, base.data_options, base.logging.eval_batches)
  schedules = [make_optimizer(c.optim, c.training.steps, needs)[1] for c in cfgs]
  return Group(cfgs, values, (params, buffers, opt_state, bad), step, lambda p, b, x, y: evaluate(p, x, y, b), loaders,
               val, schedules)


def _save(group_dir: str, step: int, state: tuple):
  """The group's state after `step` steps, written whole or not at all (a temporary file renamed)."""
  leaves = jax.tree.leaves(jax.device_get(state))
  tmp = os.path.join(group_dir, "state.tmp.npz")
  np.savez(tmp, *leaves)
  with open(os.path.join(group_dir, "progress.tmp.json"), "w") as f:
    json.dump({"step": step, "leaves": len(leaves)}, f)
  os.replace(tmp, os.path.join(group_dir, "state.npz"))
  os.replace(os.path.join(group_dir, "progress.tmp.json"), os.path.join(group_dir, "progress.json"))


def _restore(group_dir: str, state: tuple) -> tuple[int, tuple]:
  """(step, state) saved in `group_dir`, or (0, `state`) when none is."""
  path = os.path.join(group_dir, "progress.json")
  if not os.path.exists(path):
    return 0, state
  try:
    with open(path) as f:
      progress = json.load(f)
    with np.load(os.path.join(group_dir, "state.npz")) as z:
      leaves = [z[f"arr_{i}"] for i in range(progress["leaves"])]
  except (OSError, ValueError, KeyError) as e:
    raise RunError(f"{group_dir}: the vmapped group's saved state is unreadable ({e}); move it aside") from None
  treedef = jax.tree.structure(state)
  shapes = [np.shape(x) for x in jax.tree.leaves(state)]
  if [np.shape(a) for a in leaves] != shapes:
    raise RunError(f"{group_dir}: the saved state is another group's (its shapes differ); move it aside to restart")
  return progress["step"], jax.tree.unflatten(treedef, [jnp.asarray(a) for a in leaves])


def _open_records(out: str, train: dict, start: int, group_dir: str, size: int):
  """The member's metrics.jsonl kept up to `start` (what a resume continues from), and its config.json ("train": its
  config by section, the trainer's record)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({"train": train, "vmapped": {"group": os.path.abspath(group_dir), "members": size}}, f, indent=1)
  path = os.path.join(out, "metrics.jsonl")
  kept = [r for r in read_records(path)[0] if r["step"] <= start] if start and os.path.exists(path) else []
  with open(path, "w") as f:  # (a last line cut short by a kill is dropped, as the trainer's resume drops it)
    f.writelines(json.dumps(r) + "\n" for r in kept)
  return open(path, "a")


def run_group(group: Group, group_dir: str) -> list[list[dict]]:
  """Trains the members of a group side by side (module docstring) and returns each member's records.

  Args:
    group: the group (`build`: its members' configs, each with its own --out: its run directory).
    group_dir: where the group's state is saved every --ckpt-every steps and resumed from.

  Returns:
    Per member, the records written to its metrics.jsonl by this call (the steps after a resume only).
  """
  os.makedirs(group_dir, exist_ok=True)
  base, size = group.cfgs[0], len(group.cfgs)
  start, state = _restore(group_dir, group.state)
  files = [_open_records(c.checkpoint.out, dataclasses.asdict(c), start, group_dir, size) for c in group.cfgs]
  records: list[list[dict]] = [[] for _ in range(size)]
  clock = [time.perf_counter(), start]  # when the last logged step ended, and its step
  try:
    for s in range(start, base.training.steps):
      xs, ys = [np.stack(a) for a in zip(*(ld.batch(s) for ld in group.loaders))]
      *new, out = group.step(group.values, *state, xs, ys)
      state = tuple(new)
      recs = _records(group, s + 1, state, out, clock)
      if len(recs[0]) > 1:  # a logged step: the bad-step counts read back once
        worst = np.asarray(state[3])[:, 1]
        for k, r in enumerate(recs):
          if not _diverged(group.cfgs[k].health, group.cfgs[k].checkpoint.out, int(worst[k])):
            files[k].write(json.dumps(r) + "\n")
            records[k].append(r)
      if (s + 1) % base.checkpoint.ckpt_every == 0 or s + 1 == base.training.steps:
        for f in files:
          f.flush()
        _save(group_dir, s + 1, state)
  finally:
    for f in files:
      f.close()
  return records


def _records(group: Group, done: int, state: tuple, out: dict, clock: list) -> list[dict]:
  """Each member's record of step `done`: the step's outputs every --log-every steps (and at the last), the held-out
  loss every --eval-every (and at the last); {"step"} alone at other steps."""
  logs, steps = group.cfgs[0].logging, group.cfgs[0].training.steps
  recs: list[dict] = [{"step": done} for _ in group.cfgs]
  if done % logs.log_every == 0 or done == steps:
    got = jax.device_get(out)
    now = time.perf_counter()
    per_step = (now - clock[0]) / (done - clock[1])
    clock[:] = [now, done]
    tokens = group.cfgs[0].training.batch_size * group.cfgs[0].training.seq_len
    for k, r in enumerate(recs):
      r.update({"loss": float(got["loss"][k]), "grad_norm": float(got["grad_norm"][k]),
                "lr": float(group.schedules[k](done - 1)), "tokens_per_s": tokens / per_step})
  if done % logs.eval_every == 0 or done == steps:
    losses = np.mean([np.asarray(group.evaluate(state[0], state[1], x, y)) for x, y in group.val], axis=0)
    for k, r in enumerate(recs):
      r["val_loss"] = float(losses[k])
  return recs


def _diverged(health, out: str, bad: int) -> bool:
  """Whether the member stopped at --max-bad-steps (its health section's) non-finite steps in a row (its run
  directory `out` says so, as the sweep records a diverged one-at-a-time run)."""
  if not health.max_bad_steps or bad < health.max_bad_steps:
    return False
  path = os.path.join(out, "diverged")
  if not os.path.exists(path):
    with open(path, "w") as f:
      f.write(f"{bad} non-finite steps in a row (vmapped group)\n")
  return True
