"""The registry's schema: every hyperparameter of every registered optimizer has a declared type and range (a number),
choice set (a string) or check (a pattern list, or the factory's own type), and `get_optimizer` holds values to it."""

import math

import numpy as np
import pytest

from optim import OPTIMIZERS, UnknownOptimizerError, get_optimizer, hyperparameters
from optim.badam import BAdamError, badam_labels
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
