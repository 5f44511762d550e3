"""The AdamW group of a Muon-style hybrid, written once.

`AdamGroup` holds its settings and their one docstring; `with_adam_group` gives a hybrid factory the flat `adam_*`
keyword arguments its users, the registry and `--opt` know (adam_learning_rate, adam_b1, adam_b2, adam_eps,
adam_weight_decay) while the factory itself takes one `adam`.

The hybrids (muon, normuon, adamuon, cautious_muon, mgup_muon, muon_mvr, dion) route the leaves `muon_labels` gives
to AdamW (embedding, head, norms, biases) through `AdamGroup.tx` inside `optim.muon.muon_with_adamw`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import jax
import optax

from optim.hparams import NON_NEGATIVE, Beta, NonNegative
from optim.registry import decay_mask


@dataclasses.dataclass(frozen=True)
class AdamGroup:
  """The AdamW group's settings; a hybrid factory takes each as the keyword argument named in brackets.

  Each field's annotation declares its range (`optim.hparams`), which the flat keyword argument carries.

  Args:
    learning_rate: [adam_learning_rate] the group's learning rate or schedule; None: the factory's `learning_rate`.
    b1: [adam_b1] AdamW's β1 (default 0.9).
    b2: [adam_b2] AdamW's β2 (default 0.95).
    eps: [adam_eps] AdamW's ε (default 1e-8).
    weight_decay: [adam_weight_decay] the group's decoupled weight decay (none on norms); None: the factory's
      `weight_decay`.
  """
  learning_rate: Annotated[optax.ScalarOrSchedule | None, NON_NEGATIVE] = None
  b1: Beta = 0.9
  b2: Beta = 0.95
  eps: NonNegative = 1e-8
  weight_decay: NonNegative | None = None

  def tx(self, learning_rate: optax.ScalarOrSchedule, weight_decay: float,
         mu_dtype: jax.typing.DTypeLike | None = None) -> optax.GradientTransformation:
    """`optax.adamw` on the group, with no decay on norms (`decay_mask`).

    Args:
      learning_rate: the factory's learning rate (used unless the group has its own).
      weight_decay: the factory's weight decay (used unless the group has its own).
      mu_dtype: the first moment's dtype; default: the parameter's.

    Returns:
      The group's optimizer.
    """
    return optax.adamw(learning_rate if self.learning_rate is None else self.learning_rate, b1=self.b1, b2=self.b2,
                       eps=self.eps, weight_decay=weight_decay if self.weight_decay is None else self.weight_decay,
                       mu_dtype=mu_dtype, mask=decay_mask)


ADAM = AdamGroup()  # the defaults (a factory's `adam` default)
# the flat keyword arguments: (name, annotation as written on the AdamGroup field, AdamGroup field)
KWARGS = tuple((f"adam_{field}", AdamGroup.__annotations__[field], field)
               for field in ("learning_rate", "b1", "b2", "eps", "weight_decay"))


def with_adam_group(factory: Callable[..., Any]) -> Callable[..., Any]:
  """A hybrid factory that takes `adam: AdamGroup` made to take the flat `adam_*` keyword arguments instead.

  The result's signature has the five `KWARGS` in the place of `adam` (what `inspect.signature`, the registry's
  schema, `optax.inject_hyperparams` and `--opt` read), each annotated as its `AdamGroup` field (its type hints too,
  for the ranges the registry reads); it builds the `AdamGroup` and calls `factory`. An `adam=`
  keyword (an `AdamGroup` given whole) is still taken, but not together with the flat ones.

  Args:
    factory: an optimizer factory with a keyword-only `adam: AdamGroup` parameter.

  Returns:
    The factory with flat AdamW-group keyword arguments.
  """
  sig = inspect.signature(factory)
  defaults = AdamGroup()
  params = []
  for p in sig.parameters.values():
    if p.name == "adam":
      params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, field),
                                   annotation=annotation) for name, annotation, field in KWARGS]
    else:
      params.append(p)

  @functools.wraps(factory)
  def flat(*args, **kwargs):
    group = {field: kwargs.pop(name) for name, _, field in KWARGS if name in kwargs}
    if "adam" in kwargs and group:
      raise TypeError(f"give the AdamW group as adam= or as {', '.join(n for n, _, _ in KWARGS)}, not both")
    return factory(*args, **{"adam": AdamGroup(**group), **kwargs})  # an AdamGroup given whole is taken as it is

  flat.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
  hints = typing.get_type_hints(AdamGroup, include_extras=True)
  flat.__annotations__ = {**{k: v for k, v in factory.__annotations__.items() if k != "adam"},
                          **{name: hints[field] for name, _, field in KWARGS}}
  return flat
