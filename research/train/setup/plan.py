"""The run's plan: what its flags decide, resolved once where its programs are built (research/train/setup/run.py
`programs`) and handed, frozen, to every part that acts on it beside the config section that part reads.

The optimizer's declared needs (`optim.Needs`), the model config, the mesh, what trains (`Trainable`, the blockwise
step decided), --sync, the run's features (what research/train/setup/clashes.py's table reads), the seed and --zero1.
A part of the trainer receives the plan and its own section, never the whole config
(tests/research/test_plan.py holds the trainer to at most five functions that take it: the entry points).
"""

from __future__ import annotations

import dataclasses

import jax

from models import TransformerConfig
from optim import Needs
from research.train.config.sections import OptimSection, SyncSection, TrainsSection
from research.train.config.trainable import Trainable
from research.train.setup import blockwise, clashes


@dataclasses.dataclass(frozen=True)
class Plan:
  """A run's decisions (see the module docstring).

  Args:
    optimizer: --optimizer, as messages name it.
    needs: what it asks of the trainer, as its registry entry declares it (computed once per run).
    model: the model config (the preset or --init-from's, single fields overridden, what update arguments read).
    mesh: the device mesh the run starts on.
    trains: what trains (--freeze, --freeze-layers, --peft, the blockwise step) and in which dtypes.
    sync: how the data replicas agree (--sync and DiLoCo's outer optimizer).
    features: {feature: how a message names it when the run has it, else None} (`clashes.features`).
    init_from: where the weights come from (--init-from), or None: random.
    peft: --peft's method, or None.
    seed: --seed.
    zero1: --zero1.
  """
  optimizer: str
  needs: Needs
  model: TransformerConfig
  mesh: jax.sharding.Mesh
  trains: Trainable
  sync: SyncSection
  features: dict[str, str | None]
  init_from: str | None
  peft: str | None
  seed: int
  zero1: bool

  @classmethod
  def of(cls, optim: OptimSection, needs: Needs, model: TransformerConfig, mesh: jax.sharding.Mesh,
         trains: TrainsSection, init_from: str | None, sync: SyncSection, declared: dict[str, str | None], seed: int,
         zero1: bool) -> Plan:
    """The plan of a run with these settings: its features and what it trains resolved from them.

    Args:
      optim: the config's optim section.
      needs: the optimizer's declared needs (`build.optimizer_needs`).
      model: the model config (`build.model_config`).
      mesh: the mesh.
      trains: the config's trains section.
      init_from: --init-from (the weights section's), or None.
      sync: the config's sync section.
      declared: the features the config's sections declare (`TrainConfig.features`).
      seed: --seed.
      zero1: --zero1.

    Returns:
      The `Plan`.
    """
    on = clashes.features(declared, mesh, model, optim.optimizer, needs)
    what = Trainable.of_run(trains, init_from, blockwise.eligible(needs, on) is None)
    return cls(optim.optimizer, needs, model, mesh, what, sync, on, init_from, trains.peft, seed, zero1)
