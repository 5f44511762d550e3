"""Float64 NumPy references for tests/models/test_quant.py, written from the papers' equations (no JAX, no qwix).

The rounding grid is qwix's, stated here so GPTQ/AWQ/SmoothQuant are compared on the same grid (that the grid is
qwix's is tested against qwix itself): b-bit symmetric codes in [−2^(b−1), 2^(b−1) − 1] with scale
absmax / (2^(b−1) − 0.5); asymmetric ones in the same range with scale (max − min) / (2^b − 1) (min ≤ 0 ≤ max) and an
integer zero point round(−2^(b−1) − min / scale); rounding half to even, as numpy and JAX do. The grid functions
compute in their input's precision: a symmetric grid puts each channel's largest weight on a rounding tie
(±(2^(b−1) − 0.5) steps), which float32 and float64 resolve apart, so a test that must agree code for code feeds them
float32. W is (O, I) here, the papers' layout (rows the outputs, columns the inputs); X is (tokens, I).
"""

import numpy as np


def grid(w_OG, bits: int, symmetric: bool):
  """(scale (O, 1), zero (O, 1) or None) of a group of columns w_OG."""
  qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
  tiny = np.sqrt(np.finfo(np.float32).tiny)
  if symmetric:
    scale = np.max(np.abs(w_OG), 1, keepdims=True) / (2 ** (bits - 1) - 0.5)
    return np.where(scale < tiny, 1.0, scale), None
  lo, hi = np.minimum(w_OG.min(1, keepdims=True), 0), np.maximum(w_OG.max(1, keepdims=True), 0)
  scale = (hi - lo) / (qmax - qmin)
  scale = np.where(scale < tiny, 1.0, scale)
  return scale, np.round(qmin - lo / scale)


def codes(w, scale, zero, bits: int):
  q = w / scale + (0 if zero is None else zero)
  return np.clip(np.round(q), -2 ** (bits - 1), 2 ** (bits - 1) - 1)


def dequant(q, scale, zero):
  return (q - (0 if zero is None else zero)) * scale


def rtn(W_OI, bits: int, group: int = 0, symmetric: bool = True, unrounded: bool = False):
  """Round to nearest, one scale per output row and group of `group` columns: (codes, dequantized W), and with
  `unrounded` the values w / scale + zero before rounding."""
  O, I = W_OI.shape
  g = group or I
  Q, D, R = np.zeros_like(W_OI), np.zeros_like(W_OI), np.zeros_like(W_OI)
  for c in range(0, I, g):
    s, z = grid(W_OI[:, c:c + g], bits, symmetric)
    Q[:, c:c + g] = codes(W_OI[:, c:c + g], s, z, bits)
    D[:, c:c + g] = dequant(Q[:, c:c + g], s, z)
    R[:, c:c + g] = W_OI[:, c:c + g] / s + (0 if z is None else z)
  return (Q, D, R) if unrounded else (Q, D)


def gptq(W_OI, X_NI, bits: int, group: int = 0, symmetric: bool = True, percdamp: float = 0.01):
  """GPTQ (Frantar et al. 2023, Algorithm 1 without lazy batching, which changes no result when every group starts
  a batch): H = 2XᵀX + λI (λ = percdamp · mean diag(2XᵀX)), U the upper Cholesky factor of H⁻¹; for each column j
  in order: quantize it (a group's scale from the columns as they stand when the group starts), e = (w_j − q_j) / U_jj,
  W[:, j:] −= e U[j, j:]. Returns (codes, dequantized W)."""
  W = np.array(W_OI, np.float64)
  X = np.asarray(X_NI, np.float64)
  O, I = W.shape
  g = group or I
  H = 2 * X.T @ X
  diag = np.diag(H).copy()
  dead = diag == 0
  H[dead, dead] = 1.0
  W[:, dead] = 0.0
  H += percdamp * np.mean(diag) * np.eye(I)
  U = np.linalg.cholesky(np.linalg.inv(H)).T  # H⁻¹ = UᵀU
  Q, D = np.zeros_like(W), np.zeros_like(W)
  for j in range(I):
    if j % g == 0:
      s, z = grid(W[:, j:j + g], bits, symmetric)
    w = W[:, j]
    Q[:, j] = codes(w[:, None], s, z, bits)[:, 0]
    D[:, j] = dequant(Q[:, j][:, None], s, z)[:, 0]
    e = (w - D[:, j]) / U[j, j]
    W[:, j:] -= np.outer(e, U[j, j:])
  return Q, D


def awq(W_OI, X_NI, bits: int, group: int = 0, symmetric: bool = False, n_grid: int = 20):
  """AWQ's scale search (Lin et al. 2024, §3.2): s = s_X^α with s_X = mean|x| per input channel, normalised by
  √(max s · min s) (the authors' code), α ∈ {0, 1/n, ..., (n−1)/n}; the α minimising the output error
  ‖X Wᵀ − (X diag(s)⁻¹)(Q(W diag(s)))ᵀ‖² on the calibration set. Returns (s, the errors of every α)."""
  W, X = np.asarray(W_OI, np.float64), np.asarray(X_NI, np.float64)
  sx = np.maximum(np.mean(np.abs(X), 0), 1e-8)
  Y = X @ W.T
  best, errors = None, []
  for alpha in np.arange(n_grid) / n_grid:
    s = np.maximum(sx ** alpha, 1e-4)
    s = s / np.sqrt(s.max() * s.min())
    _, D = rtn(W * s[None, :], bits, group, symmetric)
    err = np.sum((Y - (X / s[None, :]) @ D.T) ** 2)
    errors.append(err)
    if best is None or err < best[0]:
      best = (err, s)
  return best[1], np.array(errors)


def smoothquant(W_OI, X_NI, alpha: float = 0.5):
  """SmoothQuant's migration (Xiao et al. 2023, eq. 4): s_j = max|X_j|^α / max|W_j|^(1−α) per input channel j;
  X̂ = X diag(s)⁻¹ and Ŵ = W diag(s) compute the same product."""
  W, X = np.asarray(W_OI, np.float64), np.asarray(X_NI, np.float64)
  return np.maximum(np.max(np.abs(X), 0) ** alpha / np.max(np.abs(W), 0) ** (1 - alpha), 1e-5)


def per_token_int8(X_NI):
  """Dynamic per-token symmetric int8 quantize-dequantize of activations (SmoothQuant's per-token setting), in the
  input's precision."""
  X = np.asarray(X_NI)
  s, _ = grid(X, 8, True)
  return dequant(codes(X, s, None, 8), s, None)


def linear_cka(X_ND, Y_NE):
  """Linear CKA in its kernel form (Kornblith et al. 2019, eq. 1–3): HSIC(K, L) = tr(K H L H) / (n − 1)², K = XXᵀ,
  L = YYᵀ, H = I − 11ᵀ/n; CKA = HSIC(K, L) / √(HSIC(K, K) · HSIC(L, L))."""
  X, Y = np.asarray(X_ND, np.float64), np.asarray(Y_NE, np.float64)
  n = X.shape[0]
  H = np.eye(n) - np.ones((n, n)) / n
  hsic = lambda K, L: np.trace(K @ H @ L @ H) / (n - 1) ** 2
  K, L = X @ X.T, Y @ Y.T
  return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))
