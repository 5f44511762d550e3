"""Whether a block-coordinate optimizer runs its blockwise step (research/train/steps/blockstep.py) in this run, and
its `Parts` when it does: the optimizer's registry entry declares the plan (`optim.Needs.blockwise`), the run's
settings may rule it out (research/train/setup/clashes.py `BLOCKWISE_BLOCKERS`), and then the optax transform runs
over full gradients instead, said in one line."""

from __future__ import annotations

import sys

from optim import Needs
from research.train.runtime.processes import is_primary
from research.train.setup import clashes
from research.train.setup.build import needs_of
from research.train.steps.blockstep import Parts


def eligible(cfg, mesh, needs: Needs | None = None) -> str | None:
  """Whether this run's optimizer runs its blockwise step.

  Args:
    cfg: the run's config.
    mesh: its mesh.
    needs: the run's optimizer needs (None: computed from the config).

  Returns:
    None when it does, else why not, one phrase: its registry entry declares no blockwise step for these
    hyperparameters ("not blockwise", or the hyperparameter: `optim.Needs.not_blockwise`), or the run's settings
    rule it out (`clashes.blockwise_blockers`).
  """
  needs = needs_of(cfg.optim, needs)
  if needs.blockwise is None:
    return "not blockwise" if needs.not_blockwise is None else f"--opt {needs.not_blockwise}"
  named = clashes.blockwise_blockers(cfg, mesh, needs)
  return ", ".join(named) if named else None


def blockwise_parts(cfg, mcfg, mesh, schedule, needs: Needs | None = None) -> Parts | None:
  """The blockwise step's pieces for this run.

  Args:
    cfg: the run's config.
    mcfg: its model config (the layer count).
    mesh: its mesh.
    schedule: the learning rate at an update count.
    needs: the run's optimizer needs (None: computed from the config).

  Returns:
    The `steps.blockstep.Parts` from the optimizer's declared plan, or None: not a blockwise optimizer, or one whose
    blockwise step this run's settings rule out (said in one line on stderr).
  """
  needs = needs_of(cfg.optim, needs)
  why = eligible(cfg, mesh, needs)
  if why is None:
    plan = needs.blockwise
    assert plan is not None  # `eligible` said so
    return Parts(schedule, plan, mcfg.n_layers, cfg.optim.grad_clip, cfg.optim.optimizer)
  if why != "not blockwise" and is_primary():
    name = cfg.optim.optimizer
    print(f"note: --optimizer {name} with {why} runs optim.{name} over full gradients (every gradient computed, every "
          f"parameter kept in float32), not the blockwise step", file=sys.stderr)
  return None
