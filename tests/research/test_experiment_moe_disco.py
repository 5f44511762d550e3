"""research/experiments/moe_disco.py: the smoke run's result, and the experiment's own pieces (k-means, mean pooling,
the sampler, the submodel / merge surgery with forced routing)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer
from models.surgery import OUT_PROJECTIONS
from research.experiments import common
from research.experiments import moe_disco as md

O0 = {"xla_backend_optimization_level": 0}  # LLVM -O0: less compile time, the same IEEE arithmetic


@pytest.fixture(scope="module")
def smoke(notebooks):
  """(`moe_disco.main(Config(smoke=True))` as notebooks/moe_disco.ipynb ran it, where its default `out` would be)."""
  run = notebooks.run("moe_disco")
  return run.result, run.cwd / md.out_dir(md.Config())


def test_smoke_runs_every_arm_at_equal_tokens_and_learns(smoke):
  result, out = smoke
  assert not out.exists(), "the smoke size must write nothing"
  n, E = result["steps"], result["config"]["num_experts"]
  assert n["e2e"] == E * n["s"] + n["g"] and n["g"] >= 1 and n["s"] >= 1
  assert result["g_token_share"] == n["g"] / n["e2e"]
  (rec,) = result["seeds"].values()
  assert set(rec["arms"]) == set(md.ARMS)
  for arm, r in rec["arms"].items():
    assert r["curve"][-1][0] == result["tokens_per_arm"], f"{arm} did not train on the common token budget"
    xs = [x for x, _ in r["curve"]]
    assert xs == sorted(xs)
    losses = [v for _, v in r["curve"]]
    assert all(math.isfinite(v) for v in losses)
    assert r["final"] == losses[-1] < losses[0] < math.log(256) + 0.1, f"{arm} did not learn: {losses}"
    assert all(v is None or math.isfinite(v) for v in r["per_cluster"])
  for arm in ("disco", "disco_random", "disco_size"):
    r = rec["arms"][arm]
    assert r["final"] < r["merge_val"], f"{arm}: the G-phase should improve on the merged model"
  for arm in ("disco", "disco_random"):
    spec = np.array(rec["arms"][arm]["specialization"], dtype=float)
    assert spec.shape == (E, E)
  # the control partitions the same pool into clusters of the same sizes
  assert rec["random_sizes"] == rec["cluster_sizes"] and sum(rec["cluster_sizes"]) == result["config"]["pool"]
  assert md.tables(result) and len(md.findings(result)) == 5
  fig = md.plot(result)
  assert len(fig.axes) >= 3


def test_sizes_split_the_budget_exactly_or_refuse():
  n = md.sizes(md.Config())
  assert n == {"e2e": 300, "s": 60, "g": 60}
  with pytest.raises(md.DiscoError, match="multiple of 4"):
    md.sizes(md.Config(steps=301))
  with pytest.raises(md.DiscoError, match="g_frac"):
    md.sizes(md.Config(g_frac=0.0))


def test_kmeans_recovers_separated_blobs_of_unequal_size():
  rng = np.random.default_rng(0)
  centers = np.array([[0.0] * 5, [10.0] * 5, [-10.0, 10.0, -10.0, 10.0, 0.0]])
  truth = np.repeat([0, 1, 2], [7, 20, 43])
  x = centers[truth] + rng.normal(size=(len(truth), 5))
  labels, cent = md.kmeans(x, 3, seed=1)
  # the same partition up to renaming: each found cluster is exactly one true cluster
  pairs = set(zip(labels.tolist(), truth.tolist()))
  assert len(pairs) == 3 and len({a for a, _ in pairs}) == 3
  # Lloyd's fixed point: centroids are the means of their points, and every point sits at its nearest centroid
  np.testing.assert_allclose(cent, np.stack([x[labels == j].mean(0) for j in range(3)]), rtol=0, atol=1e-12)
  d2 = ((x[:, None] - cent[None]) ** 2).sum(-1)
  assert (labels == d2.argmin(1)).all()


def test_kmeans_refuses_more_clusters_than_points():
  with pytest.raises(md.DiscoError, match="k-means"):
    md.kmeans(np.zeros((3, 2)), 4)


def test_mean_pooled_is_the_mean_token_embedding():
  rng = np.random.default_rng(1)
  emb = rng.normal(size=(256, 8)).astype(np.float32)
  x = rng.integers(0, 256, size=(5, 11))
  want = np.stack([np.mean([emb[t].astype(np.float64) for t in row], 0) for row in x])
  np.testing.assert_allclose(md.mean_pooled(emb, x), want, rtol=1e-12, atol=1e-12)


def test_sampler_draws_only_its_rows_and_replays():
  pool = np.arange(40 * 5, dtype=np.int32).reshape(40, 5)
  rows = np.array([3, 7, 11])
  f = md.sampler(pool, rows, seed=0, stream=2, batch_size=16)
  x, y = f(4)
  assert x.shape == (16, 4) and y.shape == (16, 4)
  assert set(x[:, 0] // 5) <= set(rows.tolist()) and (y == x + 1).all()
  np.testing.assert_array_equal(f(4)[0], x)
  assert not np.array_equal(f(5)[0], x)


def test_specialization_gap_and_cluster_batches():
  L = np.full((3, 3), 2.0) - np.eye(3)
  assert md.specialization_gap(L) == pytest.approx(1.0)
  assert md.specialization_gap(np.full((3, 3), 2.0)) == pytest.approx(0.0)
  x = np.arange(12 * 2).reshape(12, 2)
  val = [(x[i:i + 4], x[i:i + 4] + 100) for i in range(0, 12, 4)]
  labels = np.array([0, 1, 0, 0, 2, 0, 1, 0, 0, 1, 1, 1])
  got = md.cluster_batches(val, labels, 3)
  assert [len(b) for b in got] == [1, 1, 0]  # 6 windows of cluster 0 -> one full batch of 4; 5 of 1 -> one; 1 of 2
  np.testing.assert_array_equal(got[0][0][0], x[[0, 2, 3, 5]])
  np.testing.assert_array_equal(got[1][0][1], x[[1, 6, 9, 10]] + 100)


def _config():
  return md.moe_config(md.Config())


def test_init_model_draws_the_models_distribution():
  c = _config()
  model = md.init_model(c, 3)
  _, params, _ = common.split(model)
  _, abstract, _ = common.split(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
  out_std = c.init_std / (2 * c.n_layers) ** 0.5
  for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, w = path[-1].key, np.asarray(w, np.float64)
    if "norm" in name:
      assert (w == 1).all(), name
      continue
    std = out_std if name in OUT_PROJECTIONS else c.init_std
    assert np.abs(w).max() <= 2 * std * (1 + 1e-6), name
    # a normal truncated at ±2σ has std 0.880σ; 1000+ draws put the sample std within 10% of it
    assert abs(w.std() / (0.8796 * std) - 1) < 0.1, (name, w.std(), std)
  assert not np.array_equal(np.asarray(model.embed_VD[...]), np.asarray(md.init_model(c, 4).embed_VD[...]))


def _perturbed(model, rng, keys):
  """A copy of `model` with N(0, 0.05²) added to the params whose name starts with one of `keys` (all: None)."""
  graphdef, params, buffers = common.split(model)
  noisy = jax.tree_util.tree_map_with_path(
      lambda p, w: jnp.asarray(np.asarray(w) + rng.normal(0, 0.05, w.shape), w.dtype)
      if keys is None or str(p[-1].key).startswith(keys) else w, params)
  return common.join(graphdef, noisy, buffers)


def test_submodel_holds_expert_e_and_the_shared_params():
  init = md.init_model(_config(), 0)
  _, moe, _ = common.split(init)
  for e in (0, 3):
    _, sub, _ = common.split(md.submodel(init, e))
    np.testing.assert_array_equal(sub["blocks"]["w_gate_DF"], moe["blocks"]["moe"]["w_gate_EDF"][:, e])
    np.testing.assert_array_equal(sub["blocks"]["w_up_DF"], moe["blocks"]["moe"]["w_up_EDF"][:, e])
    np.testing.assert_array_equal(sub["blocks"]["w_down_FD"], moe["blocks"]["moe"]["w_down_EFD"][:, e])
    np.testing.assert_array_equal(sub["embed_VD"], moe["embed_VD"])
    np.testing.assert_array_equal(sub["blocks"]["wq_DQ"], moe["blocks"]["wq_DQ"])


@pytest.mark.parametrize("weights", [None, [5, 1, 3, 1]])
def test_merge_averages_the_shared_params_and_stacks_the_experts(weights):
  init = md.init_model(_config(), 0)
  rng = np.random.default_rng(2)
  subs = [_perturbed(md.submodel(init, e), rng, None) for e in range(4)]  # every param differs between submodels
  merged = md.merge(subs, init, weights)
  _, got, _ = common.split(merged)
  sp = [common.split(s)[1] for s in subs]
  w = np.full(4, 0.25) if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
  ref = lambda *xs: sum(wi * np.asarray(x, np.float64) for wi, x in zip(w, xs))
  np.testing.assert_allclose(got["embed_VD"], ref(*[p["embed_VD"] for p in sp]), rtol=1e-6, atol=1e-7)
  for k in ("wq_DQ", "wk_DK", "wv_DK", "wo_QD", "attn_norm", "mlp_norm", "q_norm", "k_norm"):
    np.testing.assert_allclose(got["blocks"][k], ref(*[p["blocks"][k] for p in sp]), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got["final_norm"], ref(*[p["final_norm"] for p in sp]), rtol=1e-6, atol=1e-7)
  for e in range(4):
    np.testing.assert_array_equal(got["blocks"]["moe"]["w_up_EDF"][:, e], sp[e]["blocks"]["w_up_DF"])
    np.testing.assert_array_equal(got["blocks"]["moe"]["w_down_EFD"][:, e], sp[e]["blocks"]["w_down_FD"])
  np.testing.assert_array_equal(got["blocks"]["moe"]["router_DE"], common.split(init)[1]["blocks"]["moe"]["router_DE"])
  with pytest.raises(md.DiscoError, match="one submodel per expert"):
    md.merge(subs[:3], init)
  with pytest.raises(md.DiscoError, match="weights"):
    md.merge(subs, init, [1, 1, -1, 1])


def test_merged_moe_routed_to_expert_e_is_submodel_e():
  """With every token forced to expert e (top-1, renormalised gate 1, the selection bias of expert e huge) the merged
  MoE's logits are submodel e's: in every layer the FFN applied to the same hidden state is submodel e's FFN (the
  submodels share one backbone here, so its average is that backbone)."""
  c = _config()
  E = c.moe.num_experts
  init = md.init_model(c, 0)
  rng = np.random.default_rng(3)
  # the submodels share the backbone (so the average is that backbone) but their experts move away from the init
  subs = [_perturbed(md.submodel(init, e), rng, ("w_gate", "w_up", "w_down")) for e in range(E)]
  graphdef_m, params_m, _ = common.split(md.merge(subs, init))
  forced_c = dataclasses.replace(c, moe=dataclasses.replace(c.moe, top_k=1, bias_rate=1.0, capacity_factor=float(E)))
  graphdef_f, _, buffers_f = common.split(nnx.eval_shape(lambda: Transformer(forced_c, rngs=nnx.Rngs(0))))
  assert graphdef_f != graphdef_m
  x = np.random.default_rng(4).integers(0, 256, size=(2, 16)).astype(np.int32)
  forward = lambda g: (lambda p, b, x: common.join(g, p, b)(x))
  bias = lambda e: {"blocks": {"moe": {"router_bias": jnp.asarray(np.where(np.arange(E) == e, 1e6, 0.0) * np.ones(
      (c.n_layers, 1)), jnp.float32)}}}
  moe_fn = jax.jit(forward(graphdef_f)).lower(params_m, bias(0), x).compile(O0)
  g_sub, p_sub0, _ = common.split(subs[0])
  dense_fn = jax.jit(forward(g_sub)).lower(p_sub0, {}, x).compile(O0)
  outs = []
  for e in range(E):
    got = np.asarray(moe_fn(params_m, bias(e), x))
    want = np.asarray(dense_fn(common.split(subs[e])[1], {}, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    outs.append(want)
  assert min(np.abs(outs[0] - o).max() for o in outs[1:]) > 1e-3, "the experts should compute different functions"
  assert jax.tree.structure(buffers_f) == jax.tree.structure(bias(0))




def test_pretrained_smoke_starts_every_arm_from_the_upcycled_dense_model(tmp_path):
  """--init pretrained: a dense model trained by the train CLI, upcycled per seed; the run directory is reused."""
  cfg = md.Config(smoke=True, init="pretrained")
  result = md.main(cfg)
  start = result["start"]
  assert start["dense_val"] < math.log(256)  # the dense model learned something before the arms start
  assert set(start["upcycled_val"]) == set(result["seeds"])
  (rec,) = result["seeds"].values()
  assert set(rec["arms"]) == set(md.ARMS) and all(math.isfinite(r["final"]) for r in rec["arms"].values())
  assert any(line.startswith("Start (every arm") for line in md.tables(result))
  assert "starting from the same pretrained model" in md.findings(result)[-1]
  assert md.out_dir(cfg) == "research/results/moe_disco_pretrained"
  # written, then re-rendered from its results.json alone: the same tables and command, a note of the re-render
  md.write(dataclasses.replace(cfg, out=str(tmp_path)), result, cmd="python -m x --init pretrained")
  first = (tmp_path / "results.md").read_text()
  again = md.main(md.Config(out=str(tmp_path), init="pretrained", render=True))
  second = (tmp_path / "results.md").read_text()
  assert md.tables(again)[:-1] == md.tables(result)[:-1] and "re-rendered" in second
  assert first.split("\n")[4] == second.split("\n")[4]  # the command kept
  assert (tmp_path / "val_loss.png").exists()


def test_upcycled_dense_is_the_experiments_moe():
  cfg = md.Config()
  dense = Transformer(dataclasses.replace(md.moe_config(cfg), moe=None, d_ff=cfg.num_experts * cfg.d_expert),
                      rngs=nnx.Rngs(0))
  moe = md.upcycled(dense, cfg, seed=1)
  assert moe.c.moe == md.moe_config(cfg).moe
  d, m = common.split(dense)[1]["blocks"], common.split(moe)[1]["blocks"]["moe"]
  up_LEDF = np.asarray(m["w_up_EDF"])  # every dense neuron lands in exactly one expert
  cols = np.sort(np.asarray(d["w_up_DF"]).transpose(0, 2, 1).reshape(len(up_LEDF), -1), axis=1)
  assert np.array_equal(np.sort(up_LEDF.transpose(0, 1, 3, 2).reshape(len(up_LEDF), -1), axis=1), cols)
  narrow = Transformer(dataclasses.replace(dense.c, d_ff=cfg.num_experts * cfg.d_expert // 2), rngs=nnx.Rngs(0))
  with pytest.raises(md.DiscoError, match="is not the experiment's"):  # experts of width F/2, not F
    md.upcycled(narrow, cfg, seed=1)
