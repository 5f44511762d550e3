"""Spectra of matrix stacks (optim.diagnostics.spectra) against numpy.linalg.svd in float64, the randomized range
finder on a known fast-decaying spectrum, and the same numbers from matrices sharded over 8 devices as from one."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from optim.diagnostics.spectra import (
  effective_rank,
  matrix_spectra,
  orthogonality_error,
  quantiles,
  singular_values,
  spectral_norm,
)

QS = (0.0, 0.1, 0.5, 0.9, 1.0)


def with_spectrum(rng: np.random.Generator, m: int, n: int, s: np.ndarray) -> np.ndarray:
  """U diag(s) Vᵀ with Haar-random orthonormal U (m×k), V (n×k)."""
  u = np.linalg.qr(rng.standard_normal((m, len(s))))[0]
  v = np.linalg.qr(rng.standard_normal((n, len(s))))[0]
  return (u * s) @ v.T


def np_svals(w: np.ndarray) -> np.ndarray:
  return np.linalg.svd(w, compute_uv=False)  # batched over leading axes, descending


def np_effective_rank(s: np.ndarray) -> np.ndarray:
  p = s / s.sum(-1, keepdims=True)
  return np.exp(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1))


def np_orthogonality_error(w: np.ndarray) -> float:
  """‖Ŵ Ŵᵀ − I‖_F / √k (or ŴᵀŴ, the smaller), Ŵ = W √k / ‖W‖_F: the definition, for one matrix."""
  k = min(w.shape)
  w_hat = w * np.sqrt(k) / np.linalg.norm(w)
  g = w_hat @ w_hat.T if w.shape[0] <= w.shape[1] else w_hat.T @ w_hat
  return np.linalg.norm(g - np.eye(k)) / np.sqrt(k)


def spectra64(gapped, tall, wide, ortho_tall, ortho_wide, decaying):
  exact = singular_values(tall), singular_values(wide), singular_values(gapped)
  orth = jax.vmap(orthogonality_error)(jnp.stack([ortho_tall, 1e-3 * ortho_tall])), orthogonality_error(ortho_wide.T)
  random_orth = orthogonality_error(tall), orthogonality_error(wide), orthogonality_error(-7.0 * wide)
  return {"spectral_norm": spectral_norm(gapped), "exact": exact, "quantiles": quantiles(exact[0], QS),
          "effective_rank": effective_rank(jnp.stack([exact[0], jnp.zeros_like(exact[0]),
                                                      jnp.zeros_like(exact[0]).at[:, 3].set(2.0)])),
          "orth": orth, "random_orth": random_orth,
          "randomized": singular_values(decaying, exact_max=16, rank=8, oversample=6, power_iters=2),
          "zero": (spectral_norm(jnp.zeros((5, 3))), orthogonality_error(jnp.zeros((5, 3))))}


def test_spectra_match_numpy_in_float64():
  rng = np.random.default_rng(0)
  s_gapped = np.stack([2.0 * 0.7 ** np.arange(10), 0.3 * 0.6 ** np.arange(10), 5.0 * 0.6 ** np.arange(10)])
  gapped = np.stack([with_spectrum(rng, 24, 10, s) for s in s_gapped])  # (3, 24, 10): a stack, σ₂/σ₁ <= 0.7
  tall, wide = rng.standard_normal((3, 20, 12)), rng.standard_normal((9, 14))
  ortho_tall = np.linalg.qr(rng.standard_normal((20, 6)))[0] * 3.7  # a scaled semi-orthogonal 20 × 6 ...
  ortho_wide = np.linalg.qr(rng.standard_normal((11, 5)))[0] * 0.02  # ... and (transposed) 5 × 11
  s_decaying = 0.5 ** np.arange(40)
  decaying = with_spectrum(rng, 64, 48, s_decaying)  # min(m, n) = 48 > exact_max = 16: randomized
  with jax.enable_x64(True):
    out = jax.jit(spectra64)(gapped, tall, wide, ortho_tall, ortho_wide, decaying)
  # power iteration: relative error in σ₁ ≈ ½ (c₂/c₁)² (σ₂/σ₁)^(4·iters), c the start vector in the right singular
  # basis; c₂/c₁ is 1.4, 1.6 and 92 for these three, so the error is below 1e-12 (0.75 in place of 0.6 gives 2e-7)
  assert out["spectral_norm"].shape == (3,) and out["spectral_norm"].dtype == jnp.float64
  np.testing.assert_allclose(out["spectral_norm"], s_gapped[:, 0], rtol=1e-10)
  for got, w in zip(out["exact"], (tall, wide, gapped)):
    want = np_svals(w)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * want.max())
  np.testing.assert_allclose(out["quantiles"], np.moveaxis(np.quantile(np_svals(tall), QS, axis=-1), 0, -1),
                             rtol=1e-10)
  assert out["quantiles"].shape == (3, len(QS))
  rank = out["effective_rank"]
  np.testing.assert_allclose(rank[0], np_effective_rank(np_svals(tall)), rtol=1e-10)
  np.testing.assert_array_equal(rank[1:], [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # zero matrix: 0; rank one: 1
  np.testing.assert_allclose(out["orth"][0], 0.0, atol=1e-10)
  np.testing.assert_allclose(out["orth"][1], 0.0, atol=1e-10)
  want = [np_orthogonality_error(w) for w in tall] + [np_orthogonality_error(wide)]
  got = np.concatenate([out["random_orth"][0], out["random_orth"][1][None]])
  np.testing.assert_allclose(got, want, rtol=1e-10)
  assert np.min(want) > 0.3  # far from zero: the scale-free claims below are not about ~0
  np.testing.assert_allclose(out["random_orth"][2], out["random_orth"][1], rtol=1e-12)  # scale-invariant
  s2 = np_svals(wide) ** 2  # the docstring's equivalent form: std(σ²) / mean(σ²)
  np.testing.assert_allclose(out["random_orth"][1], np.std(s2) / np.mean(s2), rtol=1e-10)
  # the randomized range finder (8 of 48, 6 extra columns, q = 2 subspace iterations) on σᵢ = 2^-i: the power scheme
  # raises the spectrum to the power 2q + 1 (HMT 2011 §4.5), so the 8th value's relative error is ~(σ₁₅/σ₈)^(2(2q+1))
  # = 2^-70, rounding level; without the subspace iterations (q = 0) it is 2^-14 (measured 1e-5 .. 1e-4)
  assert out["randomized"].shape == (8,)
  np.testing.assert_allclose(out["randomized"], s_decaying[:8], rtol=1e-12)
  np.testing.assert_array_equal([out["zero"][0], out["zero"][1]], [0.0, 1.0])


def test_matrix_spectra_select_and_skip():
  tree = {"w": jnp.ones((2, 3, 4)), "b": jnp.ones(4), "none": None, "embed": jnp.ones((5, 3))}
  out = jax.eval_shape(lambda t: matrix_spectra(t, quantile_levels=(0.5, 1.0)), tree)
  assert set(out) == {"w", "embed"}
  assert {k: v.shape for k, v in out["w"].items()} == {"spectral_norm": (2,), "orthogonality_error": (2,),
                                                       "effective_rank": (2,), "sv_quantiles": (2, 2)}
  assert set(jax.eval_shape(lambda t: matrix_spectra(t, select=lambda name: name == "embed"), tree)) == {"embed"}


def spectra32(tree):
  randomized = matrix_spectra(tree, exact_max=6, rank=2, iters=30, select=lambda name: name.startswith("blocks/"))
  return randomized, matrix_spectra(tree)


def test_sharded_equals_one_device():
  """Exact and randomized, per layer and expert, on one device and sharded over a (2, 2, 2) Explicit mesh."""
  rng = np.random.default_rng(1)
  tree = {"blocks": {"w_up_DF": with_spectrum(rng, 8, 12, 0.6 ** np.arange(8))[None] * np.array([1.0, 3.0])[:, None,
                                                                                                              None],
                     "w_moe_EDF": rng.standard_normal((2, 4, 8, 12)) * 0.9 ** np.arange(12)},
          "embed_VD": rng.standard_normal((16, 8)), "norm_D": rng.standard_normal(8)}
  tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
  specs = {"blocks": {"w_up_DF": P(None, "fsdp", "tensor"), "w_moe_EDF": P(None, "data", "fsdp", "tensor")},
           "embed_VD": P("tensor", "fsdp"), "norm_D": P("fsdp")}
  step = jax.jit(spectra32)
  one = step(tree)
  mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2", explicit=True)
  with jax.set_mesh(mesh):
    many = step(jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, specs))
  randomized, exact = one
  assert set(exact) == {"blocks/w_up_DF", "blocks/w_moe_EDF", "embed_VD"}
  assert set(randomized) == {"blocks/w_up_DF", "blocks/w_moe_EDF"}
  assert exact["blocks/w_moe_EDF"]["sv_quantiles"].shape == (2, 4, 5)
  assert randomized["blocks/w_moe_EDF"]["sv_quantiles"].dtype == jnp.float32
  w = np.asarray(tree["blocks"]["w_moe_EDF"], np.float64)
  np.testing.assert_allclose(exact["blocks/w_moe_EDF"]["spectral_norm"], np_svals(w)[..., 0], rtol=1e-5)
  np.testing.assert_allclose(randomized["blocks/w_up_DF"]["spectral_norm"], [1.0, 3.0], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=0), one, many)
