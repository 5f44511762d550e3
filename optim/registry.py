"""Optimizers by name, for the train CLI and sweeps: name -> factory(learning_rate, **hyperparameters).

Every factory returns an optax GradientTransformation; hyperparameters a caller leaves out take
the factory's defaults. A new optimizer plugs in with `@register("name")`, each hyperparameter's range or choices
declared in its own signature (`optim.hparams`: `b1: Beta = 0.9`), where the registry's schema and checks read them.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import optax

from optim.hparams import Beta, Choices, Declaration, NonNegative, Range, declarations
from optim.needs import Needs
from optim.trees import is_named_vector, leaf_name, reject_complex

OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {}
DEFAULT_OPTIMIZER = "adamw"  # what a trainer uses when no optimizer is named
# name -> what it asks of the trainer (optim/needs.py): a Needs, or a function of the resolved hyperparameters
NEEDS: dict[str, Needs | Callable[[dict], Needs]] = {}
PyTree = Any
Factory = TypeVar("Factory", bound=Callable[..., optax.GradientTransformation])


# Hyperparameters that `optax.inject_hyperparams` must be told are static (`static_args=`): loop counts, which a
# traced value cannot drive (optax's own tests list ns_steps the same way). Every other hyperparameter of every
# registered factory is injectable as is (tests/optim/test_optax_suite.py checks the whole registry).
STATIC_ARGS = ("ns_steps", "rank_fraction",  # rank_fraction: Dion's rank fixes the shape of its state
               "max_size_triangular",  # Kron: triangular or diagonal factors, fixed at init
               "max_precondition_dim",  # SOAP: which sides get a factor, fixed at init
               "rank")  # BREAD: the low-rank factors' shapes


class UnknownOptimizerError(ValueError):
  """An optimizer name or hyperparameter the registry does not know, or a hyperparameter value it cannot use."""


# Every hyperparameter's schema: its type is its annotation in the factory's signature, and a value must match it
# (`float`: a finite number, `int`: an integer, `bool`, `str`, `Sequence[str]`: a list of strings, never one string,
# each optionally `| None`). A number lies in the `Range` and a string in the `Choices` its annotation declares
# (`optim.hparams`: `b1: Beta`, `order: Annotated[str, Choices(ORDERS)]`), so one name can mean different things in two
# optimizers. The annotations in `FACTORY_CHECKED` are the factory's to check (MGUP's tau, alpha, gamma as
# `optim.alignment.Scalar` / `Factor`, which also take symbolic strings; dtypes, schedules, Newton–Schulz tables as
# `optim.newton_schulz.Coeffs`, Dion's split, a custom orthogonalizer); a number given to one still lies in its declared
# range. What a value means for a model (a block index within the model's blocks, a path pattern that matches some
# parameter) is checked by the optimizer's init, which the trainer runs on the abstract parameters before any work.
# tests/optim/test_registry_schema.py holds every registered hyperparameter to a declared type and range.
FACTORY_CHECKED = ("Scalar", "Factor", "Coeffs", "Split | None", "jax.typing.DTypeLike | None",
                   "optax.ScalarOrSchedule | None", "Callable[[jax.Array], jax.Array] | None")


def _range(declared: Declaration | None) -> tuple | None:
  """(lo, hi, open lower end) of a number's declared `Range`, or None when it has none."""
  return (declared.lo, declared.hi, declared.open_low) if isinstance(declared, Range) else None


def _choices(declared: Declaration | None) -> tuple | None:
  """The allowed values of a string's declared `Choices`, or None when it has none."""
  return declared.values if isinstance(declared, Choices) else None


