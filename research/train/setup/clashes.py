"""What does not combine: every rule, one row each, of the features a run's flags, mesh and optimizer give it.

`CLASHES` rows are (a feature of the run, the features it does not combine with, why), and each update argument an
optimizer declares adds the rows its declaration gives (research/train/steps/update_args.py `UpdateArg.clashes`, its
feature named "arg:NAME"); `check` refuses the first row that applies, in one line. `blockwise_blockers` names what
keeps a blockwise optimizer on its optax transform over full gradients instead of its blockwise step
(research/train/steps/blockstep.py). What trains is research/train/config/trainable.py.
"""

from __future__ import annotations

from optim import Needs
from research.train.config import RunError
from research.train.steps import update_args
from sharding.mesh import CONTEXT, STAGE

# (feature, the features it does not combine with, why): each row one RunError line when it applies
CLASHES = (
    ("sync", ("peft", "switch_at", "zero1", "stage", "moe"), "keeps a copy of the parameters per data replica"),
    ("freeze_layers", ("blocks", "peft", "update_args", "zero1", "sync", "switch_at", "stage", "context"),
     "stops the backward at layer N and supplies no update arguments"),
    ("peft", ("freeze", "switch_at", "stage"), "trains the adapters only"),
    ("observe", ("sync",), "observers run in the step that keeps one copy of the parameters"),
)
# the features under which a blockwise optimizer runs its optax transform over full gradients instead
BLOCKWISE_BLOCKERS = ("stage", "context", "sync", "freeze", "peft", "zero1", "switch_at")


def features(declared: dict[str, str | None], mesh, mcfg, optimizer: str, needs: Needs) -> dict[str, str | None]:
  """The run's features, by the names `CLASHES` uses.

  Args:
    declared: the features its config's sections declare (`TrainConfig.features`: --sync, --zero1, --peft, ...).
    mesh: its mesh.
    mcfg: its model config (None: the model's features are unknown, taken as off).
    optimizer: its --optimizer, as messages name it.
    needs: the optimizer's declared needs.

  Returns:
    {feature: how a message names it when the run has it, else None}.
  """
  args = ", ".join(sorted(needs.update_args))
  on = {**declared,
        "stage": "a stage mesh axis" if mesh.shape[STAGE] > 1 else None,
        "context": "a context mesh axis" if mesh.shape[CONTEXT] > 1 else None,
        "moe": "a MoE model" if mcfg is not None and mcfg.moe else None,
        "blocks": f"--optimizer {optimizer} (its own blocks)" if needs.block_coordinate else None,
        "update_args": f"--optimizer {optimizer}'s update arguments ({args})" if args else None}
  for arg in update_args.declared(needs.update_args):
    on[f"arg:{arg.name}"] = f"--optimizer {optimizer}'s update argument {arg.name}"
  return on


def rows(update_arg_names) -> tuple:
  """`CLASHES` and the rows the declared update arguments add.

  Args:
    update_arg_names: the optimizer's declared update arguments.

  Returns:
    (feature, the features it does not combine with, why) rows.
  """
  extra = tuple((feature, (f"arg:{a.name}",), why) for a in update_args.declared(update_arg_names)
                for feature, why in a.clashes.items())
  return CLASHES + extra


def check(on: dict[str, str | None], optimizer: str, needs: Needs) -> None:
  """Refuses a run some row of `CLASHES` applies to.

  Args:
    on: the run's features (`features`).
    optimizer: its --optimizer, as messages name it.
    needs: the optimizer's declared needs.

  Raises:
    RunError: one line for the first row whose feature the run has together with one it does not combine with.
  """
  table = rows(needs.update_args)
  unknown = sorted({s for s, _, _ in table} - set(on))
  if unknown:  # a declaration's typo, said in one line
    raise RunError(f"--optimizer {optimizer}'s update arguments declare clashes with unknown run features "
                   f"{', '.join(unknown)}; the features are {', '.join(sorted(on))}")
  for subject, others, why in table:
    named = [n for n in (on.get(o) for o in others) if n]
    if on[subject] and named:
      raise RunError(f"{on[subject]} does not combine with {', '.join(named)} ({why})")


def blockwise_blockers(on: dict[str, str | None]) -> list[str]:
  """What keeps a blockwise optimizer off its blockwise step in this run.

  Args:
    on: the run's features (`features`).

  Returns:
    The run's features among `BLOCKWISE_BLOCKERS`, as messages name them (empty: none).
  """
  return [n for n in (on[b] for b in BLOCKWISE_BLOCKERS) if n]
