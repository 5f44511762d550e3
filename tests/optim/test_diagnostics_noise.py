"""optim/diagnostics/noise.py: the two-batch-size estimates against known |G|² and tr(Σ), exact identities with the
definition (noise_scale_from_samples), on synthetic gradients and on a tiny model's per-example gradients, and the
moving averages against a NumPy loop. (Sharded == single device: tests/optim/test_diagnostics_sharpness.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim.diagnostics import noise


def split(g: np.ndarray) -> dict:
  """A (..., 6) array as a two-leaf tree {"a": (..., 2), "b": (..., 2, 2)}: the sums must run over leaves."""
  return {"a": g[..., :2], "b": g[..., 2:].reshape(*g.shape[:-1], 2, 2)}


def test_unbiased_estimates_recover_known_mean_and_covariance():
  """Per-example gradients g ~ N(G, Σ), d = 6, in M = 20000 independent batches of n = 32 examples split into R = 8
  groups of b = 4. For Gaussian gradients (group means independent of their covariance, Wishart traces):

    Var(S)    = 2·tr(Σ²)/(R − 1)
    Var(|G|²) = 2·tr(Σ²)·R/(n²·(R − 1)) + 4·GᵀΣG/n

  so the mean over the M batches must lie within 4 standard errors, sqrt(Var/M), of the truth; and the squared norm
  of the batch mean alone, biased by tr(Σ)/n, must not (the test can see the bias the estimate removes)."""
  rng = np.random.default_rng(0)
  d, m, r, b = 6, 20000, 8, 4
  n = r * b
  g_true = rng.normal(size=d)
  a = rng.normal(size=(d, d)) * 0.7
  sigma = a @ a.T
  per_example = g_true + rng.normal(size=(m, r, b, d)) @ a.T
  with jax.enable_x64(True):
    small, big = jax.jit(jax.vmap(noise.group_sq_norms))(split(per_example.mean(axis=2)))
    g2, s = noise.unbiased_estimates(small, big, b, n)
    g2, s, big = np.asarray(g2), np.asarray(s), np.asarray(big)
  var_s = 2 * np.trace(sigma @ sigma) / (r - 1)
  var_g2 = 2 * np.trace(sigma @ sigma) * r / (n * n * (r - 1)) + 4 * g_true @ sigma @ g_true / n
  assert abs(s.mean() - np.trace(sigma)) < 4 * np.sqrt(var_s / m)
  assert abs(g2.mean() - g_true @ g_true) < 4 * np.sqrt(var_g2 / m)
  assert abs(big.mean() - g_true @ g_true) > 4 * np.sqrt(var_g2 / m)
  # the variances the tolerances rest on (std within 5%: its own standard error here is under 1%)
  np.testing.assert_allclose([s.std(), g2.std()], np.sqrt([var_s, var_g2]), rtol=0.05)


def test_groups_of_one_give_the_definition_exactly():
  """n per-example gradients as n groups of one (b_small = 1, b_big = n): with small_sq = (1/n)Σ‖g_i‖² and
  big_sq = ‖ḡ‖², Σ‖g_i − ḡ‖² = n·(small_sq − big_sq), so

    S    = (small_sq − big_sq)/(1 − 1/n) = Σ‖g_i − ḡ‖²/(n − 1) = tr(Σ̂)       (the unbiased trace)
    |G|² = (n·big_sq − small_sq)/(n − 1) = ‖ḡ‖² − tr(Σ̂)/n,   1/B_simple = 1/B_noise − 1/n

  and groups of b (R = n/b group means, tr(Σ̂_R) their unbiased trace): S = b·tr(Σ̂_R), |G|² = ‖ḡ‖² − tr(Σ̂_R)/R."""
  rng = np.random.default_rng(1)
  n, b = 12, 3
  g = rng.normal(size=(n, 6)) + 0.8
  definition = noise.noise_scale_from_samples(split(g))
  groups = noise.noise_scale_from_samples(split(g.reshape(n // b, b, 6).mean(axis=1)))
  with jax.enable_x64(True):
    g2, s = noise.unbiased_estimates(*noise.group_sq_norms(split(g)), 1, n)
    g2_b, s_b = noise.unbiased_estimates(*noise.group_sq_norms(split(g.reshape(n // b, b, 6).mean(axis=1))), b, n)
    simple = np.asarray(noise.b_simple(g2, s))
  mean = g.mean(axis=0)
  np.testing.assert_allclose(definition["trace"], np.sum((g - mean) ** 2) / (n - 1), rtol=1e-14)
  np.testing.assert_allclose(definition["g2"], mean @ mean, rtol=1e-14)
  np.testing.assert_allclose(s, definition["trace"], rtol=1e-12)
  np.testing.assert_allclose(g2, definition["g2"] - definition["trace"] / n, rtol=1e-12)
  np.testing.assert_allclose(1 / simple, 1 / definition["noise_scale"] - 1 / n, rtol=1e-12)
  np.testing.assert_allclose(s_b, b * groups["trace"], rtol=1e-12)
  np.testing.assert_allclose(g2_b, groups["g2"] - groups["trace"] / (n // b), rtol=1e-12)


def test_tiny_model_groups_against_the_definition():
  """A 3-6-3 tanh MLP's per-example gradients on 24 examples (vmap of grad) and its gradients on 6 groups of 4 (vmap
  of grad of the group's mean loss): B_simple from the groups against noise_scale_from_samples, by the identities of
  the test above, to 1e-12."""
  rng = np.random.default_rng(2)
  params = {"w1": rng.normal(size=(3, 6)), "b1": rng.normal(size=6) * 0.1, "w2": rng.normal(size=(6, 3)) / 2,
            "b2": np.zeros(3)}
  n, b = 24, 4
  x, y = rng.normal(size=(n, 3)) + 1, rng.integers(0, 3, n)

  def loss(p, x, y):
    logp = jax.nn.log_softmax(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
    return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 3, dtype=logp.dtype) * logp, axis=-1))

  @jax.jit
  def gradients(params, x, y):
    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    per_group = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x.reshape(n // b, b, 3), y.reshape(n // b, b))
    return per_example, per_group, noise.group_sq_norms(per_example), noise.group_sq_norms(per_group)

  with jax.enable_x64(True):
    per_example, per_group, norms_1, norms_b = gradients(params, x, y)
    simple_1 = np.asarray(noise.b_simple(*noise.unbiased_estimates(*norms_1, 1, n)))
    simple_b = np.asarray(noise.b_simple(*noise.unbiased_estimates(*norms_b, b, n)))
  definition = noise.noise_scale_from_samples(per_example)
  groups = noise.noise_scale_from_samples(per_group)
  assert 0 < definition["noise_scale"] < np.inf and definition["samples"] == n
  np.testing.assert_allclose(1 / simple_1, 1 / definition["noise_scale"] - 1 / n, rtol=1e-12)
  # a group's gradient is the mean of its examples' gradients
  jax.tree.map(lambda e, g: np.testing.assert_allclose(np.asarray(e).reshape(g.shape[0], b, *g.shape[1:]).mean(1), g,
                                                       rtol=1e-12, atol=1e-15), per_example, per_group)
  np.testing.assert_allclose(1 / simple_b, (1 / groups["noise_scale"] - 1 / (n // b)) / b, rtol=1e-12)


def test_b_simple_conventions_and_checks():
  got = np.asarray(noise.b_simple(jnp.array([2.0, 0.0, -1.0, 0.0, 4.0]), jnp.array([3.0, 1.0, 5.0, 0.0, -2.0])))
  np.testing.assert_array_equal(got, [1.5, np.inf, np.inf, np.inf, -0.5])
  with pytest.raises(ValueError, match="b_small < b_big"):
    noise.unbiased_estimates(1.0, 1.0, 8, 8)
  with pytest.raises(ValueError, match="n >= 2"):
    noise.noise_scale_from_samples({"a": np.ones((1, 3))})
  with pytest.raises(ValueError, match="n >= 2"):
    noise.noise_scale_from_samples({"a": np.ones((4, 3)), "b": np.ones((5,))})


def test_ema_against_numpy_loop():
  """Five steps of noisy estimates (one with |G|² < 0) against the equations in float64 NumPy; constant estimates come
  back exactly from the bias-corrected averages (Adam's property) from the first step on."""
  g2s = np.array([1.0, -0.5, 2.0, 0.25, 1.5])
  ss = np.array([4.0, 6.0, 3.0, 5.0, 2.0])
  decay = 0.9
  with jax.enable_x64(True):
    update = jax.jit(noise.ema_update)
    state, state_const = noise.ema_init(jnp.float64), noise.ema_init(jnp.float64)
    got = []
    for g2, s in zip(g2s, ss):
      state, b = update(state, g2, s, decay)
      state_const, b_const = update(state_const, 0.5, 3.0, decay)
      np.testing.assert_allclose(noise.ema_debiased(state_const, decay), (0.5, 3.0), rtol=1e-14)
      np.testing.assert_allclose(b_const, 6.0, rtol=1e-14)
      got.append(b)
    assert state.g2.dtype == jnp.float64 and state.step == 5
  m_g2 = m_s = 0.0
  want = []
  for t, (g2, s) in enumerate(zip(g2s, ss), start=1):
    m_g2, m_s = decay * m_g2 + (1 - decay) * g2, decay * m_s + (1 - decay) * s
    corr = 1 - decay ** t
    want.append((m_s / corr) / (m_g2 / corr) if m_g2 > 0 else np.inf)
  np.testing.assert_allclose(got, want, rtol=1e-13)


def test_ema_with_traced_decay_and_non_positive_average():
  state, b = jax.jit(noise.ema_update)(noise.ema_init(), jnp.float32(-1.0), jnp.float32(2.0), jnp.float32(0.5))
  assert state.g2.dtype == jnp.float32 and b == np.inf and int(state.step) == 1