def schema(name: str) -> dict[str, tuple[str, Any]]:
  """Each hyperparameter of optimizer `name`: (its type as annotated, its range or choice set or None).

  Args:
    name: a registered optimizer.

  Returns:
    {key: (annotation text, (lo, hi, open lower end) for a number, the allowed values for a string, "patterns" for a
    list of path patterns (each must match a parameter: the optimizer's init checks it), "factory" for an annotation
    in `FACTORY_CHECKED`, None for a bool or an undeclared one)}; `learning_rate`, `mask` and `labels`
    are not hyperparameters.

  Raises:
    UnknownOptimizerError: when `name` is not registered.
  """
  out = {}
  if name not in OPTIMIZERS:
    raise UnknownOptimizerError(f"unknown optimizer {name!r}; registered: {', '.join(sorted(OPTIMIZERS))}")
  parameters = declarations(OPTIMIZERS[name])  # (annotation text, declared range or choices) by parameter
  for key in hyperparameters(name):
    kind, declared = parameters[key]
    base = kind.removesuffix(" | None")
    out[key] = (kind, "factory" if kind in FACTORY_CHECKED else _range(declared) if base in ("int", "float")
                else _choices(declared) if base == "str" else "patterns" if base == "Sequence[str]" else None)
  return out


def _check_value(name: str, key: str, value, annotation: str, declared: Declaration | None):
  """Raises UnknownOptimizerError unless `value` suits hyperparameter `key` of `name` (annotation, range, choices)."""
  def refuse(why):
    raise UnknownOptimizerError(f"optimizer {name!r}: {key}={value!r} {why}")
  kind, _, optional = annotation.partition(" | ")
  if optional == "None" and value is None:
    return
  if kind == "Sequence[str]":
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
      refuse(f'must be a list of strings, as {key}=["a","b"] (a string is not a list of patterns)')
    return
  if hasattr(value, "dtype") and hasattr(value, "shape"):  # an array (inject_hyperparams, a traced value): as is
    return
  number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy scalars included
  if kind == "bool" and not isinstance(value, bool):
    refuse("must be true or false")
  if kind == "int" and not (isinstance(value, numbers.Integral) and number):
    refuse("must be an integer")
  if kind == "float" and not number:
    refuse("must be a number")
  if kind == "str" and not isinstance(value, str):
    refuse("must be a string")
  if kind == "optax.ScalarOrSchedule" and not (number or callable(value)):  # a schedule is a function of the step
    refuse("must be a number or a schedule")
  if kind in ("int", "float") or number and _range(declared) is not None:  # a number under any annotation: its range
    if not math.isfinite(value):
      refuse("must be finite")
    lo, hi, open_lo = _range(declared) or (None, None, False)
    if (lo is not None and (value < lo or open_lo and value == lo)) or (hi is not None and value > hi):
      refuse(f"must lie in {'(' if open_lo else '['}{lo}, {'inf)' if hi is None else f'{hi}]'}")
  if kind == "str":
    allowed = _choices(declared)
    if allowed is not None and value not in allowed:
      refuse(f"must be one of {', '.join(map(str, allowed))}")


def register(name: str, *,
             needs: Needs | Callable[[dict], Needs] | None = None) -> Callable[[Factory], Factory]:
  """Registers an optimizer factory under `name` (a decorator).

  Args:
    name: the name `get_optimizer` and the train CLI's `--optimizer` know it by.
    needs: what it asks of the trainer beyond `update(grads, state, params)` (`optim.needs.Needs`), or a function
      of the resolved hyperparameters (every one, defaults filled in) returning it; None: nothing.

  Returns:
    The decorator, which returns the factory unchanged.
  """
  def add(factory):
    OPTIMIZERS[name] = factory
    if needs is not None:
      NEEDS[name] = needs
    return factory
  return add


def decay_mask(params: PyTree) -> Any:
  """Weight decay applies to weight matrices and embeddings, never to norm scales, biases or other named vectors.

  Named vectors are `m_O` and the like (`is_named_vector`). The rule goes by parameter name, so it is visible and
  overridable.

  Args:
    params: the parameter tree.

  Returns:
    The params' structure of bools: False where the leaf's name contains "norm" or "bias" or is a named vector, True
    elsewhere (a bare array decays).
  """
  def decays(path, _):
    name = leaf_name(path).lower()  # '' for a bare array: it decays
    return not ("norm" in name or "bias" in name or is_named_vector(path))
  return jax.tree_util.tree_map_with_path(decays, params)


