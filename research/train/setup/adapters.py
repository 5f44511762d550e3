"""--peft METHOD: fine-tune adapters (models/peft.py) on a frozen base instead of the weights themselves.

  python -m research.train --init-from runs/base --peft METHOD --peft.rank 8 --data docs/ --out runs/adapted

The base is --init-from's parameters (or a random model without it). Its target projections become adapters; every
other parameter and the adapters' base weights are frozen buffers in the train state, placed by their logical names
like the parameters (a frozen base is as large as the model: it is sharded, not replicated), checkpointed with the
run, never given gradients or optimizer state. A method that declares it calibrates (`models.peft.Adapter.CALIBRATES`:
the sparse adapter's SNIP pruning) does so before the first step on the first training batch. `research.export`
writes a PEFT run merged, or its adapters alone in PEFT's format when the method's class says PEFT holds them.
Everything method-specific is declared on the method's class in models/peft.py (`models.peft.register`): the
--peft.* flags of a method's own options are made from its `OPTIONS`.
"""

from __future__ import annotations

from typing import cast

import jax
import numpy as np
from flax import nnx

from models import Transformer, TransformerConfig, cross_entropy, peft
from optim.trees import cast_like, tree_bytes
from research.train.config.prefixed import PeftFlags
from research.train.steps.train_state import TrainState
from sharding import init_buffers, init_params, train_state_of


def random_base(config: TransformerConfig, mesh, seed: int) -> nnx.Module:
  """A randomly initialised model created sharded on `mesh` (what --peft adapts without --init-from, and the shape
  a resumed run's checkpoint is restored into)."""
  model_fn = lambda: Transformer(config, rngs=nnx.Rngs(seed))
  graphdef, params, _ = init_params(model_fn, mesh)
  buffers = init_buffers(model_fn, mesh)
  return nnx.merge(graphdef, params, buffers) if buffers else nnx.merge(graphdef, params)


def with_arrays(base: nnx.Module, params: dict, buffers: dict) -> nnx.Module:
  """`base` with its parameters and other variables replaced by these plain dicts' arrays (--init-from's), each cast
  to the dtype `base` has (a bfloat16 checkpoint read into a float32 model)."""
  graphdef, p, rest = nnx.split(base, nnx.Param, ...)  # type: ignore[misc]  # flax: variadic tuple of states
  nnx.replace_by_pure_dict(p, cast_like(params, nnx.to_pure_dict(p)))
  if buffers:
    nnx.replace_by_pure_dict(rest, cast_like(buffers, nnx.to_pure_dict(rest)))
  return nnx.merge(graphdef, p, rest)


def recount(report: dict, graphdef, state: TrainState) -> dict:
  """`report` with the trainable count of the built state (a sparse adapter's pruned entries known only once SNIP
  ran on the real batch; a traced construction counts them as trainable)."""
  model = nnx.merge(graphdef, state.params, state.model_buffers)
  trainable = peft.trainable_count(model)
  return {**report, "trainable": trainable, "trainable_share": trainable / report["base_params"]}


def initial_state(base: nnx.Module, method: str, flags: PeftFlags, seed: int, tx, mesh, batch, zero1: bool = False):
  """(graphdef, state, shardings, report) of a PEFT run at step 0: `base` adapted, a sparse adapter pruned by SNIP on
  `batch` (x, y), the state placed on `mesh`. `report`: the trainable and frozen counts and the optimizer-state
  bytes, with full fine-tuning's beside them."""
  full_params = nnx.state(base, nnx.Param)
  full_bytes = tree_bytes(jax.eval_shape(tx.init, nnx.to_pure_dict(full_params)))
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(full_params))
  model = flags.adapted(base, method, seed)
  kind = peft.ADAPTERS[method]
  if kind.CALIBRATES:  # on the first training batch, before the first step
    x, y = batch
    loss = lambda m: cross_entropy(cast(Transformer, m).forward(x)[0], y)  # the adapted Transformer's
    own = {k: getattr(flags, k) for k in kind.OPTIONS}
    kind.calibrate(model, loss, seed=seed, **own)
  graphdef, state, shardings = train_state_of(model, tx, mesh, zero1)
  trainable = peft.trainable_count(model)
  frozen_bytes = tree_bytes(state.get("buffers", {}))
  report = {"method": method, "trainable": trainable, "base_params": total, "trainable_share": trainable / total,
            "opt_state_bytes": tree_bytes(state["opt_state"]), "full_ft_opt_state_bytes": full_bytes,
            "frozen_bytes": frozen_bytes}
  return graphdef, TrainState.of(state), TrainState.of(shardings), report


def report_line(report: dict) -> str:
  return (f"peft {report['method']}: {report['trainable']:,} trainable parameters, "
          f"{report['trainable_share']:.2%} of the base's {report['base_params']:,}; optimizer state "
          f"{report['opt_state_bytes'] / 2**20:.2f} MiB (full fine-tuning: "
          f"{report['full_ft_opt_state_bytes'] / 2**20:.1f} MiB); frozen base {report['frozen_bytes'] / 2**20:.1f} MiB")
