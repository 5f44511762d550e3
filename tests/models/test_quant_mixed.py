"""models/quant_mixed.py: the first-order loss change of quantizing one weight against a central finite difference,
Hutchinson's trace against the exact Hessian of a very small model, the exact knapsack against brute force, greedy
against exact, and a layout's plan and size against what the store writes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from models import Transformer, cross_entropy, preset, quant, quant_mixed, quant_store

TOKENS = np.random.default_rng(0).integers(0, 256, (4, 33))
X, Y = TOKENS[:, :-1], TOKENS[:, 1:]


@pytest.fixture(scope="module")
def tiny():
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  return model, quant_mixed.sensitivity(model, X, Y)


def _loss_with(model, path, layer, delta, eps):
  """The loss with one layer of one stacked weight moved by eps · delta (the model restored after)."""
  node = model
  *mods, attr = path.split("/")
  for m in mods:
    node = getattr(node, m)
  param = getattr(node, attr)
  w = param.get_value()
  param.set_value(w.at[layer].add(eps * delta))
  try:
    return float(cross_entropy(model(X), Y))
  finally:
    param.set_value(w)


@pytest.mark.parametrize("unit,bits", [(("blocks/wq_DQ", 1), 3), (("blocks/w_down_FD", 0), 4)])
def test_the_first_order_term_is_the_directional_derivative(tiny, unit, bits):
  model, sens = tiny
  path, layer = unit
  w = jnp.asarray(quant_mixed._weights(model, [path])[path].get_value()[layer])
  delta = quant_mixed._delta(w, bits, 0)
  # eps · delta changes a loss of ~5.5 by |eps · first order|: at eps = 1e-2 that is 2.5e-7–4e-6, 1–8 float32 ulps, so
  # the difference was rounding (0.0 for w_down under -O0). At eps = 0.3 the central difference is stable (it moves
  # < 3% from 0.1 to 1.0: the third-order term is negligible for a quantization-sized step).
  eps = 0.3
  fd = (_loss_with(model, path, layer, delta, eps) - _loss_with(model, path, layer, delta, -eps)) / (2 * eps)
  got = sens.first_order[sens.units.index(unit), sens.bits.index(bits)]
  assert got == pytest.approx(fd, rel=0.05, abs=1e-5)
  assert abs(got) > 1e-5  # not trivially zero


def test_hutchinson_traces_match_the_exact_hessian_of_a_very_small_model():
  """Each unit's trace estimate against the exact trace of its diagonal Hessian block (one Hessian-vector product
  per entry), within 4 standard errors of the estimate (the test's own statistics, not a tolerance tuned to pass)."""
  config = preset("tiny", vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8, qk_norm=False,
                  init_std=0.3)  # logits sensitive enough that the Gauss–Newton part gives traces well above the noise
  model = Transformer(config, rngs=nnx.Rngs(1))
  x, y = TOKENS[:2, :8] % 16, TOKENS[:2, 1:9] % 16
  sens = quant_mixed.sensitivity(model, x, y, bits=(4,))
  quant_mixed.add_hessian(sens, model, x, y, samples=4096, seed=3)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  hvp = jax.jit(jax.vmap(lambda v: jax.jvp(jax.grad(lambda p: cross_entropy(nnx.merge(graphdef, p, rest)(x), y)),
                                            (params,), (v,))[1]))
  flat = lambda tree: {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(tree)}
  zeros = jax.tree.map(jnp.zeros_like, params)
  for i, (path, layer) in enumerate(sens.units):
    shape = flat(params)[path].get_value().shape
    n = int(np.prod(shape[1:]))
    basis = jnp.eye(n).reshape(n, *shape[1:])

    def one_hot(kp, z, basis=basis, path=path, layer=layer):
      name = "/".join(str(k.key) for k in kp if hasattr(k, "key"))
      stacked = jnp.broadcast_to(z, (basis.shape[0], *z.shape))
      return stacked.at[:, layer].set(basis) if name == path else stacked
    hv = flat(hvp(jax.tree_util.tree_map_with_path(one_hot, zeros)))[path].get_value()  # (n, L, ...)
    exact = float(jnp.sum(hv[:, layer].reshape(n, n).diagonal()))
    assert abs(sens.traces[i] - exact) <= 4 * sens.trace_se[i] + 1e-6, (path, layer, sens.traces[i], exact)
  assert np.all(np.isfinite(sens.hessian)) and np.any(np.abs(sens.traces) > 10 * sens.trace_se)  # not all noise


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), n=st.integers(1, 5), slack=st.floats(0.0, 1.0))
def test_the_exact_search_is_the_brute_force_optimum_and_greedy_is_feasible(seed, n, slack):
  rng = np.random.default_rng(seed)
  k = 4
  sizes = np.sort(rng.integers(1, 6, (n, k)) * 8, 1)
  cost = rng.normal(size=(n, k))
  lo, hi = sizes.min(1).sum(), sizes.max(1).sum()
  budget = int(lo + slack * (hi - lo))
  choice = quant_mixed.exact(cost, sizes, budget)
  rows = np.arange(n)
  assert sizes[rows, choice].sum() <= budget
  best = min(sum(cost[i, c[i]] for i in range(n)) for c in itertools.product(range(k), repeat=n)
             if sum(sizes[i, c[i]] for i in range(n)) <= budget)
  assert cost[rows, choice].sum() == pytest.approx(best)
  g = quant_mixed.greedy(cost, sizes, budget)
  assert sizes[rows, g].sum() <= budget and cost[rows, g].sum() >= best - 1e-9


def test_a_budget_below_the_smallest_layout_is_refused():
  with pytest.raises(quant.QuantError, match="below the smallest layout"):
    quant_mixed.exact(np.zeros((2, 2)), np.array([[8, 16], [8, 16]]), 15)


def test_a_layout_quantizes_to_its_plan_and_its_size_is_what_the_store_writes(tiny, tmp_path):
  model, sens = tiny
  uniform4 = int(sens.bytes[:, sens.bits.index(4)].sum())
  choice = quant_mixed.exact(sens.first_order, sens.bytes, uniform4)
  assert quant_mixed.layout_bytes(sens, choice) <= uniform4
  plan = quant_mixed.plan_of(sens, choice)
  fresh = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  quant.quantize(fresh, plan, X)
  for (path, layer), k in zip(sens.units, choice):
    assert plan[path][layer].bits == sens.bits[k]
  path = quant_store.save(fresh, str(tmp_path / "q"))
  from safetensors.numpy import load_file
  tensors = load_file(f"{path}/{quant_store.WEIGHTS}")
  written = sum(t.nbytes for name, t in tensors.items() if any(name.startswith(p + ".") for p in plan))
  zeros = sum(t.nbytes for name, t in tensors.items() if name.endswith(".zero"))
  assert written - zeros == quant_mixed.layout_bytes(sens, choice)
