"""The dataset characters that, by Cheng et al. ("The Scalability for Parallel Machine Learning Training Algorithm:
Dataset Matters", arXiv 1910.11510), bound how far parallel training scales, measured on a sample of a dataset.

A dataset here is n samples with d features each, X (n, d), in the order a sampler draws them (for a token corpus:
each window's bag of tokens, `token_features`; for a table: its rows). With x̄ the mean sample:

  variance    (1/d) Σ_j Var_i(X_ij): the features' variance across samples, averaged over features
  sparsity    the share of zero entries of X (mean over samples of the share of features a sample lacks)
  diversity   Σ_i ‖x_i‖² / ‖Σ_i x_i‖², Yin et al.'s gradient diversity (AISTATS 2018) with samples in place of
              gradients: 1/n when all samples are equal, 1 when they are orthogonal; n · diversity is the batch
              size up to which averaging samples still adds information
  similarity  mean cosine similarity of consecutive samples, x_t and x_{t+1}, in the sampling order

and, through a model, the gradient versions that the convergence analyses use (`gradient_stats`): the gradient
diversity of per-sample gradients and the simple noise scale B_noise = tr(Σ) / ‖G‖² (McCandlish et al. 2018), with
G the mean gradient and Σ the per-sample gradients' covariance: mini-batch SGD's useful batch is about B_noise.
"""

from __future__ import annotations

import jax
import numpy as np

from optim.diagnostics.noise import noise_scale_from_samples


def token_features(windows: np.ndarray, vocab_size: int) -> np.ndarray:
  """(n, T) token windows -> (n, V) float64 bags of tokens: each row the frequencies of the token ids in its window
  (summing to 1)."""
  windows = np.asarray(windows)
  n, t = windows.shape
  counts = np.zeros((n, vocab_size))
  np.add.at(counts, (np.repeat(np.arange(n), t), windows.ravel()), 1.0)
  return counts / t


def characters(x: np.ndarray) -> dict[str, float]:
  """The four characters of samples x (n, d) taken in order (module docstring), in float64."""
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or len(x) < 2:
    raise ValueError(f"characters need samples (n, d) with n >= 2, got shape {x.shape}")
  norms = np.linalg.norm(x, axis=1)
  total = np.sum(x, axis=0)
  pairs = np.sum(x[:-1] * x[1:], axis=1)
  cos = np.divide(pairs, norms[:-1] * norms[1:], out=np.zeros_like(pairs), where=(norms[:-1] * norms[1:]) > 0)
  return {"variance": float(np.mean(np.var(x, axis=0))),
          "sparsity": float(np.mean(x == 0)),
          "diversity": float(np.sum(norms ** 2) / max(float(total @ total), np.finfo(np.float64).tiny)),
          "similarity": float(np.mean(cos)),
          "samples": int(len(x))}


def gradient_stats(loss_fn, params, xs, ys) -> dict[str, float]:
  """Gradient diversity and the simple noise scale of per-sample gradients at `params` (module docstring).

  loss_fn(params, x, y) is one sample's loss; xs, ys stack n samples. Per-sample gradients by vmap; statistics
  in float64 on the host. B_noise = tr(Σ)/‖G‖² with Σ's unbiased estimate (n - 1 in the denominator), by
  `optim.diagnostics.noise.noise_scale_from_samples`."""
  grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
  g = np.concatenate([np.asarray(leaf, np.float64).reshape(len(xs), -1) for leaf in jax.tree.leaves(grads)], axis=1)
  noise = noise_scale_from_samples(g)  # the one definition of B_noise (optim/diagnostics/noise.py)
  total = g.sum(axis=0)
  return {"gradient_diversity": float(np.sum(g * g) / max(float(total @ total), np.finfo(np.float64).tiny)),
          "noise_scale": noise["noise_scale"], "grad_norm": float(np.sqrt(noise["g2"])), "samples": noise["samples"]}


__all__ = ["characters", "gradient_stats", "token_features"]
