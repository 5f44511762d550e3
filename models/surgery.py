"""Model surgery on a trained `Transformer`: dense → MoE upcycling, depth expansion, MoE ↔ PAD-Net.

Dense → MoE upcycling (`upcycle`), depth expansion by an inserted block (`insert_block`), and an MoE to PAD-Net form
and back (`to_padnet`, `to_moe`; models/padnet.py).

Shapes: L layers, D d_model, F the dense FFN width (d_ff), E experts, f = F/E neurons per expert, k top-k.
Both functions take a `Transformer` and return a new one (its config at `.c`); a train state's params become a
module with `nnx.merge(graphdef, params)` and go back with `nnx.split`.

Upcycling (LLaMA-MoE, Zhu et al., arXiv 2406.16554, §2; pjlab-sys4nlp/llama-moe `expert_split.py`,
`convert_llama_moe.py`). The dense SwiGLU is a sum over its F intermediate neurons j,
  FFN(x) = Σ_j silu(x·g_j)·(x·u_j)·d_j,   g_j, u_j columns of W_gate, W_up (D, F); d_j rows of W_down (F, D),
so a partition of the neurons into E disjoint sets S_e gives FFN(x) = Σ_e Expert_e(x) exactly, Expert_e the SwiGLU
on the columns/rows in S_e. The MoE layer (models/moe.py) computes y = Σ_{e∈TopK} g_e·Expert'_e(x); upcycle stores
Expert'_e = s·Expert_e (s folded into W_down, exact for s a power of two) and configures gates that sum to 1 over
the selected experts (softmax renormalised over the top-k = LLaMA-MoE's softmax over the k selected logits).
Choice of s:
  k = E, uniform gates g_e = 1/E:  y = (s/E)·Σ_e Expert_e(x) = (s/E)·FFN(x)   → s = E makes y = FFN(x) exactly;
  any k, routing independent of x with g_e = 1/k (a fresh router's near-uniform logits):
       E[y] = s·(1/k)·(k/E)·Σ_e Expert_e(x) = (s/E)·FFN(x)                     → s = E is unbiased as well.
The default is s = E. LLaMA-MoE multiplies by score_scale_factor = E/k on top of the same normalised scores
(`moe_calculators.py`), which by the line above gives (1/k)·FFN(x) in expectation and FFN(x)/E at k = E; pass
`scale=E/k` to reproduce it. research/results/upcycle_loss.md compares s ∈ {1, E/k, E} right after conversion.
Splits (a label in 0..E-1 per neuron, each label used f times):
  random:    a uniformly random balanced labelling per layer (LLaMA-MoE `RandomSplit`, their released models);
  clustered: balanced k-means on the L2-normalised neuron vectors u_j (columns of W_up; LLaMA-MoE's clustering
             split uses `KMeansConstrained(size_min=size_max=F/E)` on normalised up_proj rows), Lloyd iterations
             whose assignment step is the exact equal-size assignment (Hungarian algorithm on the F × F cost of
             neuron j to centroid slot c, each centroid repeated f times), k-means++ initialisation.
Attention, embeddings, norms and the head are copied; the router is freshly initialised (normal, init_std:
a zero router ties every logit and top-k would send all tokens to experts 0..k-1).

Depth expansion (the inserted "near-zero" block of Cheng et al., arXiv 2605.08297, shared/reference methods.md §3).
A pre-norm block is x ↦ x + Attn(N(x))·W_o ↦ x + FFN(N(x)) with FFN ending in W_down. Inserting a block with
W_o = 0 and W_down = 0 (every expert's and the shared expert's for an MoE block) and the other weights freshly
initialised makes it the identity, so logits are unchanged exactly. At insertion only the zeroed projections
get gradient: ∂L/∂W_o = Σ_tokens o_t^T·γ_t and ∂L/∂W_down = Σ_tokens a_t^T·γ_t, with o the attention output
before W_o, a the SwiGLU activation and γ = ∂L/∂x the residual-stream gradient at the insertion point (non-zero
whenever o, a ≠ 0); every other weight of the new block reaches the output only through a zero matrix, so its
gradient is exactly zero until the first step moves W_o, W_down (the first-order descent condition needs one
non-zero factor: both zero would be a saddle).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import padnet
from models.config import MoEConfig
from models.transformer import Transformer

SPLITS = ("random", "clustered")
# Output projections of a block, zeroed in an inserted one: attention out, dense FFN down, experts' down, shared down.
OUT_PROJECTIONS = ("wo_QD", "w_down_FD", "w_down_EFD", "shared_down_SD")


class SurgeryError(ValueError):
  """A model or argument that the surgery cannot handle."""


def balanced_kmeans(x_ND: Any, k: int, *, seed: int = 0, iters: int = 100) -> np.ndarray:
  """Labels (N,) in 0..k-1, each used exactly N/k times, from k-means with an equal-size assignment step.

  Lloyd's algorithm: centroids c from k-means++ (Arthur & Vassilvitskii 2007); then repeat until the labels stop
  changing (or `iters`): assign by min Σ_n ||x_n − c_{l(n)}||² subject to |{n: l(n) = j}| = N/k (solved exactly as a
  linear assignment of N points to N slots, centroid j owning N/k slots), then c_j = mean of its points.

  Args:
    x_ND: the N points (an array-like, computed in float64).
    k: the number of clusters; it must divide N.
    seed: the k-means++ initialisation's randomness.
    iters: the most Lloyd iterations (at least 1).

  Returns:
    The labels (N,) int64.

  Raises:
    SurgeryError: when N is not a multiple of k.

  References:
    Arthur, Vassilvitskii, "k-means++: The Advantages of Careful Seeding", 2007.
  """
  x = np.asarray(x_ND, np.float64)
  N = x.shape[0]
  if N % k:
    raise SurgeryError(f"{N} points do not split into {k} equal clusters")
  rng = np.random.default_rng(seed)
  picked = [x[rng.integers(N)]]
  for _ in range(1, k):
    d2 = np.min(((x[:, None] - np.asarray(picked)[None]) ** 2).sum(-1), 1)
    picked.append(x[rng.choice(N, p=d2 / d2.sum())] if d2.sum() > 0 else x[rng.integers(N)])
  c = np.asarray(picked)
  labels = None
  from scipy.optimize import linear_sum_assignment  # here: scipy.optimize adds ~0.3 s to every `import models`
  for _ in range(iters):
    cost_NK = ((x[:, None] - c[None]) ** 2).sum(-1)
    rows, slots = linear_sum_assignment(np.repeat(cost_NK, N // k, axis=1))
    new = np.empty(N, np.int64)
    new[rows] = slots // (N // k)
    if labels is not None and np.array_equal(new, labels):
      break
    labels = new
    c = np.stack([x[labels == j].mean(0) for j in range(k)])
  return cast(np.ndarray, labels)  # None only for iters < 1


def split_neurons(w_up_DF: Any, num_experts: int, split: str = "random", *, seed: int = 0) -> np.ndarray:
  """Expert label of each intermediate neuron of one layer, each label used F/E times (module docstring).

  Args:
    w_up_DF: the layer's W_up (D, F); its columns are the neuron vectors the clustered split groups.
    num_experts: E; it must divide F.
    split: "random" (default) or "clustered".
    seed: the split's randomness.

  Returns:
    The labels (F,) in 0..E-1.

  Raises:
    SurgeryError: when `split` is unknown or E does not divide F.
  """
  F = w_up_DF.shape[-1]
  if split not in SPLITS:
    raise SurgeryError(f"split must be one of {SPLITS}, got {split!r}")
  if num_experts < 1 or F % num_experts:
    raise SurgeryError(f"d_ff={F} does not split into num_experts={num_experts} equal experts; "
                       f"use a num_experts that divides {F}")
  if split == "random":
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_experts), F // num_experts))
  u_FD = np.asarray(w_up_DF, np.float64).T
  u_FD = u_FD / np.maximum(np.linalg.norm(u_FD, axis=1, keepdims=True), 1e-30)
  return balanced_kmeans(u_FD, num_experts, seed=seed)


def _variables(model: nnx.Module) -> dict[tuple, tuple]:
  """{path: (value, logical names)} of every variable of a module (Params and others, e.g. an MoE router bias)."""
  return {path: (var.get_value(), tuple(var.get_metadata().get("out_sharding") or ()))
          for path, var in nnx.to_flat_state(nnx.state(model))}


def _fresh(shape, names, dtype, std: float, rng: np.random.Generator) -> jax.Array:
  """A new weight as models/transformer.py initialises one, drawn on the host: no compile.

  A norm scale (logical axis "norm") is ones, any other weight N(0, std²) truncated to ±2 std
  (`nnx.initializers.truncated_normal`).
  """
  if any(n == "norm" for n in names):
    return jnp.ones(shape, dtype)
  z = rng.standard_normal(shape)
  while (bad := np.abs(z) > 2).any():
    z[bad] = rng.standard_normal(int(bad.sum()))
  return jnp.asarray(z * std, dtype)


def _build(c, values: dict[tuple, jax.Array]) -> Transformer:
  """A `Transformer(c)` holding `values` ({path: array} for every variable).

  It is built abstractly (`nnx.eval_shape`) so that no initializer runs.
  """
  model = nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))
  state = nnx.state(model)
  missing = [p for p, _ in nnx.to_flat_state(state) if p not in values]
  assert not missing, f"no value for {missing}"
  nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(values))
  nnx.update(model, state)
  return model


def _check_transformer(model, what: str):
  if not isinstance(model, Transformer):
    raise SurgeryError(f"{what} takes a models.Transformer, got {type(model).__name__}; "
                       f"turn params into one with nnx.merge(graphdef, params)")


def upcycle(dense: Transformer, num_experts: int, top_k: int, split: str = "random", *, seed: int = 0,
            scale: float | None = None, **moe: Any) -> Transformer:
  """A mixture-of-experts copy of a dense transformer, each FFN's neurons split into `num_experts` experts.

  Args:
    dense: a dense `Transformer` (its config's `moe` is None).
    num_experts: E; it must divide d_ff (each expert gets d_expert = d_ff / E neurons).
    top_k: experts per token.
    split: "random" or "clustered" (balanced k-means on normalised W_up columns), per layer.
    seed: the split's and the router's randomness.
    scale: s, multiplied into every expert's W_down; default E, which makes k = E with uniform gates equal the
      dense model exactly and is unbiased under uniform routing (module docstring). LLaMA-MoE's is E/k.
    **moe: other `MoEConfig` fields (router, capacity_factor, lb_weight, ...); default a softmax router
      renormalised over the top-k.

  Returns:
    The MoE `Transformer`; `.c` is the new config, `.c.moe` its `MoEConfig`.

  Raises:
    SurgeryError: when `dense` is not a dense `Transformer`, `moe` sets d_expert, shared experts or an unknown field,
      or E does not divide d_ff.

  References:
    Zhu et al., "LLaMA-MoE: Building Mixture-of-Experts from LLaMA with Continual Pre-training", 2024,
    arXiv 2406.16554, §2; pjlab-sys4nlp/llama-moe.
  """
  _check_transformer(dense, "upcycle")
  c = dense.c
  if c.moe is not None:
    raise SurgeryError("upcycle takes a dense model, but this one already has moe="
                       f"{c.moe.num_experts} experts")
  if "d_expert" in moe:
    raise SurgeryError("upcycle sets moe.d_expert itself (d_ff / num_experts); leave it out")
  if moe.get("num_shared", 0):
    raise SurgeryError("upcycle splits every neuron into routed experts; num_shared must be 0")
  E = num_experts
  if E < 1 or c.d_ff % E:
    raise SurgeryError(f"d_ff={c.d_ff} does not split into num_experts={E} equal experts; "
                       f"use a num_experts that divides {c.d_ff}")
  moe = {"router": "softmax", "normalize_top_k": True, **moe}
  try:
    new_c = dataclasses.replace(c, moe=MoEConfig(num_experts=E, top_k=top_k, d_expert=c.d_ff // E, **moe))
  except TypeError as e:
    raise SurgeryError(f"upcycle: {e}; see models.MoEConfig for the fields") from None
  s = float(E if scale is None else scale)

  old = {path: v for path, (v, _) in _variables(dense).items()}
  rng = np.random.default_rng(seed)  # one stream over layers: every layer gets its own split
  labels_LF = [split_neurons(np.asarray(old["blocks", "w_up_DF"][l]), E, split, seed=int(rng.integers(2 ** 31)))
               for l in range(c.n_layers)]
  idx_LEf = jnp.asarray(np.stack([np.stack([np.flatnonzero(lab == e) for e in range(E)]) for lab in labels_LF]))
  cols = jax.vmap(lambda w_DF, i_Ef: jnp.moveaxis(w_DF[:, i_Ef], 1, 0))  # (D, F) -> (E, D, f)
  rows = jax.vmap(lambda w_FD, i_Ef: w_FD[i_Ef])  # (F, D) -> (E, f, D)
  gate, up, down = (old.pop(("blocks", k)) for k in ("w_gate_DF", "w_up_DF", "w_down_FD"))
  down = rows(down, idx_LEf)
  new = {**old, ("blocks", "moe", "w_gate_EDF"): cols(gate, idx_LEf), ("blocks", "moe", "w_up_EDF"): cols(up, idx_LEf),
         ("blocks", "moe", "w_down_EFD"): down * jnp.asarray(s, down.dtype)}
  abstract = _variables(nnx.eval_shape(lambda: Transformer(new_c, rngs=nnx.Rngs(0))))
  for path, (a, names) in abstract.items():  # the router (fresh), its selection bias (zeros) if balancing
    if path not in new:
      new[path] = (jnp.zeros(a.shape, a.dtype) if path[-1] == "router_bias" else
                   _fresh(a.shape, names, a.dtype, c.init_std, rng))
  return _build(new_c, new)


def insert_block(model: Transformer, index: int, *, seed: int = 0) -> Transformer:
  """A copy of `model` with one more block, the identity at insertion (module docstring).

  The new block's output projections (attention W_o, FFN W_down; for MoE every expert's and the shared expert's) are
  zero, its other weights freshly initialised, an MoE router bias zero.

  Args:
    model: the transformer.
    index: the new block's position in the layer stack (0 = first, L = last).
    seed: the fresh weights' randomness.

  Returns:
    The `Transformer` with n_layers + 1 (config at `.c`); logits equal the old model's exactly.

  Raises:
    SurgeryError: when `model` is not a `Transformer` or `index` lies outside [0, L].

  References:
    Cheng et al., "A Qualitative Test-Risk Mechanism for Scaling Behavior in Normalized Residual Networks", 2026,
    arXiv 2605.08297.
  """
  _check_transformer(model, "insert_block")
  c = model.c
  if not 0 <= index <= c.n_layers:
    raise SurgeryError(f"insert_block index must lie in [0, n_layers={c.n_layers}], got {index}")
  new_c = dataclasses.replace(c, n_layers=c.n_layers + 1)
  rng = np.random.default_rng(seed)
  new = {}
  for path, (v, names) in _variables(model).items():
    if path[0] != "blocks":
      new[path] = v
      continue
    block = (jnp.zeros((1,) + v.shape[1:], v.dtype) if path[-1] in OUT_PROJECTIONS or path[-1] == "router_bias" else
             _fresh((1,) + v.shape[1:], names, v.dtype, c.init_std, rng))
    new[path] = jnp.concatenate([v[:index], block, v[index:]])
  return _build(new_c, new)


def to_padnet(model: Transformer) -> Transformer:
  """The PAD-Net form of an MoE transformer (models/padnet.py).

  The same experts, every entry dynamic, φ = 0, each static weight the experts' mean (the dense FFN for experts
  copied from one). Its logits equal the MoE's exactly (λ_d = 1 and the static term is 0·W^static);
  `padnet.partition` then moves entries to the static part.

  Args:
    model: a plain MoE transformer (moe.pad False).

  Returns:
    The PAD-Net `Transformer` (moe.pad True).

  Raises:
    SurgeryError: when `model` is not a `Transformer`, is dense, or is already a PAD-Net.
  """
  _check_transformer(model, "to_padnet")
  c = model.c
  if c.moe is None or c.moe.pad:
    raise SurgeryError(f"to_padnet takes a plain MoE transformer, got {'a dense' if c.moe is None else 'a PAD-Net'} "
                       f"one")
  values = {p: v for p, (v, _) in _variables(model).items()}
  stacks = {name: k for k, name in padnet.MATRICES.items()}
  for path, w in list(values.items()):
    key = stacks.get(path[-1])
    if key is not None:
      values[(*path[:-1], padnet.STATIC[key])] = jnp.mean(w, axis=-3)  # (..., E, I, O) -> (..., I, O)
      values[(*path[:-1], padnet.MASKS[key])] = jnp.ones(w.shape, jnp.bool_)
      values[(*path[:-1], "pad_phi")] = jnp.zeros(w.shape[:-3], w.dtype)
  return _build(dataclasses.replace(c, moe=dataclasses.replace(c.moe, pad=True)), values)


def to_moe(model: Transformer) -> Transformer:
  """A PAD-Net transformer folded back into a plain MoE.

  Each expert's weights are the effective λ_d·M⊙W + λ_s·(1 − M)⊙W^static the layer computes (`padnet.mix`); exact
  for an all-dynamic model with φ = 0.

  Args:
    model: a PAD-Net transformer (moe.pad True).

  Returns:
    The plain MoE `Transformer` (moe.pad False).

  Raises:
    SurgeryError: when `model` is not a `Transformer` or not a PAD-Net.
  """
  _check_transformer(model, "to_moe")
  c = model.c
  if c.moe is None or not c.moe.pad:
    raise SurgeryError("to_moe takes a PAD-Net transformer (moe.pad=True)")
  variables = {p: v for p, (v, _) in _variables(model).items()}
  pad_names = {*padnet.STATIC.values(), *padnet.MASKS.values(), "pad_phi"}
  values = {p: v for p, v in variables.items() if p[-1] not in pad_names}
  for key, name in padnet.MATRICES.items():
    for path in [p for p in variables if p[-1] == name]:
      at = path[:-1]
      values[path] = padnet.mix(variables[path], variables[(*at, padnet.STATIC[key])],
                                variables[(*at, padnet.MASKS[key])], variables[(*at, "pad_phi")])
  return _build(dataclasses.replace(c, moe=dataclasses.replace(c.moe, pad=False)), values)
