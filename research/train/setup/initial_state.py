"""The train state at step 0, created sharded: random or --init-from's parameters, --peft's adapters, --freeze's
report, the exact modes' previous parameters, --sync's per-replica layout with its step programs, and PAD-Net's mode
partition (--moe.pad-ratio, padnet.py)."""

from __future__ import annotations

import dataclasses
import sys

import jax
from flax import nnx

from models import Transformer
from optim import Needs
from optim.trees import cast_like
from research.train.config import TrainConfig
from research.train.config.sections import SyncSection
from research.train.feed import make_loader
from research.train.runtime.processes import is_primary
from research.train.setup import adapters, init_from, padnet
from research.train.setup.build import make_optimizer, needs_of
from research.train.steps import blockstep, frozen, layerfreeze, sync, update_args
from research.train.steps.step import keep_prev_params, lm_loss
from research.train.steps.train_state import TrainState
from sharding import DATA, global_batch, init_train_state, mesh_scope


def initial_state(cfg: TrainConfig, mcfg, mesh, tx, corpus, blockwise, shardings,
                  needs: Needs | None = None) -> tuple[TrainState, dict]:
  """(state, report) of a new run at step 0 (a resumed run restores into `abstract_initial_state`'s shapes instead):
  random parameters, or --init-from's, or --peft's adapters on either, --freeze's frozen leaves in their dtype, the
  exact modes' copy of the parameters, or the blockwise BAdam state (`blockwise`: its `blockstep.Parts`), laid out
  for --sync; `report`: what config.json records of it (--peft's sizes, the blockwise step's storage dtype) or {}.

  The whole construction is one compiled program with `shardings` (`abstract_initial_state`'s) as its outputs', so
  only the state's own buffers are allocated: a model stored in bfloat16 never exists in float32 beside it, and
  --init-from's arrays (read in the checkpoint's own dtype) are donated to it. Its one-line reports (--peft's sizes,
  --freeze's, the blockwise step's) are printed once it exists. `needs`: the run's optimizer needs (`needs_of`)."""
  needs = needs_of(cfg.optim, needs)
  source = init_from.load_arrays(cfg.finetune.init_from, mesh) if cfg.finetune.init_from else None
  box = {}

  def build(source):
    graphdef, state, _, box["report"], box["lines"] = _build(cfg, mcfg, mesh, tx, corpus, blockwise, source, needs)
    box["graphdef"] = graphdef
    return state

  state = jax.jit(build, out_shardings=shardings, donate_argnums=0)(source)  # no mesh context: its parts set theirs
  report, lines = box["report"], box["lines"]
  if "peft" in report:  # counted on the state itself: a sparse adapter's pruned entries are known now
    report["peft"] = adapters.recount(report["peft"], box["graphdef"], state)
    lines.insert(0, adapters.report_line(report["peft"]))
  if cfg.moe.partition():  # --moe.pad-ratio < 1: PAD-Net's mode partition before the first update
    state, report["pad_net"], line = padnet.partition(cfg, box["graphdef"], state, corpus, mesh)
    lines.append(line)
  if is_primary():
    for line in lines:
      print(line, file=sys.stderr)
  return state, report


def abstract_initial_state(cfg: TrainConfig, mcfg, mesh, tx, corpus, blockwise=None, needs: Needs | None = None):
  """(graphdef, state, shardings, report) of `initial_state` with the state's leaves `jax.ShapeDtypeStruct`s carrying
  their shardings: nothing allocated, --init-from not read (its parameters have the random ones' shapes), nothing
  printed; every check of the flags that needs the model (--freeze matching nothing, say) done. What the memory
  pre-flight compiles the step against (`research/train/setup/memory.py`) and a resumed run restores into. Its report
  has the shapes' numbers (a sparse adapter's trainable count before pruning). `needs`: as `initial_state`'s."""
  needs = needs_of(cfg.optim, needs)
  box = {}

  def build():
    graphdef, state, box["shardings"], box["report"], _ = _build(cfg, mcfg, mesh, tx, corpus, blockwise, None, needs)
    box["graphdef"] = graphdef
    return state

  state = jax.eval_shape(build)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, box["shardings"])
  return box["graphdef"], state, box["shardings"], box["report"]


