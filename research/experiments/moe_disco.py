"""Does MoE-DisCo's staged training (cluster the data, train one dense submodel per cluster independently, merge
into an MoE, fine-tune briefly) match end-to-end MoE training at equal tokens, and does the clustering matter?

  python -m research.experiments.moe_disco                    # full: writes research/results/moe_disco/
  python -m research.experiments.moe_disco --init pretrained  # from an upcycled pretrained dense model:
                                                              #   writes research/results/moe_disco_pretrained/
  python -m research.experiments.moe_disco --smoke            # seconds: what the tests and the notebook run

Claim (shared/reference/methods.md §1; Ye, Cheng et al., "MoE-DisCo", arXiv 2601.06857): an MoE whose experts
are trained as independent dense submodels on clusters of the data, then merged and briefly fine-tuned, "matches
or even surpasses" end-to-end training while most of the compute runs on cheap devices without communication.

Setup. One shared initialisation per seed: an MoE of the `tiny` backbone (d 64, 2 layers, GQA 4/2 heads) with
E = 4 SwiGLU experts of width F = 64 per layer, softmax router, top-2 renormalised over the selected pair
(LLaMA-MoE's gating), Switch load-balancing and z losses, capacity E/k (every expert has a slot for every token:
no token is ever dropped). Training data: a fixed pool of 4096 windows drawn from the built-in byte corpus (train
split); every arm samples its batches (16 × 64 bytes) from this pool. Arms, at equal training tokens N·16·64
(N = `steps`; a token is one input position of one training batch, every phase counted):
  e2e:           the MoE trained end to end for N steps;
  disco:         k-means clusters of the pool (below); S-phase: submodel e = the shared init's backbone (embedding,
                 attention, norms) + expert e as its dense FFN (a `Transformer` with d_ff = F, no router), trained
                 alone on windows of cluster e for S = (1 - g)·N / E steps; merge (expert e's FFN <- submodel e's;
                 shared params <- the uniform mean of the E submodels'; router <- the shared init's, never trained);
                 G-phase: the whole MoE for g·N steps on the whole pool (g = `g_frac`, the "expensive" share);
  disco_random:  the same with the pool's labels randomly permuted (same cluster sizes, random membership): the
                 control for whether clustering matters or only the staging;
  disco_size:    disco's submodels merged with shared params weighted by cluster size, then its own G-phase
                 (the merge rule is open question (b) of the reference);
and "at merge": disco's merged model before the G-phase ((1 - g)·N tokens, so not an equal-token arm).
Clustering: h_x = mean of the token embeddings of window x = (1/T)·c_x·W_emb (c_x the byte histogram), with the
shared init's embedding table, as the paper clusters with the embeddings of the checkpoint the submodels start
from. Here that checkpoint is random, so h_x is a random 64-dimensional projection of the window's byte histogram
and the clusters group windows by byte statistics (prose, indented code, digits/hex); no training tokens are
spent on them. k-means (Euclidean, unnormalised h, k-means++ and Lloyd, best of 3 restarts); cluster sizes are
whatever k-means gives, and every submodel trains for the same S steps (the S-phase's E devices run equally long),
so a small cluster is revisited more often. Validation windows (held-out split) get the label of the nearest
centroid, which gives the per-cluster losses and the specialisation gap: mean over clusters j of (loss of the
other submodels on j - loss of submodel j on j), ≈ 0 for the random control by construction.
`--init pretrained` (the paper's start, reference open question (f): both its models are upcycled checkpoints):
the shared init of every seed is a pretrained dense model upcycled into the MoE instead of a random MoE. The dense
model is the same backbone with d_ff = E·F, trained by the train CLI with AdamW on the same corpus's train split
(`pretrain_steps` × batch_size × seq_len tokens, seed 0, one model for all seeds, not counted in any arm's tokens:
every arm starts from it); `models.surgery.upcycle` splits each FFN's neurons at random into the E experts of
width F (LLaMA-MoE's construction, experts scaled by E) with a fresh router per seed. Everything else is as above;
the clustering then uses the pretrained embedding table, as the paper does.
Honest means: equal tokens, the held-out split, seeds 0-2 (init, pool, clustering, batches), and the same
learning-rate tuning for every arm: AdamW (weight decay 0.1, clip 1.0) with each phase on the CLI's schedule
(10% warmup, cosine to 0.1x over that phase), peak lr picked from `lrs` by seed 0's final validation loss per arm
(the S- and G-phase share it), then every seed at that lr. Negative results are reported as they come.

Shapes: N windows, T window length, V vocab, D d_model, E experts (= clusters), F expert width, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import MoEConfig, Transformer, preset
from models.surgery import OUT_PROJECTIONS, upcycle
from research.experiments import common
from research.train.config import TrainConfig
from research.train.store.pretrained import load_run

ARMS = ("e2e", "disco", "disco_random", "disco_size")
LABELS = {"e2e": "end-to-end MoE", "disco": "DisCo (k-means)", "disco_random": "DisCo (random partition)",
          "disco_size": "DisCo (k-means, size-weighted merge)"}
FFN = ("w_gate", "w_up", "w_down")  # dense names w_gate_DF, w_up_DF, w_down_FD; expert stacks w_gate_EDF, ...


class DiscoError(ValueError):
  """A setting the experiment cannot run with."""


@dataclasses.dataclass
class Config(common.Base):
  out: str | None = None
  """Default research/results/moe_disco, or research/results/moe_disco_pretrained with --init pretrained."""
  seeds: tuple[int, ...] = (0, 1, 2)
  lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2)
  """AdamW peak learning rates tried for every arm with the first seed; every seed then runs at the arm's best."""
  num_experts: int = 4
  top_k: int = 2
  d_expert: int = 64
  """Expert (and submodel FFN) width; top-2 of 64 gives the `tiny` preset's active FFN width 128."""
  steps: int = 300
  """End-to-end steps; every arm trains on steps × batch_size × seq_len tokens in all."""
  g_frac: float = 0.2
  """Share of the steps (= tokens) in the G-phase; the S-phase's (1 - g_frac)·steps split evenly over submodels."""
  batch_size: int = 16
  seq_len: int = 64
  pool: int = 4096
  """Training windows clustered and sampled from."""
  val_batches: int = 16
  """Held-out batches (batch_size windows each) for the curves and the per-cluster losses."""
  evals: int = 5
  """Validation points per phase (and after its last step)."""
  init: Literal["random", "pretrained"] = "random"
  """Every arm's start: a random MoE per seed, or a pretrained dense model upcycled (see the module docstring)."""
  pretrain_steps: int = 1000
  """--init pretrained: AdamW steps of the dense model (batch_size × seq_len tokens each)."""
  pretrain_lr: float = 3e-3
  work: str = "runs/experiments/moe_disco"
  """--init pretrained: where the dense model's run lives (a finished one is reused)."""
  render: bool = False
  """Rewrite results.md and the plot from the out directory's results.json (no training)."""


