"""research/experiments/badam.py: the smoke run (structure, learning, bytes as the formula says), the bytes formula
against measured state trees of other shapes, the frozen-head loss floor against the model's own logits, and the lr
choice and paired summary on hand-made rows."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer, count_params, preset
from research.experiments import badam, common


@pytest.fixture(scope="module")
def result(notebooks):
  """`badam.main(badam.Config(smoke=True))`, as notebooks/badam.ipynb ran it."""
  return notebooks.run("badam").result


def test_smoke_runs_the_protocol(result):
  smoke = badam.Config(**badam.SMOKE)
  names = result["settings"]["labels"]
  assert {(r["label"], r["lr"], r["seed"]) for r in result["tuning"]} == {
      (label, lr, smoke.seeds[0]) for label in names.values() for lr in smoke.lrs}
  assert sorted((r["label"], r["lr"], r["seed"]) for r in result["runs"]) == sorted(
      (names[k], result["best_lr"][k], s) for k in ("adamw", "badam") for s in smoke.seeds)
  for r in result["tuning"] + result["runs"]:  # every run learns: finite, falling, ends below a uniform byte (ln 256)
    assert not r["diverged"], r["label"]
    vals = [v for _, v in r["curve"]]
    assert [s for s, _ in r["curve"]] == [smoke.eval_every, smoke.steps]
    assert all(map(math.isfinite, vals)) and vals[-1] < min(vals[0], math.log(256)), (r["label"], vals)
    assert r["tokens_per_s"] > 0
  s = result["summary"]
  assert s["adamw"]["finals"] == [r["final_val_loss"] for r in result["runs"] if r["label"] == names["adamw"]]
  assert s["badam"]["diffs"] == pytest.approx([b - a for a, b in zip(s["adamw"]["finals"], s["badam"]["finals"])])


def test_smoke_state_bytes_are_the_formula(result):
  rows = result["bytes"]
  assert [r["model"] for r in rows] == ["tiny, 3 layers (trained)", "small"]
  for r in rows:
    for k in ("adamw", "badam", "badam_ref"):
      assert r[k] == r[f"{k}_expected"], (r["model"], k)
    assert r["badam_ref"] < r["badam"] < r["adamw"]
    assert r["badam_ratio"] == r["badam"] / r["adamw"]
  small = rows[1]  # the numbers research/results/badam_state_bytes.md measured independently (+ 4 bytes: the schedule)
  assert (small["adamw"], small["badam_ref"]) == (27_805_704, 6_819_856)
  assert small["badam"] - small["badam_ref"] == 8 * (256 * 256 + 256)  # the embedding's and final norm's m, v


def test_smoke_floor_holds_and_outputs_render(result, tmp_path):
  ref = result["badam_ref"]
  assert ref["best"]["final_val_loss"] >= ref["loss_floor"] > 0
  fig = badam.plot(result)
  assert len(fig.axes) == 2 and fig.axes[0].lines
  lr_png = tmp_path / "lr_in.png"
  fig.savefig(lr_png)
  badam.write(badam.Config(out=str(tmp_path / "out")), result, str(lr_png))
  md = (tmp_path / "out" / "results.md").read_text()
  assert "≠ formula" not in md and "Reading:" in md and f"{result['bytes'][0]['adamw']:,}" in md
  assert {p.name for p in (tmp_path / "out").iterdir()} == {"results.md", "results.json", "badam.png", "lr.png"}


@pytest.mark.parametrize("overrides", [dict(n_layers=2), dict(n_layers=3, n_kv_heads=4, qk_norm=False, d_ff=96)])
def test_state_bytes_formula_against_state_trees(overrides):
  c = preset("tiny", **overrides)
  params = jax.eval_shape(lambda: common.split(Transformer(c, rngs=nnx.Rngs(0)))[1])
  per_layer = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(params["blocks"]))
  assert badam.layer_params(c) == per_layer and count_params(c) == c.n_layers * per_layer + 256 * 64 + 64
  for opt, hp, kw in [("adamw", {}, {}), ("badam", {}, {}),
                      ("badam", badam.BADAM_HP, dict(train_embedding=True, train_final_norm=True)),
                      ("badam", {"always_active": ("final_norm",)}, dict(train_final_norm=True))]:
    assert badam.state_bytes(c, opt, **hp) == badam.analytic_state_bytes(c, opt, **kw), (opt, hp)


def test_frozen_head_floor_bounds_the_models_logits():
  c = preset("tiny", n_layers=2)
  model = Transformer(c, rngs=nnx.Rngs(3))
  model.final_norm[...] = jnp.linspace(0.5, 1.5, c.d_model)  # a non-trivial frozen scale
  params = common.split(model)[1]
  bound, floor = badam.frozen_head_floor(params, c)
  e_VD, g_D = np.asarray(params["embed_VD"], np.float64), np.asarray(params["final_norm"], np.float64)
  # any residual stream, however large, gives logits within ±bound
  x_BTD = 50.0 * jax.random.normal(jax.random.key(0), (2, 5, c.d_model))
  assert float(jnp.abs(model.unembed(x_BTD)).max()) <= bound * (1 + 1e-5)
  # and the bound is attained by x ∝ g ⊙ e_v for the row with the largest ‖g ⊙ e_v‖ (scaled up: RMSNorm's eps)
  v = int(np.argmax(np.linalg.norm(e_VD * g_D, axis=1)))
  logits = np.asarray(model.unembed(jnp.asarray(100 * g_D * e_VD[v], jnp.float32)[None, None]))[0, 0]
  assert logits[v] == pytest.approx(bound, rel=1e-4)
  # floor: the cross entropy of the best case, target at +bound and the other 255 at -bound
  best = np.full(c.vocab_size, -bound)
  best[0] = bound
  assert floor == pytest.approx(-(best[0] - np.log(np.exp(best).sum())), rel=1e-9)


def test_embedding_turns_follow_the_reference_switch_timing():
  # K = 8, 7 blocks, descending from block 6: the j-th switch happens after update 8(j+1) − 1 (the first block runs
  # K − 1 updates), block 0 is active for j ≡ 6 (mod 7), i.e. updates 8·6 .. 8·7 − 1 = 48 .. 55, then every 56
  assert badam.embedding_turns(7, 8, 200) == [(48, 55), (104, 111), (160, 167)]
  assert badam.embedding_turns(3, 1, 7) == [(3, 3), (6, 6)]  # K = 1: a new block every update, 2, 1, 0, 2, 1, 0, 2


def _row(label, lr, seed, final, diverged=False, curve=None):
  return {"label": label, "lr": lr, "seed": seed, "final_val_loss": math.inf if diverged else final,
          "tokens_per_s": 100.0 + seed, "diverged": diverged, "curve": curve or [(5, final + 1), (10, final)]}


def test_best_lr_takes_the_lowest_seed_mean_and_never_a_diverged_lr():
  rows = [_row("a", 1e-3, 0, 2.0), _row("a", 1e-3, 1, 2.4), _row("a", 3e-3, 0, 2.1), _row("a", 3e-3, 1, 2.2),
          _row("b", 1e-2, 0, 0.0, diverged=True), _row("b", 3e-3, 0, 4.0)]
  assert badam.best_lr(rows) == {"a": 3e-3, "b": 3e-3}


def test_summary_pairs_seeds_against_adamw():
  a, b = [2.0, 2.2, 2.1], [2.5, 2.6, 2.9]
  rows = [_row("A", 1e-2, s, f) for s, f in enumerate(a)] + [_row("B", 3e-2, s, f) for s, f in enumerate(b)]
  s = badam.summarize(rows, {"adamw": "A", "badam": "B"})
  d = np.subtract(b, a)
  assert s["badam"]["diffs"] == pytest.approx(d)
  assert (s["badam"]["diff_mean"], s["badam"]["diff_std"]) == pytest.approx((d.mean(), d.std(ddof=1)))
  assert s["badam"]["diff_t"] == pytest.approx(d.mean() / (d.std(ddof=1) / np.sqrt(3)))
  assert (s["adamw"]["final_mean"], s["adamw"]["final_std"]) == pytest.approx((np.mean(a), np.std(a, ddof=1)))
  assert s["adamw"]["curve_min"] == pytest.approx([3.0, 2.0]) and s["adamw"]["curve_max"] == pytest.approx([3.2, 2.2])
  assert s["badam"]["lr"] == 3e-2 and s["badam"]["tokens_per_s"] == pytest.approx(101.0)


@pytest.mark.parametrize("bad, match", [(dict(n_layers=1), "n-layers"), (dict(lrs=()), "at least one"),
                                        (dict(switch_every=0), "switch-every")])
def test_bad_configs_raise(bad, match):
  with pytest.raises(badam.BAdamExperimentError, match=match):
    badam.main(dataclasses.replace(badam.Config(), **bad))


def test_formula_refuses_what_it_does_not_cover():
  with pytest.raises(badam.BAdamExperimentError, match="tied"):
    badam.layer_params(preset("tiny", tie_embeddings=False))
  with pytest.raises(badam.BAdamExperimentError, match="no bytes formula"):
    badam.analytic_state_bytes(preset("tiny"), "sgd")
