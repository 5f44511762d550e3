"""Whether a block-coordinate optimizer runs its blockwise step (research/train/steps/blockstep.py) in this run, and
its `Parts` when it does: the optimizer's registry entry declares the plan (`optim.Needs.blockwise`), the run's
settings may rule it out (research/train/setup/clashes.py `BLOCKWISE_BLOCKERS`), and then the optax transform runs
over full gradients instead, said in one line."""

from __future__ import annotations

import sys

from optim import Needs
from research.train.runtime.processes import is_primary
from research.train.setup import clashes
from research.train.steps.blockstep import Parts


def eligible(needs: Needs, on: dict[str, str | None]) -> str | None:
  """Whether this run's optimizer runs its blockwise step.

  Args:
    needs: the optimizer's declared needs.
    on: the run's features (`clashes.features`).

  Returns:
    None when it does, else why not, one phrase: its registry entry declares no blockwise step for these
    hyperparameters ("not blockwise", or the hyperparameter: `optim.Needs.not_blockwise`), or the run's settings
    rule it out (`clashes.blockwise_blockers`).
  """
  if needs.blockwise is None:
    return "not blockwise" if needs.not_blockwise is None else f"--opt {needs.not_blockwise}"
  named = clashes.blockwise_blockers(on)
  return ", ".join(named) if named else None


def blockwise_parts(plan, schedule, grad_clip: float) -> Parts | None:
  """The blockwise step's pieces for this run.

  Args:
    plan: the run's `setup.plan.Plan` (its optimizer's needs and features, its model's layer count).
    schedule: the learning rate at an update count.
    grad_clip: --grad-clip.

  Returns:
    The `steps.blockstep.Parts` from the optimizer's declared plan, or None: not a blockwise optimizer, or one whose
    blockwise step this run's settings rule out (said in one line on stderr).
  """
  why = eligible(plan.needs, plan.features)
  if why is None:
    step = plan.needs.blockwise
    assert step is not None  # `eligible` said so
    return Parts(schedule, step, plan.model.n_layers, grad_clip, plan.optimizer)
  if why != "not blockwise" and is_primary():
    name = plan.optimizer
    print(f"note: --optimizer {name} with {why} runs optim.{name} over full gradients (every gradient computed, every "
          f"parameter kept in float32), not the blockwise step", file=sys.stderr)
  return None