def sizes(cfg: Config) -> dict:
  """Steps per phase: {"e2e": N, "s": S per submodel, "g": G}, with E·S + G = N exactly (equal tokens)."""
  E, N = cfg.num_experts, cfg.steps
  if not 0.0 < cfg.g_frac < 1.0:
    raise DiscoError(f"g_frac must lie in (0, 1), got {cfg.g_frac}")
  g = int(round(cfg.g_frac * N))
  if g < 1 or N - g < E or (N - g) % E:
    raise DiscoError(f"steps={N} with g_frac={cfg.g_frac} leaves {N - g} S-phase steps, which do not split evenly "
                     f"over {E} submodels; choose steps so that steps - round(g_frac*steps) is a multiple of {E}")
  if cfg.pool < E:
    raise DiscoError(f"pool={cfg.pool} windows cannot form {E} clusters; use pool >= num_experts")
  return {"e2e": N, "s": (N - g) // E, "g": g}


def out_dir(cfg: Config) -> str:
  return cfg.out or "research/results/moe_disco" + ("_pretrained" if cfg.init == "pretrained" else "")


def moe_config(cfg: Config):
  E, K = cfg.num_experts, cfg.top_k
  return preset("tiny", moe=MoEConfig(num_experts=E, top_k=K, d_expert=cfg.d_expert, normalize_top_k=True,
                                      capacity_factor=E / K))


# ---- data: the window pool, mean-pooled embeddings, k-means ----

def window_pool(tokens, n: int, seq_len: int, seed: int) -> np.ndarray:
  """(n, seq_len + 1) int32 windows of `tokens` at uniform random starts (the pool every arm samples from)."""
  starts = np.random.default_rng([seed, 1]).integers(0, len(tokens) - seq_len - 1, size=n, endpoint=True)
  return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int32)


def mean_pooled(embed_VD, x_NT) -> np.ndarray:
  """h_N D = (1/T)·Σ_t W_emb[x_t], computed as the byte histogram times the table (float64)."""
  V = embed_VD.shape[0]
  counts_NV = np.stack([np.bincount(row, minlength=V) for row in np.asarray(x_NT)])
  return counts_NV @ np.asarray(embed_VD, np.float64) / x_NT.shape[1]


def nearest(x_ND, c_KD) -> np.ndarray:
  return (((x_ND[:, None] - c_KD[None]) ** 2).sum(-1)).argmin(1)


