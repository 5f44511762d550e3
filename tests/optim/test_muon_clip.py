"""MuonClip / QK-clip (Kimi K2, arXiv 2507.20534): the model's per-head max logit against NumPy, the clip's scales
against their formula, and the forced large-logit case — after the clip the same batch's offending heads sit
exactly at τ and the other heads' logits do not move (MHA and GQA, with q/k biases) — plus plain Muon when no head
exceeds τ, the refusals, and the CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
import optim
from models.transformer import max_logits
from optim import QKClipError, head_scales, qk_clip

RNG = np.random.default_rng(0)
TOKENS = RNG.integers(0, 256, (2, 12)).astype(np.int32)


def np_max_logits(q, k):
  """(N,) max over batch and causal (t ≥ s) positions of q_t·k_s/√H, float64; query head n reads kv head n // (N/K)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  G = N // k.shape[2]
  out = np.full(N, -np.inf)
  for n in range(N):
    s = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // G]) / np.sqrt(H)
    s[:, ~np.tril(np.ones((T, T), bool))] = -np.inf
    out[n] = s.max()
  return out


def test_max_logits_against_numpy_with_gqa():
  q = RNG.standard_normal((2, 7, 6, 4)).astype(np.float32)
  k = RNG.standard_normal((2, 7, 2, 4)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(max_logits(jnp.asarray(q), jnp.asarray(k))), np_max_logits(q, k), rtol=1e-5)


def test_head_scales_formula():
  """η = min(1, τ/S); MHA (K = N): s_q = η^α, s_k = η^(1−α) (Kimi K2); GQA: s_k = min over the group of η^(1−α),
  s_q = η / s_k, so s_q·s_k = η for every head."""
  S = np.array([[50.0, 400.0, 90.0, 101.0], [120.0, -3.0, 100.0, 250.0]])
  eta = np.minimum(1.0, 100.0 / np.where(S > 0, S, 1.0))
  s_q, s_k = head_scales(S, 100.0, 0.3, kv_heads=4)
  np.testing.assert_allclose(np.asarray(s_q), eta ** 0.3, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(s_k), eta ** 0.7, rtol=1e-6)
  s_q, s_k = head_scales(S, 100.0, 0.5, kv_heads=2)
  want_k = np.minimum(eta[:, 0::2], eta[:, 1::2]) ** 0.5
  np.testing.assert_allclose(np.asarray(s_k), want_k, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(s_q), eta / np.repeat(want_k, 2, axis=-1), rtol=1e-6)