@register("adamw")
def adamw(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.95, eps: NonNegative = 1e-8,
          weight_decay: NonNegative = 0.1, mu_dtype: jax.typing.DTypeLike | None = None,
          mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """AdamW (Loshchilov & Hutter, 2019) with decoupled weight decay on matrices and embeddings.

  Complex parameters work as in optax.adamw.

  Args:
    learning_rate: the learning rate or schedule.
    b1: the first moment's decay β1 (default 0.9).
    b2: the second moment's decay β2 (default 0.95).
    eps: added to the second moment's root (default 1e-8).
    weight_decay: decoupled weight decay (default 0.1).
    mu_dtype: stores the first moment in that dtype (default: the parameter's).
    mask: where weight decay applies: a bool tree or a function of the params; None = `decay_mask`.

  Returns:
    `optax.adamw` with these hyperparameters.

  References:
    Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
  """
  return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mu_dtype=mu_dtype,
                     mask=decay_mask if mask is None else mask)


@register("sgd")
def sgd(learning_rate: optax.ScalarOrSchedule, *, momentum: Beta = 0.9, nesterov: bool = True,
        weight_decay: NonNegative = 0.0, accumulator_dtype: jax.typing.DTypeLike | None = None,
        mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """SGD with (Nesterov) momentum; weight decay added to the gradient (L2, coupled; `mask` as `adamw`).

  The momentum buffer (in `accumulator_dtype`, default the parameter's) is always kept, so `momentum` can be
  injected or scheduled; momentum=0 is plain SGD (the buffer then equals the gradient).

  Args:
    learning_rate: the learning rate or schedule.
    momentum: the momentum coefficient (default 0.9; 0 is plain SGD).
    nesterov: Nesterov momentum (default True).
    weight_decay: L2 weight decay added to the gradient (default 0).
    accumulator_dtype: the momentum buffer's dtype (default: the parameter's).
    mask: where weight decay applies: a bool tree or a function of the params; None = `decay_mask`.

  Returns:
    `optax.add_decayed_weights` chained with `optax.sgd`.
  """
  return optax.chain(optax.add_decayed_weights(weight_decay, decay_mask if mask is None else mask),
                     optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov,
                               accumulator_dtype=accumulator_dtype))


@register("lion")
def lion(learning_rate: optax.ScalarOrSchedule, *, b1: Beta = 0.9, b2: Beta = 0.99, weight_decay: NonNegative = 0.1,
         mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
  """Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight decay (`mask` as `adamw`).

  Args:
    learning_rate: the learning rate or schedule.
    b1: the interpolation between momentum and gradient whose sign is the update (default 0.9).
    b2: the momentum's decay (default 0.99).
    weight_decay: decoupled weight decay (default 0.1).
    mask: where weight decay applies: a bool tree or a function of the params; None = `decay_mask`.

  Returns:
    `optax.lion` with these hyperparameters, whose init rejects complex parameters (the sign of a complex number).

  References:
    Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023.
  """
  return reject_complex(optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
                                   mask=decay_mask if mask is None else mask), "lion", "the sign of a complex number")


def get_optimizer(name: str, learning_rate: optax.ScalarOrSchedule, **hparams: Any) -> optax.GradientTransformation:
  """The registered optimizer `name`; unknown names and hyperparameters raise UnknownOptimizerError.

  Each hyperparameter is checked against its annotation in the factory's signature and the range or choices it
  declares (`optim.hparams`) before the factory runs; a plain ValueError or TypeError from the factory becomes an
  UnknownOptimizerError of one line (the optimizers' own errors, e.g. AlignmentError, pass through).

  Args:
    name: a registered optimizer.
    learning_rate: the learning rate or schedule; a number must be finite and >= 0.
    **hparams: hyperparameters of the factory; the ones left out take its defaults.

  Returns:
    The factory's transformation.

  Raises:
    UnknownOptimizerError: when `name` is not registered, a hyperparameter is not the factory's, a value does not
      suit its annotation or range, the learning rate is negative or not finite, or the factory refuses a value
      with a plain ValueError or TypeError.
    ValueError: the factory's own error (a class defined in `optim`, e.g. AlignmentError, BAdamError), re-raised.
  """
  check_hparams(name, hparams)
  factory = OPTIMIZERS[name]
  if isinstance(learning_rate, (int, float)) and not (math.isfinite(learning_rate) and learning_rate >= 0):
    raise UnknownOptimizerError(f"optimizer {name!r}: learning rate {learning_rate!r} must be finite and >= 0")
  try:
    return factory(learning_rate, **hparams)
  except ValueError as e:
    if type(e).__module__.startswith("optim."):  # the factory's own error (AlignmentError, BAdamError, ...)
      raise
    # a plain ValueError from a shared check (muon's scale, an orthogonalizer that is not a function): one line
    raise UnknownOptimizerError(f"optimizer {name!r}: {str(e).splitlines()[0] if str(e) else 'ValueError'}") \
        from None
  except TypeError as e:  # a value the factory cannot take (its own ValueErrors, e.g. AlignmentError, pass through)
    raise UnknownOptimizerError(f"optimizer {name!r}: {str(e).splitlines()[0] if str(e) else 'TypeError'}") \
        from None


