"""What an optimizer asks of the trainer beyond `update(grads, state, params)`.

An optimizer's registry entry declares it (`optim.registry.register(name, needs=...)`), as a `Needs` or as a function
of the resolved hyperparameters returning one (MARS needs the previous gradients only in its exact mode). A trainer
reads the declaration and acts on it (research/train/): it never tests an optimizer's name. What can be declared:

  update_args   extra keyword arguments of `update`, each one the trainer supplies as its declaration says
                (research/train/steps/update_args.py `ARGS`, e.g. "prev_grads", the gradient at the previous
                parameters on the current batch, and "max_logits", each attention head's largest logit in the step's
                forward pass). A trainer refuses a name it has no declaration for.
  blockwise     a block-coordinate optimizer that can run as one block's step (`Blockwise`: backprop stops at the
                active layer, only it has a float32 master and optimizer state), or `not_blockwise`: why these
                hyperparameters run over full gradients instead.
  model_refuses model settings the optimizer cannot train under: (config field, why) pairs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Inactive:
  """The layers above the active block, updated in the same backward as it reaches them (BREAD).

  Args:
    mode: "sgd" (θ ← θ − ratio·lr_t·g, or its sign) or "lowrank" (rank-`rank` factors with their own AdamW).
    ratio: their learning rate as a multiple of the active block's.
    sign: mode "sgd": step by the gradient's sign.
    rank: mode "lowrank": the factors' rank.
    scale: mode "lowrank": s = alpha / rank, the factors' product's scale.
  """
  mode: str
  ratio: float
  sign: bool
  rank: int
  scale: float


@dataclasses.dataclass(frozen=True)
class Blockwise:
  """A block-coordinate optimizer as a trainer's blockwise step runs it: layer blocks, AdamW on the active one.

  Args:
    switch_every: updates between block switches.
    order: the block order ("ascending", "descending", "random").
    seed: the random order's seed.
    start_block: the first active block (None: the order's first).
    b1: the active block's AdamW β1.
    b2: the active block's AdamW β2.
    eps: the active block's AdamW ε.
    weight_decay: the active block's AdamW weight decay (on `optim.decay_mask`'s leaves).
    inactive: what happens to the layers above the active one in the same backward (None: nothing).
  """
  switch_every: int
  order: str
  seed: int
  start_block: int | None
  b1: float
  b2: float
  eps: float
  weight_decay: float
  inactive: Inactive | None = None


@dataclasses.dataclass(frozen=True)
class Needs:
  """An optimizer's declared needs from the trainer (see the module docstring).

  Args:
    update_args: the names of the keyword arguments `update` takes (a trainer's declared update arguments).
    blockwise: the blockwise step's plan, when these hyperparameters allow one.
    not_blockwise: for a block-coordinate optimizer whose hyperparameters rule the blockwise step out, why
      (a phrase naming the hyperparameter, e.g. "include_embedding=True").
    model_refuses: (model config field, why) pairs: a model with that field set cannot be trained by it.
  """
  update_args: frozenset[str] = frozenset()
  blockwise: Blockwise | None = None
  not_blockwise: str | None = None
  model_refuses: tuple[tuple[str, str], ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "update_args", frozenset(self.update_args))
    if not all(isinstance(n, str) and n.isidentifier() for n in self.update_args):
      raise ValueError(f"update arguments must be keyword names, got {sorted(map(repr, self.update_args))}")

  @property
  def block_coordinate(self) -> bool:
    """Whether the optimizer trains one block at a time (its own notion of what trains)."""
    return self.blockwise is not None or self.not_blockwise is not None
