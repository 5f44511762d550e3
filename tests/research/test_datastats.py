"""research/data/datastats.py against direct NumPy loops over small arrays, and the characters' limiting cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.data import datastats

RNG = np.random.default_rng(0)


def test_token_features_count_each_window():
  windows = np.array([[0, 1, 1, 3], [2, 2, 2, 2]])
  np.testing.assert_array_equal(datastats.token_features(windows, 5),
                                [[0.25, 0.5, 0, 0.25, 0], [0, 0, 1, 0, 0]])


def test_characters_equal_loops_over_samples():
  x = RNG.normal(size=(7, 5)) * (RNG.random((7, 5)) < 0.6)
  n, d = x.shape
  var = sum(sum((x[i, j] - sum(x[:, j]) / n) ** 2 for i in range(n)) / n for j in range(d)) / d
  zeros = sum(1 for i in range(n) for j in range(d) if x[i, j] == 0) / (n * d)
  total = [sum(x[i, j] for i in range(n)) for j in range(d)]
  div = sum(sum(v * v for v in x[i]) for i in range(n)) / sum(t * t for t in total)
  cos = [float(x[t] @ x[t + 1] / np.sqrt((x[t] @ x[t]) * (x[t + 1] @ x[t + 1]))) for t in range(n - 1)]
  got = datastats.characters(x)
  np.testing.assert_allclose([got["variance"], got["sparsity"], got["diversity"], got["similarity"]],
                             [var, zeros, div, sum(cos) / len(cos)], rtol=1e-12)


def test_limiting_cases():
  same = np.tile(RNG.normal(size=4), (10, 1))
  c = datastats.characters(same)
  assert c["variance"] == pytest.approx(0, abs=1e-15) and c["similarity"] == pytest.approx(1)
  assert c["diversity"] == pytest.approx(1 / 10)
  c = datastats.characters(np.eye(6))
  assert c["diversity"] == pytest.approx(1) and c["similarity"] == 0 and c["sparsity"] == pytest.approx(5 / 6)
  with pytest.raises(ValueError, match="n >= 2"):
    datastats.characters(np.ones((1, 3)))


def test_gradient_stats_equal_numpy_on_least_squares():
  """f_i(w) = (a_i·w - b_i)²/2, per-sample gradient (a_i·w - b_i) a_i, in float64 NumPy."""
  a, b, w = RNG.normal(size=(9, 4)), RNG.normal(size=9), RNG.normal(size=4)
  g = (a @ w - b)[:, None] * a
  mean = g.mean(0)
  expect_noise = np.sum((g - mean) ** 2) / 8 / (mean @ mean)
  expect_div = np.sum(g * g) / (g.sum(0) @ g.sum(0))
  with jax.enable_x64(True):
    got = datastats.gradient_stats(lambda w, x, y: 0.5 * (x @ w - y) ** 2, jnp.asarray(w), jnp.asarray(a),
                                   jnp.asarray(b))
  np.testing.assert_allclose([got["noise_scale"], got["gradient_diversity"]], [expect_noise, expect_div], rtol=1e-10)
