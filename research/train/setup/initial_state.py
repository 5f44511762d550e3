"""The train state at step 0, created sharded from the run's plan (plan.py): random or --init-from's parameters,
--peft's adapters, --freeze's report, the exact modes' previous parameters, the blockwise step's state, and --sync's
per-replica layout with its step programs. PAD-Net's mode partition runs on the built state (padnet.py)."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models import Transformer
from optim.trees import cast_like
from research.train.config.sections import SyncSection
from research.train.runtime.processes import is_primary
from research.train.setup import adapters, init_from
from research.train.setup.plan import Plan
from research.train.steps import blockstep, frozen, layerfreeze, sync, update_args
from research.train.steps.step import keep_prev_params, lm_loss
from research.train.steps.train_state import TrainState
from sharding import DATA, global_batch, init_train_state, mesh_scope


def initial_state(plan: Plan, tx, plain, blockwise, shardings, loader, peft_options) -> tuple[TrainState, dict]:
  """(state, report) of a new run at step 0 (a resumed run restores into `abstract_initial_state`'s shapes instead).

  Random parameters, or --init-from's, or --peft's adapters on either, --freeze's frozen leaves in their dtype, the
  exact modes' copy of the parameters, or the blockwise BAdam state, laid out for --sync. The whole construction is
  one compiled program with `shardings` (`abstract_initial_state`'s) as its outputs', so only the state's own buffers
  are allocated: a model stored in bfloat16 never exists in float32 beside it, and --init-from's arrays (read in the
  checkpoint's own dtype) are donated to it. Its one-line reports (--peft's sizes, --freeze's, the blockwise step's)
  are printed once it exists.

  Args:
    plan: the run's plan (model, mesh, what trains, --sync, seed, --zero1, --init-from).
    tx: the optimizer.
    plain: the optimizer without --freeze (what --freeze's report compares with), or None without --freeze.
    blockwise: the blockwise step's `blockstep.Parts`, or None.
    shardings: the state's shardings (`abstract_initial_state`'s).
    loader: the training batches (`make_loader`'s; a PEFT method that calibrates reads the first).
    peft_options: the config's --peft.* section.

  Returns:
    (state, report): what config.json records of it (--peft's sizes, the blockwise step's storage dtype) or {}.
  """
  source = init_from.load_arrays(plan.init_from, plan.mesh) if plan.init_from else None
  box = {}

  def build(source):
    graphdef, state, _, box["report"], box["lines"] = _build(plan, tx, plain, blockwise, source, loader, peft_options)
    box["graphdef"] = graphdef
    return state

  state = jax.jit(build, out_shardings=shardings, donate_argnums=0)(source)  # no mesh context: its parts set theirs
  report, lines = box["report"], box["lines"]
  if "peft" in report:  # counted on the state itself: a sparse adapter's pruned entries are known now
    report["peft"] = adapters.recount(report["peft"], box["graphdef"], state)
    lines.insert(0, adapters.report_line(report["peft"]))
  if is_primary():
    for line in lines:
      print(line, file=sys.stderr)
  return state, report


def abstract_initial_state(plan: Plan, tx, plain, blockwise, loader, peft_options):
  """`initial_state`'s state with its leaves `jax.ShapeDtypeStruct`s carrying their shardings.

  Nothing allocated, --init-from not read (its parameters have the random ones' shapes), nothing printed; every check
  of the flags that needs the model (--freeze matching nothing, say) done. What the memory pre-flight compiles the
  step against (`research/train/setup/memory.py`) and a resumed run restores into.

  Args:
    plan: as `initial_state`'s.
    tx: the optimizer.
    plain: the optimizer without --freeze, or None.
    blockwise: the blockwise step's `Parts`, or None.
    loader: the training batches.
    peft_options: the config's --peft.* section.

  Returns:
    (graphdef, state, shardings, report); the report has the shapes' numbers (a sparse adapter's trainable count
    before pruning).
  """
  box = {}

  def build():
    graphdef, state, box["shardings"], box["report"], _ = _build(plan, tx, plain, blockwise, None, loader,
                                                                 peft_options)
    box["graphdef"] = graphdef
    return state

  state = jax.eval_shape(build)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, box["shardings"])
  return box["graphdef"], state, box["shardings"], box["report"]


def _build(plan: Plan, tx, plain, blockwise, source, loader, peft_options):
  """The state's construction, traced (by `initial_state`'s jit or `abstract_initial_state`'s eval_shape):
  (graphdef, state, shardings, report, lines to print). `source`: --init-from's (params, buffers), or None."""
  report, lines, mesh, trains = {}, [], plan.mesh, plan.trains
  if plan.peft:
    base = adapters.random_base(plan.model, mesh, plan.seed)
    if source is not None:
      base = adapters.with_arrays(base, *source)
    first = global_batch(loader.batch(0), mesh)  # SNIP's batch: the first training batch
    with mesh_scope(mesh):
      graphdef, state, shardings, report = adapters.initial_state(base, plan.peft, peft_options, plan.seed, tx, mesh,
                                                                  first, plan.zero1)
    report = {"peft": report}
  else:
    graphdef, state, shardings = init_train_state(lambda: Transformer(plan.model, rngs=nnx.Rngs(plan.seed)), tx,
                                                  mesh, zero1=plan.zero1)
    state, shardings = TrainState.of(state), TrainState.of(shardings)
    if source is not None:  # in the parameters' dtype (the checkpoint's may be narrower)
      state = state.replace(params=cast_like(source[0], state.params))
      if source[1] and state.buffers is not None:  # and its buffers: PAD-Net's masks, a router's selection bias
        state = state.replace(buffers=cast_like(source[1], state.buffers))
  if trains.freeze:  # stored in --frozen-dtype; the step differentiates the other parameters only
    state = state.replace(params=frozen.store_frozen(state.params, shardings.params, trains.freeze,
                                                     jnp.dtype(trains.frozen_dtype)))
    lines.append(frozen.frozen_summary(state.params, frozen.freeze(tx, trains.freeze)[1], plain, tx))
  if update_args.keeps_prev_params(plan.needs.update_args):  # one more copy of the parameters
    state, shardings = keep_prev_params(state, shardings)
  if blockwise is not None:  # parameters in the storage dtype, the active layer's float32 master and AdamW state
    state, shardings, report, line = _blockwise(state, shardings, blockwise, trains, report)
    lines.append(line)
  if trains.layers:  # layers 0..N-1 and the embedding frozen: the trained part's float32 master and state
    layerfreeze.check(trains.layers, plan.model.n_layers)  # startup.check did for the trainer; a bench builds here
    n, dtype = trains.layers, jnp.dtype(trains.dtype)
    state, shardings = layerfreeze.init_state(state, shardings, tx, trains.freeze, n, dtype)
    report = {**report, "frozen_layers": {"n": n, "dtype": str(dtype)}}
    sizes = layerfreeze.state_bytes(state)
    lines.append(f"--freeze-layers {n}: layers 0..{n - 1} and the embedding frozen "
                 f"(no gradient below layer {n}); parameters stored as {dtype} "
                 f"({sizes['params'] / 2**20:.1f} MiB), the trained part's float32 master "
                 f"{sizes['master'] / 2**20:.1f} MiB and optimizer state {sizes['opt'] / 2**20:.1f} MiB")
  state, shardings = sync.init_state(sync.parse(plan.sync.mode), state, shardings, _outer_tx(plan.sync),
                                     seed=plan.seed)
  return graphdef, state, shardings, report, lines


def _blockwise(state, shardings, blockwise, trains, report):
  """The blockwise BAdam state: (state, shardings, report, its line)."""
  dtype = jnp.dtype(trains.dtype)
  state, shardings = blockstep.init_state(state, shardings, blockwise, dtype)
  report = {**report, "blockwise_badam": {"dtype": str(dtype)}}
  sizes = blockstep.state_bytes(state)
  above = ""
  if blockwise.lowrank:
    above = (f" (BREAD's rank-{blockwise.inactive.rank} factors on the layers above the active one: "
             f"{sizes['factors'] / 2**20:.1f} MiB with their AdamW state)")
  elif blockwise.inactive is not None:
    above = " (BREAD-SGD on the layers above the active one)"
  line = (f"{blockwise.name}: blockwise step{above}, parameters stored as {dtype} "
          f"({sizes['params'] / 2**20:.1f} MiB), the active layer's float32 master "
          f"{sizes['master'] / 2**20:.1f} MiB and AdamW state {sizes['adam'] / 2**20:.1f} MiB")
  return state, shardings, report, line


def _outer_tx(section):
  """DiLoCo's outer optimizer from the config's sync section."""
  return sync.outer_optimizer(section.outer_lr, section.outer_momentum)


def sync_steps(section: SyncSection, graphdef, tx, shardings, batch_sh, train_step, update_args) -> sync.Steps:
  """The programs of --sync (the config's sync section) for a state laid out for it (`shardings`; allreduce: the
  plain `train_step`, audited for its bytes); `update_args`: the optimizer's declared ones."""
  mode = sync.parse(section.mode)
  mixing = sync.mixing_matrix(mode, batch_sh.mesh.shape[DATA]) if mode.kind == "gossip" else None
  return sync.Steps(mode, lm_loss(graphdef), tx, _outer_tx(section), shardings, batch_sh, update_args=update_args,
                    mixing=mixing, plain=train_step)
