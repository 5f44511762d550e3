"""The registry's schema: every hyperparameter of every registered optimizer has a declared type and range (a number),
choice set (a string) or check (a pattern list, or the factory's own type), declared in its factory's signature, and
`get_optimizer` holds values to it; one name means what each factory declares."""

from __future__ import annotations

import math
import typing
from typing import Annotated

import numpy as np
import optax
import pytest

from optim import OPTIMIZERS, UnknownOptimizerError, get_optimizer, hyperparameters, registry
from optim.badam import BAdamError, badam_labels
from optim.hparams import Beta, Choices, Range, declarations
from optim.registry import FACTORY_CHECKED, schema


def test_every_hyperparameter_of_every_optimizer_has_a_declared_type_and_range():
  undeclared = [f"{name}.{key} ({kind})" for name in sorted(OPTIMIZERS)
                for key, (kind, declared) in schema(name).items() if declared is None and kind not in ("bool",)]
  assert undeclared == []
  kinds = {kind for name in OPTIMIZERS for kind, _ in schema(name).values()}
  known = {"bool", "int", "float", "str", "int | None", "float | None", "str | None", "Sequence[str]", *FACTORY_CHECKED}
  assert kinds <= known, kinds - known  # a new annotation must be taught to the registry's check


def test_every_default_lies_in_its_declared_range_and_choices():
  for name in OPTIMIZERS:
    for key, (kind, declared) in schema(name).items():
      default = hyperparameters(name)[key]
      if default is None or declared in (None, "factory", "patterns"):
        continue
      if isinstance(declared, tuple) and len(declared) == 3 and not isinstance(declared[0], str) \
          and kind.startswith(("int", "float")):
        lo, hi, open_lo = declared
        assert math.isfinite(default) and (lo is None or default > lo or default == lo and not open_lo), (name, key)
        assert hi is None or default <= hi, (name, key)
      else:
        assert default in declared, (name, key, default, declared)


@pytest.mark.parametrize("name, hparams, says", [
    ("badam", {"always_active": "blocks"}, "must be a list of strings"),  # was 6 one-letter patterns
    ("badam", {"order": "sideways"}, "order='sideways' must be one of descending, ascending, random, fixed"),
    ("bread", {"inactive_lr_ratio": -0.5}, "must lie in [0, inf)"),  # 0 is BAdam: allowed
    ("dion", {"rank_fraction": 0.0}, "must lie in (0, 1]"),
    ("soap", {"precondition_frequency": 0}, "must lie in [1, inf)"),
    ("muon", {"momentum": "nesterov"}, "must be one of ema, classic"),
    ("scion", {"hidden_lmo": "frobenius"}, "must be one of"),
    ("adamw", {"b1": math.inf}, "must be finite"),
    ("muon", {"adam_learning_rate": -1.0}, "must lie in [0, inf)"),  # a number under a schedule's annotation
    ("muon", {"adam_learning_rate": "fast"}, "must be a number or a schedule"),
    ("sgd", {"momentum": "ema"}, "momentum='ema' must be a number"),  # muon's momentum, not sgd's
    ("muon", {"momentum": 0.5}, "momentum=0.5 must be a string"),  # sgd's momentum, not muon's
    ("mars", {"mode": "mvr1"}, "mode='mvr1' must be one of approx, exact"),  # muon_mvr's mode, not mars's
    ("muon_mvr", {"mode": "exact"}, "mode='exact' must be one of mvr1, mvr2"),
])
def test_values_outside_the_schema_are_refused_in_one_line(name, hparams, says):
  with pytest.raises(UnknownOptimizerError) as e:
    get_optimizer(name, 1e-3, **hparams)
  assert says in str(e.value) and "\n" not in str(e.value)


def test_a_pattern_that_matches_no_parameter_is_refused():
  params = {"blocks": {"wq": np.zeros((2, 3))}, "final_norm": np.zeros(3)}
  assert badam_labels(params, always_active=["final_norm"])["final_norm"] == "active"
  with pytest.raises(BAdamError, match="'nosuch' matches no parameter"):
    badam_labels(params, always_active=["final_norm", "nosuch"])


