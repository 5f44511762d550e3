"""The registry agrees with its factories: every numeric range an optimizer declares in its signature
(`optim/hparams.py`) admits exactly what the factory accepts. At each end the range admits, the factory builds and
initialises on a model-shaped parameter tree, and the optimizer's declared needs are computed; just past each end
(or at an open one), `get_optimizer` and the needs refuse it in one `UnknownOptimizerError` line, never with another
error (BREAD's needs divided by `rank`: a ZeroDivisionError once)."""

import jax.numpy as jnp
import pytest

from optim import registry
from optim.registry import UnknownOptimizerError

PARAMS = {"embed_VD": jnp.ones((16, 8)), "final_norm": jnp.ones((8,)),
          "blocks": {"wq_DQ": jnp.ones((2, 8, 8)), "w_up_DF": jnp.ones((2, 8, 16)), "attn_norm": jnp.ones((2, 8))}}


def cases(inside: bool) -> list[tuple[str, str, float]]:
  """(optimizer, hyperparameter, value): each end a declared range admits (`inside`), or the value just past it."""
  out = []
  for name in sorted(registry.OPTIMIZERS):
    for key, (kind, declared) in registry.schema(name).items():
      if not isinstance(declared, tuple) or kind.removesuffix(" | None") not in ("int", "float"):
        continue
      lo, hi, open_low = declared
      step = 1 if kind.startswith("int") else 1e-3
      if inside:
        out += [(name, key, v) for v in ((None if open_low else lo), hi) if v is not None]
        if open_low:  # the smallest value it admits, near the open end
          out.append((name, key, lo + step))
      else:
        out += [(name, key, v) for v in ((lo if open_low else None if lo is None else lo - step),
                                         None if hi is None else hi + step) if v is not None]
  return out


@pytest.mark.parametrize("name,key,value", cases(inside=True))
def test_the_factory_accepts_each_end_its_range_admits(name, key, value):
  registry.check_hparams(name, {key: value})
  tx = registry.get_optimizer(name, 1e-3, **{key: value})
  tx.init(PARAMS)
  registry.needs(name, {key: value})


@pytest.mark.parametrize("name,key,value", cases(inside=False))
def test_a_value_past_its_range_is_one_line_before_the_needs_read_it(name, key, value):
  for call in (lambda: registry.get_optimizer(name, 1e-3, **{key: value}), lambda: registry.needs(name, {key: value})):
    with pytest.raises(UnknownOptimizerError) as e:
      call()
    assert len(str(e.value).splitlines()) == 1 and key in str(e.value)


def test_the_cases_cover_the_ranges():
  """Both lists are built from the declarations (not empty), BREAD's rank and inactive_lr_ratio among them."""
  inside, past = cases(True), cases(False)
  assert ("bread", "rank", 1) in inside and ("bread", "rank", 0) in past
  assert ("bread", "inactive_lr_ratio", 0) in inside and ("bread", "inactive_lr_ratio", -1e-3) in past
  assert ("muon", "beta", 1) in inside and ("muon", "beta", 1 + 1e-3) in past
  assert len({n for n, _, _ in inside}) == len(registry.OPTIMIZERS)