def kmeans(x_ND, k: int, *, seed: int = 0, restarts: int = 3, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
  """(labels N, centroids k×D) minimising Σ_n ||x_n - c_{l(n)}||² (Lloyd 1982): k-means++ seeding (Arthur &
  Vassilvitskii 2007), then assign-to-nearest / centroid-as-mean until the labels stop changing; the best of
  `restarts` seeds. An emptied cluster is re-seeded at the point farthest from its centroid."""
  x = np.asarray(x_ND, np.float64)
  N = len(x)
  if not 1 <= k <= N:
    raise DiscoError(f"k-means needs 1 <= k <= points, got k={k} for {N} points")
  best = None
  for r in range(restarts):
    rng = np.random.default_rng([seed, r])
    c = x[[rng.integers(N)]]
    while len(c) < k:
      d2 = ((x[:, None] - c[None]) ** 2).sum(-1).min(1)
      c = np.concatenate([c, x[[rng.choice(N, p=d2 / d2.sum()) if d2.sum() > 0 else rng.integers(N)]]])
    labels = None
    for _ in range(iters):
      new = nearest(x, c)
      for j in set(range(k)) - set(new.tolist()):
        far = ((x - c[new]) ** 2).sum(-1).argmax()
        new[far] = j
      if labels is not None and np.array_equal(new, labels):
        break
      labels = new
      c = np.stack([x[labels == j].mean(0) for j in range(k)])
    inertia = ((x - c[labels]) ** 2).sum()
    if best is None or inertia < best[0]:
      best = (inertia, labels, c)
  return best[1], best[2]


def sampler(pool_NT, rows, seed: int, stream: int, batch_size: int):
  """batch_fn for `common.fit`: step -> (x, y), batch_size windows drawn uniformly from pool[rows]."""
  rows = np.asarray(rows)

  def batch(step):
    w = pool_NT[rows[np.random.default_rng([seed, stream, step]).integers(len(rows), size=batch_size)]]
    return w[:, :-1], w[:, 1:]

  return batch


# ---- models: a submodel of the shared init, the merge ----

def _graphdef(c):
  return common.split(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))))[0]