def test_every_declared_range_and_choice_set_is_annotated_in_its_factorys_signature():
  """No table beside the factories: a number's range and a string's choices are `Annotated` metadata in the type
  hints of the factory itself (a hybrid's adam_* ones too, through `with_adam_group`)."""
  for name, factory in OPTIMIZERS.items():
    hints = typing.get_type_hints(factory, include_extras=True)
    for key, (_, declared) in schema(name).items():
      if isinstance(declared, tuple):
        parts = (hints[key], *typing.get_args(hints[key]))  # Beta, or each member of Beta | None
        metadata = [m for part in parts for m in getattr(part, "__metadata__", ())]
        assert declared in [(m.lo, m.hi, m.open_low) if isinstance(m, Range) else m.values for m in metadata], \
            (name, key, hints[key])


@pytest.mark.parametrize("key, meanings", [
    ("momentum", {"sgd": ("float", (0, 1, False)), "scion": ("float", (0, 1, False)),
                  "muon": ("str", ("ema", "classic"))}),
    ("mode", {"mars": ("str", ("approx", "exact")), "bread": ("str", ("sgd", "lowrank")),
              "muon_mvr": ("str", ("mvr1", "mvr2"))}),
    ("alpha", {"bread": ("float", (0, None, True)), "mgup_adamw": ("Factor", "factory")}),
])
def test_one_name_means_what_each_factory_declares(key, meanings):
  assert {name: schema(name)[key] for name in meanings} == meanings


def _toy(learning_rate: optax.ScalarOrSchedule, *, eps: Annotated[float, Range(0, 1e-3)] = 1e-8,
         weight_decay: float = 0.0, decay: Beta | None = None,
         kind: Annotated[str, Choices(("plain", "signed"))] = "plain") -> optax.GradientTransformation:
  """SGD with hyperparameters that declare their own meaning: eps narrower than AdamW's, weight_decay no range."""
  return optax.sgd(learning_rate)


@pytest.fixture
def toy():
  """The toy optimizer registered for one test, and removed again (the registry is global)."""
  registry.register("toy_declared")(_toy)
  yield "toy_declared"
  registry.OPTIMIZERS.pop("toy_declared")


def test_a_factory_declares_its_ranges_and_choices_in_its_signature(toy):
  assert schema(toy) == {"eps": ("float", (0, 1e-3, False)), "weight_decay": ("float", None),
                         "decay": ("float | None", (0, 1, False)), "kind": ("str", ("plain", "signed"))}
  for hparams, says in [({"eps": 0.5}, "eps=0.5 must lie in [0, 0.001]"),
                        ({"decay": 1.5}, "decay=1.5 must lie in [0, 1]"),
                        ({"kind": "nesterov"}, "kind='nesterov' must be one of plain, signed")]:
    with pytest.raises(UnknownOptimizerError) as e:
      get_optimizer(toy, 0.1, **hparams)
    assert says in str(e.value) and "\n" not in str(e.value)
  get_optimizer(toy, 0.1, eps=1e-4, weight_decay=-1.0, decay=None, kind="signed")  # AdamW's ranges are AdamW's
  get_optimizer("adamw", 0.1, eps=0.5, weight_decay=0.1)


def test_an_evaluated_annotation_reads_as_written():
  """A factory from a module without postponed annotations declares the same way."""
  def factory(learning_rate, *, b2=None, kind="a"):
    return optax.sgd(learning_rate)
  factory.__annotations__ = {"b2": Beta | None, "kind": Annotated[str, Choices("ab")]}
  assert dict(declarations(factory)) == {"learning_rate": ("<class 'inspect._empty'>", None),
                                         "b2": ("float | None", Range(0, 1)), "kind": ("str", Choices(("a", "b")))}
