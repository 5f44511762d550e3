"""The train state at step 0, created sharded: random or --init-from's parameters, --peft's adapters, --freeze's
report, the exact modes' previous parameters, and --sync's per-replica layout with its step programs."""

from __future__ import annotations

import dataclasses
import sys

import jax
from flax import nnx

from models import Transformer
from optim import needs_max_logits
from research.data import get_batch
from research.train import adapters, blockstep, frozen, init_from, rundir, sync
from research.train.build import exact_mode, make_optimizer
from research.train.config import TrainConfig
from research.train.distributed import is_primary
from research.train.step import keep_prev_params, lm_loss
from sharding import global_batch, init_train_state


def initial_state(cfg: TrainConfig, mcfg, mesh, tx, corpus, blockwise=None):
  """(graphdef, state, shardings, report) at step 0, created sharded: random parameters, or --init-from's (unless the
  run has a checkpoint of its own to resume), or --peft's adapters on either, --freeze's report, the exact
  modes' copy of the parameters, or the blockwise BAdam state (`blockwise`: its `blockstep.Parts`). `report`: what
  config.json records of it (--peft's sizes, the blockwise step's storage dtype) or {}."""
  fresh_init_from = cfg.init_from and not rundir.has_checkpoint(cfg.out)  # a resumed run restores its own state instead
  report = {}
  if cfg.peft:
    base = init_from.load_model(cfg.init_from, mcfg, mesh) if fresh_init_from else \
        adapters.random_base(mcfg, mesh, cfg.seed)
    first = global_batch(get_batch(corpus.train, cfg.seed, 0, cfg.batch_size, cfg.seq_len), mesh)  # SNIP's batch
    with jax.set_mesh(mesh):
      graphdef, state, shardings, report = adapters.initial_state(base, cfg.peft, cfg.peft_options, cfg.seed, tx,
                                                                  mesh, first, cfg.zero1)
    if is_primary():
      print(adapters.report_line(report), file=sys.stderr)
    report = {"peft": report}
  else:
    graphdef, state, shardings = init_train_state(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)), tx, mesh,
                                                  zero1=cfg.zero1)
    if fresh_init_from:
      state["params"] = init_from.load_params(cfg.init_from, mcfg, mesh)
  if cfg.freeze:  # stored in --frozen-dtype; the step differentiates the other parameters only
    state["params"] = frozen.store_frozen(state["params"], shardings["params"], cfg.freeze, frozen.frozen_dtype(cfg))
  if cfg.freeze and is_primary():
    print(frozen.frozen_summary(state["params"], frozen.freeze(tx, cfg.freeze)[1], make_optimizer(
        dataclasses.replace(cfg, freeze=None))[0], tx), file=sys.stderr)
  if exact_mode(cfg):  # exact MARS / Muon-MVR2: one more copy of the parameters, a second backward pass per step
    state, shardings = keep_prev_params(state, shardings)
  if blockwise is not None:  # parameters in the storage dtype, the active layer's float32 master and AdamW state
    dtype = frozen.frozen_dtype(cfg)
    state, shardings = blockstep.init_state(state, shardings, blockwise, dtype)
    report = {**report, "blockwise_badam": {"dtype": str(dtype)}}
    if is_primary():
      sizes = blockstep.state_bytes(state)
      print(f"badam: blockwise step, parameters stored as {dtype} ({sizes['params'] / 2**20:.1f} MiB), the active "
            f"layer's float32 master {sizes['master'] / 2**20:.1f} MiB and AdamW state {sizes['adam'] / 2**20:.1f} "
            f"MiB", file=sys.stderr)
  return graphdef, state, shardings, report


def sync_steps(cfg: TrainConfig, graphdef, tx, state, shardings, batch_sh, train_step):
  """(state, shardings, sync.Steps) of --sync: the state laid out for it and its programs (allreduce: the plain
  `train_step`, audited for its bytes)."""
  mode = sync.parse(cfg.sync)
  outer_tx = sync.outer_optimizer(cfg.outer_lr, cfg.outer_momentum)
  state, shardings = sync.init_state(mode, state, shardings, outer_tx, seed=cfg.seed)
  steps = sync.Steps(mode, lm_loss(graphdef), tx, outer_tx, shardings, batch_sh,
                     max_logits=needs_max_logits(cfg.optimizer), mixing=sync.mixing_matrix(mode, batch_sh.mesh.shape[
                         "data"]) if mode.kind == "gossip" else None, plain=train_step)
  return state, shardings, steps