def check_hparams(name: str, hparams: dict[str, Any]) -> None:
  """Refuses hyperparameters optimizer `name` does not take, and values that do not suit their annotation or range.

  Args:
    name: a registered optimizer.
    hparams: the hyperparameters given.

  Raises:
    UnknownOptimizerError: an unknown optimizer or hyperparameter, or a value out of its type, range or choices.
  """
  if name not in OPTIMIZERS:
    raise UnknownOptimizerError(f"unknown optimizer {name!r}; registered: {', '.join(sorted(OPTIMIZERS))}")
  parameters = declarations(OPTIMIZERS[name])
  accepted = set(parameters) - {"learning_rate"}
  unknown = sorted(set(hparams) - accepted)
  if unknown:
    raise UnknownOptimizerError(f"optimizer {name!r} has no hyperparameter {', '.join(unknown)}; "
                                f"it takes {', '.join(sorted(accepted))}")
  for key, value in hparams.items():
    _check_value(name, key, value, *parameters[key])


def hyperparameters(name: str) -> dict[str, Any]:
  """The defaults of optimizer `name`'s hyperparameters (for the CLI's help and saved configs).

  Args:
    name: a registered optimizer.

  Returns:
    Each parameter of its factory but `learning_rate`, `mask` and `labels`, with its default.

  Raises:
    UnknownOptimizerError: when `name` is not registered.
  """
  if name not in OPTIMIZERS:
    raise UnknownOptimizerError(f"unknown optimizer {name!r}; registered: {', '.join(sorted(OPTIMIZERS))}")
  sig = inspect.signature(OPTIMIZERS[name])
  return {k: p.default for k, p in sig.parameters.items() if k not in ("learning_rate", "mask", "labels")}


def needs(name: str, hparams: dict | None = None) -> Needs:
  """What optimizer `name` with these hyperparameters (the rest at their defaults) asks of the trainer.

  Args:
    name: a registered optimizer.
    hparams: the hyperparameters given (None: all at their defaults).

  Returns:
    Its `optim.needs.Needs` (empty for an optimizer that declares nothing), for hyperparameters `check_hparams`
    accepts (its UnknownOptimizerError passes through): a declaration that depends on them never reads a value out of
    range (BREAD's alpha / rank).
  """
  check_hparams(name, hparams or {})
  declared = NEEDS.get(name, Needs())
  return declared({**hyperparameters(name), **(hparams or {})}) if callable(declared) else declared


def needs_prev_grads(name: str, hparams: dict | None = None) -> bool:
  """Whether optimizer `name` with these hyperparameters wants `update(..., prev_grads=)`.

  Args:
    name: a registered optimizer.
    hparams: the hyperparameters given (None: all at their defaults).

  Returns:
    Whether "prev_grads", the gradient at the previous parameters on the current batch, is among its declared
    `needs(...).update_args`.
  """
  return "prev_grads" in needs(name, hparams).update_args


def needs_max_logits(name: str, hparams: dict | None = None) -> bool:
  """Whether optimizer `name` wants `update(..., max_logits=)`.

  Args:
    name: a registered optimizer.
    hparams: the hyperparameters given (None: all at their defaults).

  Returns:
    Whether "max_logits", the model's per-head attention-logit maxima stacked like the blocks, is among its declared
    `needs(...).update_args`.
  """
  return "max_logits" in needs(name, hparams).update_args
