"""Per-layer statistics (optim.diagnostics.layers): float64 NumPy oracles per layer and per expert on a transformer-
shaped tree, and the same numbers from leaves sharded over 8 devices as from one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from optim.diagnostics.layers import STATS, histograms, kept_axes, relative_update, tree_stats

L, E, D, F, V = 2, 4, 8, 12, 16
AXES = {"blocks": {"w_up_DF": ("layers", "embed", "mlp"), "w_moe_EDF": ("layers", "expert", "embed", "mlp")},
        "embed_VD": ("vocab", "embed"), "norm_D": ("embed",), "empty": None}
SPECS = {"blocks": {"w_up_DF": P(None, "fsdp", "tensor"), "w_moe_EDF": P(None, "data", "fsdp", "tensor")},
         "embed_VD": P("tensor", "fsdp"), "norm_D": P("fsdp"), "empty": None}


def make_tree(rng: np.random.Generator, dtype=np.float64) -> dict:
  """Magnitudes spread over 10^-10 .. 10^4 (past both ends of the default histogram), a few exact zeros."""
  def leaf(*shape):
    x = rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(-10, 4, shape) * rng.uniform(0.5, 1.5, shape)
    x.flat[::7] = 0.0
    return x.astype(dtype)
  return {"blocks": {"w_up_DF": leaf(L, D, F), "w_moe_EDF": leaf(L, E, D, F)}, "embed_VD": leaf(V, D),
          "norm_D": leaf(D), "empty": None}


def diagnose(updates, params):
  return (tree_stats(params, AXES, stats=STATS), relative_update(updates, params, AXES),
          histograms(updates, bins=20, lo=-9.0, hi=3.0), tree_stats(params)["blocks/w_moe_EDF"]["norm"])


# ---- NumPy oracles, from the definitions; per layer and expert by explicit loops ----------------------------------


def leaf(tree: dict, name: str) -> np.ndarray:
  for key in name.split("/"):
    tree = tree[key]
  return tree


def np_stats(x: np.ndarray) -> dict:
  return {"rms": np.sqrt(np.mean(x ** 2)), "norm": np.sqrt(np.sum(x ** 2)), "mean": np.mean(x),
          "std": np.sqrt(np.mean((x - np.mean(x)) ** 2)), "abs_mean": np.mean(np.abs(x)), "max_abs": np.max(np.abs(x))}


def per_index(x: np.ndarray, kept: int, f) -> np.ndarray:
  """f of each x[i] (kept=1) or x[i, j] (kept=2), or of the whole x (kept=0)."""
  if kept == 0:
    return np.asarray(f(x))
  return np.stack([per_index(x[i], kept - 1, f) for i in range(x.shape[0])])


def np_histogram(x: np.ndarray, bins: int, lo: float, hi: float) -> np.ndarray:
  with np.errstate(divide="ignore"):
    logs = np.clip(np.log10(np.abs(x)), lo, hi)  # zeros: -inf, clipped into the first bin
  return np.histogram(logs, bins=bins, range=(lo, hi))[0]


@pytest.mark.parametrize("names, kept", [(("layers", "embed", "heads"), 1), (("layers", "expert", "embed", "mlp"), 2),
                                         (("embed", "vocab"), 0), (None, 0), (("expert", "layers", "embed"), 2),
                                         (("embed", "layers"), 0), ((), 0)])
def test_kept_axes(names, kept):
  assert kept_axes(names) == kept


def test_kept_axes_custom_split():
  assert kept_axes(("layers", "expert", "embed"), split=("layers",)) == 1


def test_stats_relative_update_and_histograms_match_numpy_in_float64():
  rng = np.random.default_rng(0)
  params, updates = make_tree(rng), make_tree(rng)
  params["norm_D"][:] = 0.0  # W = 0: ‖ΔW‖ / eps, large and finite
  params["blocks"]["w_up_DF"][1] = 0.0  # W = 0 and ΔW = 0 in layer 1: 0
  updates["blocks"]["w_up_DF"][1] = 0.0
  with jax.enable_x64(True):
    stats, rel, hist, unsplit = jax.jit(diagnose)(updates, params)
  assert set(stats) == set(rel) == set(hist) == {"blocks/w_up_DF", "blocks/w_moe_EDF", "embed_VD", "norm_D"}
  for name, kept in [("blocks/w_up_DF", 1), ("blocks/w_moe_EDF", 2), ("embed_VD", 0), ("norm_D", 0)]:
    w, u = leaf(params, name), leaf(updates, name)
    assert set(stats[name]) == set(STATS)
    for s in STATS:
      want = per_index(w, kept, lambda x, s=s: np_stats(x)[s])
      assert stats[name][s].shape == want.shape and stats[name][s].dtype == jnp.float64
      np.testing.assert_allclose(stats[name][s], want, rtol=1e-12, atol=0, err_msg=f"{name} {s}")
    unorm, wnorm = per_index(u, kept, np.linalg.norm), per_index(w, kept, np.linalg.norm)
    want = unorm / np.where(wnorm > 0, wnorm, 1e-30)
    np.testing.assert_allclose(rel[name], want, rtol=1e-12, atol=0, err_msg=name)
    assert hist[name].dtype == jnp.int32 and hist[name].shape == (20,)
    np.testing.assert_array_equal(hist[name], np_histogram(u, 20, -9.0, 3.0), err_msg=name)
  assert float(rel["blocks/w_up_DF"][1]) == 0.0 and 1e25 < float(rel["norm_D"]) < np.inf
  assert hist["embed_VD"][0] >= (V * D) // 7 and hist["embed_VD"][-1] > 0  # zeros, and values past 10^3
  np.testing.assert_allclose(unsplit, np.linalg.norm(params["blocks"]["w_moe_EDF"]), rtol=1e-12)


def test_histogram_leaves_out_nans_and_counts_infinities_last():
  x = jnp.asarray([0.0, jnp.nan, -jnp.inf, 10 ** -2.85, 500.0, jnp.nan, 1e-12], jnp.bfloat16)
  counts = np.asarray(jax.jit(histograms)({"x": x})["x"])
  want = np.zeros(32, int)
  want[0] = 2  # 0 and 1e-12: below 10^-8
  want[31] = 2  # -inf and 500: above 10^2
  want[16] = 1  # log10 = -2.85: bins of width 10/32 from -8, bin 16 = [-3, -2.6875)
  np.testing.assert_array_equal(counts, want)


def test_unknown_statistic_and_missing_axes_raise():
  tree = {"a": jnp.ones((2, 3)), "b": jnp.ones(3)}
  with pytest.raises(ValueError, match="unknown statistics"):
    tree_stats(tree, stats=("rms", "median"))
  with pytest.raises(ValueError, match="no names for b"):
    tree_stats(tree, {"a": ("layers", "embed")})
  with pytest.raises(ValueError, match="params have no leaf b"):
    relative_update(tree, {"a": jnp.ones((2, 3))})


def test_sharded_equals_one_device():
  """float32 (and a bfloat16 leaf, upcast) on one device and with the leaves sharded over a (2, 2, 2) Explicit mesh."""
  rng = np.random.default_rng(1)
  params, updates = make_tree(rng, np.float32), make_tree(rng, np.float32)
  params["blocks"]["w_moe_EDF"] = params["blocks"]["w_moe_EDF"].astype(jnp.bfloat16)
  step = jax.jit(diagnose)
  one = step(updates, params)
  mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2", explicit=True)
  put = lambda tree: jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, SPECS)
  with jax.set_mesh(mesh):
    sharded_updates, sharded_params = put(updates), put(params)
    assert sharded_params["blocks"]["w_moe_EDF"].sharding.spec == P(None, "data", "fsdp", "tensor")
    many = step(sharded_updates, sharded_params)
  assert one[0]["blocks/w_moe_EDF"]["rms"].dtype == jnp.float32
  np.testing.assert_allclose(one[0]["blocks/w_moe_EDF"]["norm"],
                             per_index(np.asarray(params["blocks"]["w_moe_EDF"], np.float64), 2, np.linalg.norm),
                             rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=0), one, many)