def test_float64_parameters_are_clipped_in_float64():
  """The clip's scales and products in the parameters' dtype: float64 weights against a float64 NumPy clip, 1e-12
  (float32 arithmetic would be ~1e-7 off)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(1)
    L, D, N, K, H = 2, 8, 4, 2, 3
    params = {"wq": rng.standard_normal((L, D, N * H)), "wk": rng.standard_normal((L, D, K * H)),
              "wv": rng.standard_normal((L, D, K * H))}
    updates = {k: 1e-3 * rng.standard_normal(v.shape) for k, v in params.items()}
    S = np.array([[150.0, 90.0, 333.3, 100.5], [80.0, 1234.5, 99.0, 101.0]])
    tau, alpha = 100.0, 0.5
    tx = qk_clip(tau, alpha)
    u, _ = tx.update(jax.tree.map(jnp.asarray, updates), tx.init(params), jax.tree.map(jnp.asarray, params),
                     max_logits=jnp.asarray(S))
    assert u["wq"].dtype == jnp.float64
    eta = np.minimum(1.0, tau / S)  # the module docstring's scales, float64
    s_k = np.minimum(eta[:, 0::2], eta[:, 1::2]) ** (1 - alpha)
    s_q = eta / np.repeat(s_k, 2, axis=-1)
    for name, s in (("wq", s_q), ("wk", s_k)):
      cols = np.repeat(s, H, axis=-1)[:, None, :]
      want = cols * (params[name] + updates[name]) - params[name]
      np.testing.assert_allclose(np.asarray(u[name]), want, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(np.asarray(u["wv"]), updates["wv"])


def _model(n_kv_heads, qkv_bias=False):
  # one layer: "the same inputs" are the embeddings, which the clip does not change (a later layer's inputs are)
  cfg = models.preset("tiny", n_layers=1, qk_norm=False, n_kv_heads=n_kv_heads, qkv_bias=qkv_bias, logit_stats=True)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  # force large logits: queries ×30 in two of the four heads, keys ×3
  H = cfg.hd
  boost = np.ones(cfg.n_heads * H, np.float32)
  boost[:H] = 30.0
  boost[2 * H:3 * H] = 30.0
  model.blocks.wq_DQ[...] = model.blocks.wq_DQ[...] * jnp.asarray(boost)
  model.blocks.wk_DK[...] = model.blocks.wk_DK[...] * 3.0
  if qkv_bias:
    model.blocks.q_bias_Q[...] = jnp.asarray(RNG.standard_normal(model.blocks.q_bias_Q.shape), jnp.float32)
    model.blocks.k_bias_K[...] = jnp.asarray(RNG.standard_normal(model.blocks.k_bias_K.shape), jnp.float32)
  return model


@pytest.mark.parametrize("n_kv_heads, qkv_bias", [(4, False), (2, True)])
def test_forced_large_logits_are_clipped_to_tau_and_the_rest_kept(n_kv_heads, qkv_bias):
  model = _model(n_kv_heads, qkv_bias)
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)
  logits_of = jax.jit(lambda p: nnx.merge(graphdef, nnx.State(p)).forward(TOKENS)[1]["max_logit"])
  before = np.asarray(logits_of(params))
  tau = float(np.median(before))  # two heads above, two below
  assert (before > tau).sum() == 2 and (before < tau).sum() == 2, before
  zero = jax.tree.map(jnp.zeros_like, params)
  tx = qk_clip(tau)
  u, _ = tx.update(zero, tx.init(params), params, max_logits=before)
  after = np.asarray(logits_of(optax.apply_updates(params, u)))
  np.testing.assert_allclose(after, np.where(before > tau, tau, before), rtol=2e-5)
  for name in ("embed_VD", "blocks/wv_DK", "blocks/wo_QD", "blocks/w_up_DF"):
    node = u
    for key in name.split("/"):
      node = node[key]
    assert not np.any(np.asarray(node)), name  # only queries and keys move


def test_muonclip_is_muon_when_no_head_exceeds_tau_or_without_statistics():
  params = {"blocks": {"wq_DQ": jnp.asarray(RNG.standard_normal((2, 8, 8)), jnp.float32),
                       "wk_DK": jnp.asarray(RNG.standard_normal((2, 8, 8)), jnp.float32),
                       "w_up": jnp.asarray(RNG.standard_normal((2, 8, 16)), jnp.float32)},
            "attn_norm": jnp.ones((2, 8))}
  g = jax.tree.map(lambda p: jnp.sin(3 * p), params)
  clip, plain = optim.muonclip(1e-2, clip_threshold=100.0), optim.muon(1e-2)
  a, _ = jax.jit(plain.update)(g, plain.init(params), params)
  for extra in ({}, {"max_logits": jnp.full((2, 2), 99.0)}):
    b, _ = jax.jit(clip.update)(g, clip.init(params), params, **extra)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  b, _ = jax.jit(clip.update)(g, clip.init(params), params, max_logits=jnp.array([[400.0, 1.0], [1.0, 1.0]]))
  new = optax.apply_updates(params, b)["blocks"]["wq_DQ"]
  want = (params["blocks"]["wq_DQ"] + a["blocks"]["wq_DQ"])[0, :, :4] * 0.5  # η = 1/4, α = 1/2: ×1/2
  np.testing.assert_allclose(np.asarray(new[0, :, :4]), np.asarray(want), rtol=1e-6)


def test_qk_norm_models_and_misfit_statistics_are_refused():
  tx = qk_clip(100.0)
  params = {"wq": jnp.ones((2, 4, 8)), "wk": jnp.ones((2, 4, 8)), "q_norm": jnp.ones((2, 4))}
  with pytest.raises(QKClipError, match="QK-norm undoes"):
    tx.update(params, tx.init(params), params, max_logits=jnp.ones((2, 2)))
  del params["q_norm"]
  with pytest.raises(QKClipError, match="does not fit the query projection"):
    tx.update(params, tx.init(params), params, max_logits=jnp.ones((3, 2)))


def test_cli_trains_with_muonclip_and_logs_max_logits(tmp_path):
  from research.train import main
  out = str(tmp_path / "run")
  main(["--model", "tiny", "--qk-norm", "False", "--optimizer", "muonclip", "--opt", "clip_threshold=0.5",
        "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--log-every", "1", "--eval-every", "3", "--out", out,
        "--no-progress"])
  recs = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
  assert all(np.isfinite(r["attn/max_logit"]) and len(r["attn/max_logit_layer"]) == 2 for r in recs)
  cfg = json.load(open(f"{out}/config.json"))
  assert cfg["model_config"]["logit_stats"] is True
  with pytest.raises(SystemExit) as e:  # tiny has QK-norm: refused before anything starts
    main(["--model", "tiny", "--optimizer", "muonclip", "--steps", "3", "--out", str(tmp_path / "r2"), "--no-progress"])
  assert e.value.code == 2 and not (tmp_path / "r2").exists()


def test_muonclip_sharded_equals_unsharded():
  """3 steps with max logits above τ in some heads, on 8 devices (fsdp=4, tensor=2, Explicit axes) and on one: the
  same parameters, each update in its parameter's sharding."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import sharding
  specs = {"wq_DQ": P(None, "fsdp", "tensor"), "wk_DK": P(None, "fsdp", "tensor"), "w_up": P(None, "fsdp", "tensor")}
  params = {"wq_DQ": RNG.standard_normal((2, 16, 32)), "wk_DK": RNG.standard_normal((2, 16, 16)),
            "w_up": RNG.standard_normal((2, 16, 32))}
  params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  logits = [jnp.asarray(RNG.uniform(50, 200, (2, 4)), jnp.float32) for _ in range(3)]  # N = 4 heads of 8, K = 2
  muon_only = lambda p: jax.tree.map(lambda _: "muon", p)
  tx = optim.muonclip(1e-2, clip_threshold=100.0, labels=muon_only)

  def run(params, tx=tx):
    state, step = tx.init(params), jax.jit(tx.update)
    for k, s in enumerate(logits):
      u, state = step(jax.tree.map(lambda p: jnp.sin((k + 1) * p), params), state, params, max_logits=s)
      params = optax.apply_updates(params, u)
    return u, params

  _, single = run(params)
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=True)
  with jax.set_mesh(mesh):
    u, sharded = run({k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()})
  for k, spec in specs.items():
    assert u[k].sharding.spec == spec, k
    np.testing.assert_allclose(np.asarray(sharded[k]), np.asarray(single[k]), atol=2e-6, err_msg=k)
  plain = run(params, optim.muon(1e-2, labels=muon_only))[1]  # the clip acted: without it, other queries
  assert np.abs(np.asarray(plain["wq_DQ"]) - np.asarray(single["wq_DQ"])).max() > 1e-2