def _build(cfg: TrainConfig, mcfg, mesh, tx, corpus, blockwise, source, needs: Needs):
  """The state's construction, traced (by `initial_state`'s jit or `abstract_initial_state`'s eval_shape):
  (graphdef, state, shardings, report, lines to print). `source`: --init-from's (params, buffers), or None."""
  report, lines = {}, []
  if cfg.finetune.peft:
    base = adapters.random_base(mcfg, mesh, cfg.training.seed)
    if source is not None:
      base = adapters.with_arrays(base, *source)
    loader = make_loader(corpus, cfg.training, cfg.data, cfg.data_options)
    first = global_batch(loader.batch(0), mesh)  # SNIP's batch: the first training batch
    with mesh_scope(mesh):
      graphdef, state, shardings, report = adapters.initial_state(base, cfg.finetune.peft, cfg.peft_options,
                                                                  cfg.training.seed, tx, mesh, first, cfg.mesh.zero1)
    report = {"peft": report}
  else:
    graphdef, state, shardings = init_train_state(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.training.seed)), tx,
                                                  mesh, zero1=cfg.mesh.zero1)
    state, shardings = TrainState.of(state), TrainState.of(shardings)
    if source is not None:  # in the parameters' dtype (the checkpoint's may be narrower)
      state = state.replace(params=cast_like(source[0], state.params))
      if source[1] and state.buffers is not None:  # and its buffers: PAD-Net's masks, a router's selection bias
        state = state.replace(buffers=cast_like(source[1], state.buffers))
  if cfg.finetune.freeze:  # stored in --frozen-dtype; the step differentiates the other parameters only
    state = state.replace(params=frozen.store_frozen(state.params, shardings.params, cfg.finetune.freeze,
                                                     frozen.frozen_dtype(cfg.finetune)))
    lines.append(frozen.frozen_summary(state.params, frozen.freeze(tx, cfg.finetune.freeze)[1], make_optimizer(
        dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, freeze=None)), needs=needs)[0], tx))
  if update_args.keeps_prev_params(needs.update_args):  # one more copy of the parameters
    state, shardings = keep_prev_params(state, shardings)
  if blockwise is not None:  # parameters in the storage dtype, the active layer's float32 master and AdamW state
    dtype = frozen.frozen_dtype(cfg.finetune)
    state, shardings = blockstep.init_state(state, shardings, blockwise, dtype)
    report = {**report, "blockwise_badam": {"dtype": str(dtype)}}
    sizes = blockstep.state_bytes(state)
    above = ""
    if blockwise.lowrank:
      above = (f" (BREAD's rank-{blockwise.inactive.rank} factors on the layers above the active one: "
               f"{sizes['factors'] / 2**20:.1f} MiB with their AdamW state)")
    elif blockwise.inactive is not None:
      above = " (BREAD-SGD on the layers above the active one)"
    lines.append(f"{blockwise.name}: blockwise step{above}, parameters stored as {dtype} "
                 f"({sizes['params'] / 2**20:.1f} MiB), the active layer's float32 master "
                 f"{sizes['master'] / 2**20:.1f} MiB and AdamW state {sizes['adam'] / 2**20:.1f} MiB")
  if cfg.finetune.freeze_layers:  # layers 0..N-1 and the embedding frozen: the trained part's float32 master and state
    layerfreeze.check(cfg.finetune, mcfg.n_layers)  # startup.setup checked it for the trainer; the bench builds here
    dtype = frozen.frozen_dtype(cfg.finetune)
    n = cfg.finetune.freeze_layers
    state, shardings = layerfreeze.init_state(state, shardings, tx, cfg.finetune.freeze, n, dtype)
    report = {**report, "frozen_layers": {"n": n, "dtype": str(dtype)}}
    sizes = layerfreeze.state_bytes(state)
    lines.append(f"--freeze-layers {n}: layers 0..{n - 1} and the embedding frozen "
                 f"(no gradient below layer {n}); parameters stored as {dtype} "
                 f"({sizes['params'] / 2**20:.1f} MiB), the trained part's float32 master "
                 f"{sizes['master'] / 2**20:.1f} MiB and optimizer state {sizes['opt'] / 2**20:.1f} MiB")
  state, shardings = sync.init_state(sync.parse(cfg.sync.mode), state, shardings, _outer_tx(cfg.sync),
                                     seed=cfg.training.seed)
  return graphdef, state, shardings, report, lines


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