def init_model(c, seed: int) -> Transformer:
  """A `Transformer(c)` drawn on the host from models/transformer.py's initial distribution: norm scales 1, other
  weights N(0, σ²) truncated to ±2σ with σ = init_std, or init_std/√(2L) for the residual output projections
  (`OUT_PROJECTIONS`), selection biases 0. NumPy, so nothing compiles (the eager initialisers compile once per
  weight shape: 6-8 CPU-seconds for this model, more than its whole smoke training)."""
  graphdef, params, buffers = common.split(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng([seed, 0])
  out_std = c.init_std / (2 * c.n_layers) ** 0.5

  def draw(path, a):
    name = str(path[-1].key)
    if "norm" in name:
      return jnp.asarray(np.ones(a.shape, a.dtype))
    z = rng.standard_normal(a.shape)
    while (bad := np.abs(z) > 2).any():
      z[bad] = rng.standard_normal(int(bad.sum()))
    return jnp.asarray(z * (out_std if name in OUT_PROJECTIONS else c.init_std), a.dtype)

  params = jax.tree_util.tree_map_with_path(draw, params)
  return common.join(graphdef, params, jax.tree.map(lambda a: jnp.asarray(np.zeros(a.shape, a.dtype)), buffers))


def pretrain_dense(cfg: Config, work: str) -> str:
  """The run directory of the dense model (`tiny` with d_ff = E·F) pretrained by the train CLI (reused if finished)."""
  tc = TrainConfig(model="tiny", d_ff=cfg.num_experts * cfg.d_expert, steps=cfg.pretrain_steps,
                   batch_size=cfg.batch_size, seq_len=cfg.seq_len, eval_every=max(cfg.pretrain_steps // 4, 1),
                   log_every=max(cfg.pretrain_steps // 4, 1), eval_batches=cfg.val_batches, devices=1,
                   mesh="data=-1", progress=False, ckpt_every=cfg.pretrain_steps, keep=1)
  return common.pretrained_run(os.path.join(work, "pretrain"), tc, cfg.pretrain_lr)


def upcycled(dense: Transformer, cfg: Config, seed: int) -> Transformer:
  """`dense` as the experiment's MoE: neurons split at random into E experts (scaled by E), a fresh router."""
  E, K = cfg.num_experts, cfg.top_k
  moe = upcycle(dense, E, K, "random", seed=seed, capacity_factor=E / K)
  if moe.c.moe != moe_config(cfg).moe:
    raise DiscoError(f"the upcycled MoE {moe.c.moe} is not the experiment's {moe_config(cfg).moe}")
  return moe


def submodel(moe: Transformer, e: int) -> Transformer:
  """The dense `Transformer` (d_ff = F, no router) made of `moe`'s shared params and expert e as its FFN."""
  _, params, _ = common.split(moe)
  blocks = dict(params["blocks"])
  experts = blocks.pop("moe")
  for name, dense, stack in zip(FFN, ("DF", "DF", "FD"), ("EDF", "EDF", "EFD")):
    blocks[f"{name}_{dense}"] = jnp.asarray(np.asarray(experts[f"{name}_{stack}"])[:, e])  # (L, E, ...) -> (L, ...)
  c = dataclasses.replace(moe.c, moe=None, d_ff=moe.c.moe.d_expert or moe.c.d_ff)
  return common.join(_graphdef(c), {**params, "blocks": blocks}, {})


def merge(subs: list[Transformer], moe: Transformer, weights=None) -> Transformer:
  """The MoE with expert e's FFN = subs[e]'s FFN in every layer, every shared param (embedding, attention, norms)
  = Σ_e w_e·(subs[e]'s), w the normalised `weights` (default uniform), and the router (and any selection bias)
  taken from `moe` (the shared init: a fresh random router)."""
  E = moe.c.moe.num_experts
  if len(subs) != E:
    raise DiscoError(f"merge needs one submodel per expert ({E}), got {len(subs)}")
  w = np.full(E, 1.0 / E) if weights is None else np.asarray(weights, np.float64)
  if w.shape != (E,) or (w < 0).any() or w.sum() <= 0:
    raise DiscoError(f"merge weights must be {E} non-negative numbers with a positive sum, got {weights}")
  w = w / w.sum()
  graphdef, params, buffers = common.split(moe)
  sub_params = [jax.tree.map(np.asarray, common.split(s)[1]) for s in subs]  # on the host: no eager compiles
  shared = jax.tree.map(lambda *xs: jnp.asarray(sum(wi * x.astype(np.float64) for wi, x in zip(w, xs)), xs[0].dtype),
                        *[{**p, "blocks": {k: v for k, v in p["blocks"].items() if not k.startswith(FFN)}}
                          for p in sub_params])
  experts = {"router_DE": params["blocks"]["moe"]["router_DE"]}
  for name, dense, stack in zip(FFN, ("DF", "DF", "FD"), ("EDF", "EDF", "EFD")):
    experts[f"{name}_{stack}"] = jnp.asarray(np.stack([p["blocks"][f"{name}_{dense}"] for p in sub_params], axis=1))
  merged = {**shared, "blocks": {**shared["blocks"], "moe": experts}}
  if jax.tree.structure(merged) != jax.tree.structure(params):
    raise DiscoError("the submodels' params do not fit the MoE; build them with submodel(moe, e)")
  return common.join(graphdef, merged, buffers)


# `common.fit`'s evaluation program (the same lambda, so the persistent compilation cache serves it), compiled once
# per model type in this process (graphdef static) rather than once per call as `common.evaluate` does.
_batch_ce = jax.jit(lambda graphdef, p, b, x, y: common.loss_fn(graphdef, p, b, x, y)[1][0], static_argnums=0)


def evaluate(model: Transformer, batches) -> float:
  """Mean held-out cross entropy (nats/byte) over equal-size batches: `common.evaluate`."""
  graphdef, params, buffers = common.split(model)
  return float(np.mean([float(_batch_ce(graphdef, params, buffers, x, y)) for x, y in batches]))


def cluster_batches(val, labels, k: int) -> list[list]:
  """Per cluster j: its validation windows regrouped into full batches of the validation batch size (a remainder
  smaller than a batch is left out, so every batch has the compiled shape)."""
  x, y = np.concatenate([b[0] for b in val]), np.concatenate([b[1] for b in val])
  B = len(val[0][0])
  out = []
  for j in range(k):
    idx = np.flatnonzero(labels == j)
    idx = idx[:len(idx) // B * B]
    out.append([(x[idx[i:i + B]], y[idx[i:i + B]]) for i in range(0, len(idx), B)])
  return out


def per_cluster(model: Transformer, batches_by_cluster) -> list:
  return [evaluate(model, b) if b else None for b in batches_by_cluster]


def specialization_gap(loss_EJ) -> float:
  """Mean over clusters j of (mean loss of submodels e != j on j) - (loss of submodel j on j)."""
  L = np.asarray(loss_EJ, np.float64)
  E = len(L)
  gaps = [(np.nansum(L[:, j]) - L[j, j]) / (E - 1) - L[j, j] for j in range(E) if not np.isnan(L[:, j]).any()]
  return float(np.mean(gaps)) if gaps else None


# ---- the arms ----

def _curve(records, tokens_per_step, offset=0) -> list[tuple[int, float]]:
  return [(offset + s * tokens_per_step, v) for s, v in ((r["step"], r["val_loss"]) for r in records
                                                         if "val_loss" in r)]


def _fit(model, lr, steps, batch_fn, val, evals):
  tx = common.phase_optimizer(lr, steps)  # lr and length in the state: every phase shares one compiled step
  return common.fit(model, tx, None, steps=steps, val=val, eval_every=max(steps // evals, 1), log_every=steps,
                    batch_fn=batch_fn)


def run_e2e(init, pool, val, lr, seed, cfg, n) -> dict:
  f = _fit(init, lr, n["e2e"], sampler(pool, np.arange(len(pool)), seed, 0, cfg.batch_size), val, cfg.evals)
  return {"model": f.model, "curve": _curve(f.records, cfg.batch_size * cfg.seq_len), "final": f.final_val}


def s_phase(init, pool, labels, val, lr, seed, cfg, n) -> dict:
  """E submodels trained independently, e on windows of cluster e: {"subs", "sub_final", "s_curve"}; the curve is
  the submodels' mean val loss against all submodels' tokens (the E devices run side by side)."""
  E, tps = cfg.num_experts, cfg.batch_size * cfg.seq_len
  fits = [_fit(submodel(init, e), lr, n["s"], sampler(pool, np.flatnonzero(labels == e), seed, 1 + e,
                                                      cfg.batch_size), val, cfg.evals) for e in range(E)]
  curves = [_curve(f.records, E * tps) for f in fits]
  curve = [(x, float(np.mean([c[i][1] for c in curves]))) for i, (x, _) in enumerate(curves[0])]
  return {"subs": [f.model for f in fits], "sub_final": [f.final_val for f in fits], "s_curve": curve}


def g_phase(s: dict, init, pool, val, lr, seed, cfg, n, weights=None) -> dict:
  """Merge S-phase `s` (shared params weighted by `weights`, default uniform), then the whole MoE on the whole
  pool: {"merge_val", "model", "final", "curve" (S-phase, the merged model, G-phase)}."""
  tps = cfg.batch_size * cfg.seq_len
  merged = merge(s["subs"], init, weights)
  merge_val = evaluate(merged, val)
  g = _fit(merged, lr, n["g"], sampler(pool, np.arange(len(pool)), seed, 99, cfg.batch_size), val, cfg.evals)
  s_tokens = cfg.num_experts * n["s"] * tps
  return {"merge_val": merge_val, "model": g.model, "final": g.final_val,
          "curve": s["s_curve"] + [(s_tokens, merge_val)] + _curve(g.records, tps, s_tokens)}


def _describe(windows_NT) -> str:
  """The windows' byte make-up: shares of whitespace, letters and digits."""
  b = np.asarray(windows_NT).ravel()
  lower = b | 32
  shares = {"space/newline": np.isin(b, [9, 10, 32]).mean(), "letters": ((lower >= 97) & (lower <= 122)).mean(),
            "digits": ((b >= 48) & (b <= 57)).mean()}
  return ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  """Tunes lr per arm on the first seed, runs every seed at the best, returns the results as plain data (and, at
  full size, writes them to `cfg.out`)."""
  if cfg.render:
    return render(cfg)
  if not cfg.smoke:
    return _main(cfg)
  with tempfile.TemporaryDirectory(prefix="optlab-disco-") as tmp:
    return _main(dataclasses.replace(cfg, seeds=cfg.seeds[:1], lrs=(3e-3,), steps=16, g_frac=0.25, batch_size=8,
                                     seq_len=32, pool=128, val_batches=4, evals=2, pretrain_steps=8, work=tmp))


def _main(cfg: Config) -> dict:
  n = sizes(cfg)
  E, t0, cpu0 = cfg.num_experts, time.time(), time.process_time()
  tokens, val = common.corpus_and_val(cfg.batch_size, cfg.seq_len, cfg.val_batches)
  val_x = np.concatenate([x for x, _ in val])
  c = moe_config(cfg)
  data, runs = {}, {}
  dense = load_run(pretrain_dense(cfg, cfg.work))[0] if cfg.init == "pretrained" else None
  start = {} if dense is None else {"dense_val": evaluate(dense, val), "upcycled_val": {}}

  for seed in cfg.seeds:  # the shared init, the pool and its partitions: no training tokens
    init = init_model(c, seed) if dense is None else upcycled(dense, cfg, seed)
    if dense is not None:
      start["upcycled_val"][seed] = evaluate(init, val)
    pool = window_pool(tokens, cfg.pool, cfg.seq_len, seed)
    emb = np.asarray(init.embed_VD[...])
    labels, centroids = kmeans(mean_pooled(emb, pool[:, :-1]), E, seed=seed)
    val_labels = nearest(mean_pooled(emb, val_x), centroids)
    data[seed] = {"init": init, "pool": pool, "labels": {"disco": labels,
                                                         "disco_random": np.random.default_rng([seed, 2]).permutation(
                                                             labels)},
                  "val_labels": val_labels, "val_clusters": cluster_batches(val, val_labels, E)}

  def run(arm, lr, seed):
    if (arm, lr, seed) not in runs:
      d = data[seed]
      if arm == "e2e":
        r = run_e2e(d["init"], d["pool"], val, lr, seed, cfg, n)
      else:
        s = s_phase(d["init"], d["pool"], d["labels"][arm], val, lr, seed, cfg, n)
        r = {**s, **g_phase(s, d["init"], d["pool"], val, lr, seed, cfg, n)}
      runs[arm, lr, seed] = r
      print(f"[moe_disco] {arm} lr={lr:g} seed={seed}: val {r['final']:.4f} ({time.time() - t0:.0f}s)", flush=True)
    return runs[arm, lr, seed]

  tune = {arm: {lr: run(arm, lr, cfg.seeds[0])["final"] for lr in cfg.lrs} for arm in ARMS[:3]}
  best = {arm: min(tune[arm], key=tune[arm].get) for arm in tune}
  best["disco_size"] = best["disco"]  # the same S-phase (reused): only the merge rule differs
  for seed in cfg.seeds:
    for arm in ARMS[:3]:
      run(arm, best[arm], seed)
    s, d, lr = runs["disco", best["disco"], seed], data[seed], best["disco"]
    sizes_E = np.bincount(d["labels"]["disco"], minlength=E)
    runs["disco_size", lr, seed] = {**s, **g_phase(s, d["init"], d["pool"], val, lr, seed, cfg, n, weights=sizes_E)}

  result = {"config": dataclasses.asdict(cfg), "command": common.command(), "steps": n,
            "tokens_per_arm": n["e2e"] * cfg.batch_size * cfg.seq_len,
            "g_token_share": n["g"] / n["e2e"], "tune": {a: {str(k): v for k, v in t.items()} for a, t in tune.items()},
            "best_lr": best, "start": start, "seeds": {}}
  for seed in cfg.seeds:
    d = data[seed]
    rec = {"cluster_sizes": np.bincount(d["labels"]["disco"], minlength=E).tolist(),
           "random_sizes": np.bincount(d["labels"]["disco_random"], minlength=E).tolist(),
           "val_cluster_sizes": np.bincount(d["val_labels"], minlength=E).tolist(),
           "clusters": [_describe(d["pool"][d["labels"]["disco"] == e]) for e in range(E)], "arms": {}}
    for arm in ARMS:
      r = runs[arm, best[arm], seed]
      rec["arms"][arm] = {"final": r["final"], "curve": r["curve"], "merge_val": r.get("merge_val"),
                          "per_cluster": per_cluster(r["model"], d["val_clusters"])}
      if arm in ("disco", "disco_random"):  # submodel e's loss on the val windows of k-means cluster j
        spec = [per_cluster(m, d["val_clusters"]) for m in r["subs"]]
        rec["arms"][arm].update(specialization=spec, sub_final=r["sub_final"],
                                gap=specialization_gap(np.array(spec, dtype=float)))
    result["seeds"][seed] = rec
  result["wall_s"], result["cpu_s"] = time.time() - t0, time.process_time() - cpu0
  if not cfg.smoke:
    write(cfg, result)
  return result


def render(cfg: Config) -> dict:
  """Rewrites results.md and the plot from OUT/results.json, keeping the command and commit the runs trained at."""
  out = out_dir(cfg)
  with open(os.path.join(out, "results.json")) as f:
    result = json.load(f)
  with open(os.path.join(out, "results.md")) as f:
    trained = re.search(r"^Command: `(.+)` \(commit (\w+)", f.read(), re.M)
  result.setdefault("command", trained.group(1))
  result["rendered"] = f"The runs trained at commit {trained.group(2)}; this file and the plot were re-rendered " \
                       "from its results.json (`--render`)."
  write(dataclasses.replace(cfg, **{k: v for k, v in result["config"].items() if k not in ("out", "render")}),
        result, cmd=result["command"])
  return result


def summary(result: dict) -> dict:
  """{arm: {"final", "merge_val", "gap", "sub_mean": (mean, std) over seeds, or None where the arm has none}}."""
  out = {}
  for arm in ARMS:
    rs = [s["arms"][arm] for s in result["seeds"].values()]
    vals = {k: [r[k] for r in rs if r.get(k) is not None] for k in ("final", "merge_val", "gap")}
    vals["sub_mean"] = [float(np.mean(r["sub_final"])) for r in rs if r.get("sub_final")]
    out[arm] = {k: common.mean_std(v) if v else None for k, v in vals.items()}
  return out


def paired(result: dict, arm: str, base: str) -> tuple[float, float, str]:
  """(mean, std) over seeds of final(arm) - final(base) (the arms share each seed's init and pool), and a verdict:
  "lower"/"higher" when every seed agrees in sign and |mean| > 2·std/√n, else "no consistent difference"."""
  d = [s["arms"][arm]["final"] - s["arms"][base]["final"] for s in result["seeds"].values()]
  m, sd = common.mean_std(d)
  clear = len(d) > 1 and (all(x < 0 for x in d) or all(x > 0 for x in d)) and abs(m) > 2 * sd / np.sqrt(len(d))
  return m, sd, ("lower" if m < 0 else "higher") if clear else "no consistent difference"


def _ms(ms, digits: int = 4) -> str:
  return "–" if ms is None else common.pm(ms, digits=digits)


def tables(result: dict) -> list[str]:
  n, sm = result["steps"], summary(result)
  seeds = list(result["seeds"])
  s0 = result["seeds"][seeds[0]]
  E = len(s0["cluster_sizes"])
  lines = [f"Tokens per arm: {result['tokens_per_arm']:,} (end-to-end: {n['e2e']} steps; DisCo: {E} submodels × "
           f"{n['s']} S-phase steps + {n['g']} G-phase steps, G-phase share {100 * result['g_token_share']:.0f}%). "
           f"Seeds {', '.join(map(str, seeds))}: mean ± std (ddof 1); paired = this arm minus end-to-end, per seed.",
           *_start_lines(result), "",
           "| arm | lr (best on seed 0) | final val loss | paired vs end-to-end | S-phase submodels' mean val "
           "| val at merge (S-phase tokens only) | specialisation gap |", "|---|---|---|---|---|---|---|"]
  lrs = [float(lr) for lr in result["tune"]["e2e"]]
  for arm in ARMS:
    d = "–" if arm == "e2e" else "{:+.4f} ± {:.4f} ({})".format(*paired(result, arm, "e2e"))
    lr = result["best_lr"][arm]
    edge = " (grid edge)" if len(lrs) > 1 and lr in (min(lrs), max(lrs)) else ""
    lines.append(f"| {LABELS[arm]} | {lr:g}{edge} | {_ms(sm[arm]['final'])} | {d} "
                 f"| {_ms(sm[arm]['sub_mean'])} | {_ms(sm[arm]['merge_val'])} | {_ms(sm[arm]['gap'], 3)} |")
  lines += ["", "Learning-rate grid (seed 0, final val loss):", "", "| arm | " + " | ".join(f"lr {lr}" for lr in lrs)
            + " |", "|---|" + "---|" * len(lrs)]
  lines += [f"| {LABELS[a]} | " + " | ".join(f"{v:.4f}" for v in t.values()) + " |" for a, t in result["tune"].items()]
  lines += ["", f"Clusters of seed {seeds[0]} (k-means on mean-pooled init embeddings), final val loss per cluster "
            "(val windows in full batches), and the k-means submodel of that cluster after the S-phase:", "",
            "| cluster | pool windows | val windows | bytes | " + " | ".join(LABELS[a] for a in ARMS[:3])
            + " | own submodel |", "|---|---|---|---|" + "---|" * 4]
  for j, (size, vsize, desc) in enumerate(zip(s0["cluster_sizes"], s0["val_cluster_sizes"], s0["clusters"])):
    cells = [s0["arms"][a]["per_cluster"][j] for a in ARMS[:3]] + [s0["arms"]["disco"]["specialization"][j][j]]
    lines.append(f"| {j} | {size} | {vsize} | {desc} | " + " | ".join("–" if v is None else f"{v:.4f}" for v in cells)
                 + " |")
  if "wall_s" in result:
    lines += ["", f"Time of the whole command: {result['wall_s']:.0f} s wall on a 2-core machine (other jobs may "
              "share it); "
              f"{result['cpu_s']:.0f} s of CPU in this process (all threads). Plot: `val_loss.png`."
              + (f" {result['rendered']}" if result.get("rendered") else "")]
  return lines


def _start_lines(result: dict) -> list[str]:
  start, cfg = result.get("start"), result["config"]
  if not start:
    return []
  up = common.mean_std(start["upcycled_val"].values())
  return ["", f"Start (every arm, every seed): the dense model (d_ff {cfg['num_experts'] * cfg['d_expert']}) after "
          f"{cfg['pretrain_steps']} AdamW steps at lr {cfg['pretrain_lr']:g} "
          f"({cfg['pretrain_steps'] * cfg['batch_size'] * cfg['seq_len']:,} "
          f"pretraining tokens, not counted above): val {start['dense_val']:.4f}; upcycled to the MoE (random neuron "
          f"split, fresh router per seed): val {common.pm(up)}."]


def findings(result: dict) -> list[str]:
  """The "Reading:" lines, worded from the numbers (a difference is claimed only where `paired` finds one)."""
  sm, nseeds, n = summary(result), len(result["seeds"]), result["steps"]
  fin = {k: sm[k]["final"] for k in ARMS}
  d_b, d_r, d_w = paired(result, "disco", "e2e"), paired(result, "disco_random", "disco"), paired(
      result, "disco_size", "disco")
  gap_b, gap_r = sm["disco"]["gap"], sm["disco_random"]["gap"]
  clust = {"lower": "the random partition ends lower: the clustering hurts here",
           "higher": "the random partition ends higher: the clustering helps beyond the staging",
           "no consistent difference": "the clustering makes no consistent difference beyond the staging"}[d_r[2]]
  specialise = gap_b is not None and gap_r is not None and gap_b[0] - 2 * gap_b[1] > max(gap_r[0] + 2 * gap_r[1], 0)
  return [
      f"Reading: at equal tokens ({result['tokens_per_arm']:,}) DisCo (k-means) ends at {_ms(fin['disco'])} vs "
      f"end-to-end {_ms(fin['e2e'])} (paired difference {d_b[0]:+.4f} ± {d_b[1]:.4f} over {nseeds} seeds: "
      + ("DisCo lower, a consistent gain" if d_b[2] == "lower" else "DisCo higher in every seed: a consistent loss"
         if d_b[2] == "higher" else "no consistent difference") + ").",
      f"Reading: the random-partition control ends at {_ms(fin['disco_random'])} (paired vs k-means DisCo "
      f"{d_r[0]:+.4f} ± {d_r[1]:.4f}): {clust}.",
      f"Reading: specialisation gap after the S-phase (other submodels' loss minus the own submodel's, on a cluster's "
      f"val windows): k-means {_ms(gap_b, 3)} nats, random {_ms(gap_r, 3)} nats: "
      + ("the k-means submodels are specialists of their clusters, the random ones are not." if specialise else
         "no clear specialisation of the k-means submodels over the random control."),
      f"Reading: the S-phase submodels reach {_ms(sm['disco']['sub_mean'])} (mean over submodels, full val set); "
      f"the merged MoE starts at {_ms(sm['disco']['merge_val'])} (random partition "
      f"{_ms(sm['disco_random']['merge_val'])}), "
      f"and the G-phase ({100 * result['g_token_share']:.0f}% of the tokens) brings it to {_ms(fin['disco'])}. "
      f"Weighting the shared-param average by cluster size: {_ms(fin['disco_size'])} (paired vs uniform "
      f"{d_w[0]:+.4f} ± {d_w[1]:.4f}, {d_w[2]}).",
      *_caveats(result),
      f"Reading (an explanation, not tested here): equal tokens are not equal sequential updates: the shared "
      f"backbone gets {n['s']} S-phase steps in each copy, averaged once, then {n['g']} G-phase steps, against "
      f"{n['e2e']} for end-to-end"
      + ("; from a random init that is what an equal-token DisCo gives up. The paper starts from pretrained "
         "checkpoints (reference open question (f)): `--init pretrained` runs that (research/results/"
         "moe_disco_pretrained/)." if not result.get("start") else
         f", here all starting from the same pretrained model (val {result['start']['dense_val']:.4f} before "
         "upcycling); the random-init run is in research/results/moe_disco/."),
  ]


def _caveats(result: dict) -> list[str]:
  """Readings that qualify the ones above: arms compared at different lrs; a pretrained start none gets back to."""
  out, best, tune = [], result["best_lr"], result["tune"]
  if best["disco"] != best["disco_random"]:
    lr = best["disco_random"]
    out.append(f"Reading: k-means and random-partition DisCo are compared at their own best lrs ({best['disco']:g} vs "
               f"{lr:g}); at the same lr {lr:g} on seed 0 they end at {tune['disco'][str(lr)]:.4f} vs "
               f"{tune['disco_random'][str(lr)]:.4f}.")
  start = result.get("start")
  if start:
    up = common.mean_std(start["upcycled_val"].values())
    e2e = summary(result)["e2e"]["final"]
    out.append(f"Reading: upcycling costs {up[0] - start['dense_val']:+.3f} nats/byte (dense {start['dense_val']:.4f}, "
               f"upcycled MoE {common.pm(up)}); after {result['tokens_per_arm']:,} tokens the best arm, end-to-end, is "
               f"at {common.pm(e2e)}, {'still above' if e2e[0] > start['dense_val'] else 'below'} the dense model it "
               "started from.")
  return out


def plot(result: dict):
  import matplotlib.pyplot as plt
  seeds = list(result["seeds"])
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [2.2, 1, 1]}, layout="constrained")
  ax = axes[0]
  colors = {"e2e": "k", "disco": "C0", "disco_random": "C3", "disco_size": "C2"}
  n = result["steps"]
  g_start = (n["e2e"] - n["g"]) * result["tokens_per_arm"] / n["e2e"]
  for arm in ARMS:
    curves = [result["seeds"][s]["arms"][arm]["curve"] for s in seeds]
    x = np.array([p[0] for p in curves[0]], float)
    y = np.array([[p[1] for p in c] for c in curves])
    if arm == "disco_size":  # its S-phase is disco's: only its merge and G-phase
      keep = np.arange(len(x)) >= len(x) - 1 - np.sum(x > g_start)
      x, y = x[keep], y[:, keep]
    m, sd = y.mean(0), y.std(0)
    ax.plot(x, m, "-o", ms=3, color=colors[arm], label=LABELS[arm])
    ax.fill_between(x, m - sd, m + sd, color=colors[arm], alpha=0.15)
  if result.get("start"):
    ax.axhline(result["start"]["dense_val"], color="gray", ls="--", lw=1, label="pretrained dense model (the start)")
  ax.axvline(g_start, color="gray", ls=":", lw=1)
  ax.text(g_start, ax.get_ylim()[1], " merge → G-phase", va="top", fontsize=8, color="gray")
  ax.set(xlabel="training tokens (S-phase: all submodels' tokens, their mean val loss)", ylabel="val loss (nats/byte)",
         title=f"MoE-DisCo vs end-to-end at equal tokens (mean ± std, {len(seeds)} seeds)")
  ax.legend(fontsize=8)
  s0 = result["seeds"][seeds[0]]["arms"]
  # each submodel's loss on a cluster minus the mean of all submodels on it: a negative diagonal = specialists
  mats = [np.array(s0[a]["specialization"], dtype=float) for a in ("disco", "disco_random")]
  col_mean = lambda m: np.array([c[~np.isnan(c)].mean() if (~np.isnan(c)).any() else np.nan for c in m.T])
  mats = [m - col_mean(m)[None] for m in mats]
  lim = max(np.nanmax(np.abs(m)) for m in mats) if np.isfinite(mats[0]).any() else 1.0
  for ax, arm, mat in zip(axes[1:], ("disco", "disco_random"), mats):
    im = ax.imshow(mat, vmin=-lim, vmax=lim, cmap="RdBu_r")
    for (i, j), v in np.ndenumerate(mat):
      ax.text(j, i, "" if np.isnan(v) else f"{v:+.2f}", ha="center", va="center", fontsize=7)
    ax.set(xlabel="val windows of k-means cluster", ylabel="submodel",
           title=f"{'k-means' if arm == 'disco' else 'random-partition'} submodels (seed {seeds[0]})",
           xticks=range(len(mat)), yticks=range(len(mat)))
  fig.colorbar(im, ax=axes[1:], shrink=0.8, label="S-phase val loss − mean over submodels (nats)")
  return fig


def write(cfg: Config, result: dict, cmd: str | None = None):
  question = __doc__.split("\n\n")[0]
  pretrained = cfg.init == "pretrained"
  drop = ("smoke", "out", "work", "render") + (() if pretrained else ("init", "pretrain_steps", "pretrain_lr"))
  settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in drop}
  out = out_dir(cfg)
  common.write_results(out, "moe_disco" + ("_pretrained" if pretrained else ""), question, tables(result),
                       findings=findings(result), settings=settings, data=result, cmd=cmd)
  fig = plot(result)
  fig.savefig(os.path.join(out, "val_loss.png"), dpi=110, bbox_inches="tight")


if __name__ == "__main__":
  common.cli(main, Config, cache="optlab-disco-cache-", min_entry_bytes=None)
