"""What a hyperparameter may be, declared in its factory's signature: `b1: Beta = 0.9`.

A factory annotates each number with its `Range` and each string with its `Choices`, as `Annotated` metadata
(`Annotated[str, Choices(ORDERS)]`, or an alias below: `Beta`, `NonNegative | None`), so one name can mean different
things in two optimizers (`momentum`: a coefficient in [0, 1] for SGD and Scion, "ema" or "classic" for Muon), as
optax keeps each hyperparameter's meaning with its factory. `optim.registry` reads the declarations (`declarations`)
for its schema and holds the values `get_optimizer` receives to them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a number may take: the closed interval [lo, hi], or (lo, hi] with `open_low`.

  Args:
    lo: the lower end; None: unbounded below.
    hi: the upper end; None: unbounded above.
    open_low: exclude `lo` itself.
  """
  lo: float | None
  hi: float | None
  open_low: bool = False


@dataclasses.dataclass(frozen=True)
class Choices:
  """The values a string may take (None among them where the hyperparameter is optional and None means something).

  Args:
    values: the allowed values, e.g. a tuple the optimizer's module defines (`optim.badam.ORDERS`).
  """
  values: tuple

  def __post_init__(self):
    object.__setattr__(self, "values", tuple(self.values))


NON_NEGATIVE = Range(0, None)
POSITIVE = Range(0, None, open_low=True)
Beta = Annotated[float, Range(0, 1)]  # a decay rate, momentum or interpolation coefficient
Fraction = Annotated[float, Range(0, 1)]  # a probability, a share or an exponent in [0, 1]
NonNegative = Annotated[float, NON_NEGATIVE]  # eps, weight decay, a correction's strength
Positive = Annotated[float, POSITIVE]  # a scale or step size that 0 would switch off
Count = Annotated[int, Range(1, None)]  # a period, a rank, a size: at least 1
NonNegativeInt = Annotated[int, NON_NEGATIVE]  # iterations, seeds, indices: 0 allowed
Declaration = Range | Choices


@functools.cache
def declarations(factory: Callable[..., Any]) -> Mapping[str, tuple[str, Declaration | None]]:
  """Each parameter of `factory`: its annotation as written without the metadata, and its `Range` or `Choices`.

  Args:
    factory: a function whose signature may carry `Annotated` metadata (a string annotation under
      `from __future__ import annotations` is resolved in its module, through `functools.wraps` wrappers).

  Returns:
    {name: (annotation text, e.g. "float | None" for `Beta | None`, declaration or None)}, in signature order; the
    text of an annotation with no metadata is as written.
  """
  hints = typing.get_type_hints(factory, include_extras=True)
  namespace = {**globals(), **getattr(inspect.unwrap(factory), "__globals__", {})}
  return types.MappingProxyType({key: (_text(p.annotation, namespace), _declared(hints.get(key)))
                                 for key, p in inspect.signature(factory).parameters.items()})


def _declared(hint: Any) -> Declaration | None:
  """The `Range` or `Choices` in `hint` or in a member of its union (`Beta | None`); the outermost one wins."""
  parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
  found = [m for part in parts for m in getattr(part, "__metadata__", ()) if isinstance(m, (Range, Choices))]
  return found[-1] if found else None


def _text(annotation: Any, namespace: dict[str, Any]) -> str:
  """`annotation` as written, with `Annotated[X, ...]` read as X and an alias over a builtin (`Beta`) as that builtin.

  The registry reads the text ("float", "str | None", "Factor", "optax.ScalarOrSchedule | None") for the kind of
  value a hyperparameter takes. An annotation evaluated already (a module without `from __future__ import
  annotations`) that carries a declaration is written back from its type: `Beta | None` as "float | None".
  """
  if not isinstance(annotation, str):
    return _written(annotation) if _declared(annotation) is not None else str(annotation)
  stripper = _Strip(namespace)
  tree = stripper.visit(ast.parse(annotation, mode="eval"))
  return ast.unparse(tree) if stripper.changed else annotation


def _written(hint: Any) -> str:
  """An evaluated annotation as the text a module with postponed annotations would hold, without its metadata."""
  if typing.get_origin(hint) is Annotated:
    return _written(hint.__origin__)
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return " | ".join(_written(part) for part in typing.get_args(hint))
  if hint is type(None):
    return "None"
  return hint.__name__ if isinstance(hint, type) and hint.__module__ == "builtins" else str(hint)


class _Strip(ast.NodeTransformer):
  """Rewrites an annotation's syntax tree without its `Annotated` metadata (see `_text`).

  Args:
    namespace: where an alias's name is looked up (the factory's module, then this one's).
  """

  def __init__(self, namespace: dict[str, Any]):
    self.namespace, self.changed = namespace, False

  def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
    name = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
    if name != "Annotated":
      return self.generic_visit(node)
    self.changed = True
    return self.visit(node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice)

  def visit_Name(self, node: ast.Name) -> ast.AST:
    alias = self.namespace.get(node.id)
    base = getattr(alias, "__origin__", None)
    if typing.get_origin(alias) is not Annotated or not isinstance(base, type) or base.__module__ != "builtins":
      return node
    self.changed = True
    return ast.Name(base.__name__)
