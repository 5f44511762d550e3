"""The same model and batch give the same logits and gradients on 1 device and on 8."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
import sharding

CFG = models.preset("tiny", tie_embeddings=False)
TOKENS = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)


def model_fn():
  return models.Transformer(CFG, rngs=nnx.Rngs(0))


def logits_and_grads(mesh):
  graphdef, params, p_sh = sharding.init_params(model_fn, mesh)

  def loss(p, x):
    logits = nnx.merge(graphdef, p)(x[:, :-1])
    return models.cross_entropy(logits, x[:, 1:]), logits

  with jax.set_mesh(mesh):
    x = sharding.shard_batch(TOKENS, mesh)
    f = jax.jit(jax.grad(loss, has_aux=True), out_shardings=(p_sh, None))
    grads, logits = f(params, x)
  return params, grads, logits


@pytest.fixture(scope="module")
def reference():
  return logits_and_grads(sharding.make_mesh("data=1", devices=jax.devices()[:1]))


EXPECTED = {  # intended parameter specs per mesh (blocks carry a leading, unsplit `layers` axis)
    "data=8": {"wq_DQ": P(), "w_down_FD": P(), "embed_VD": P()},
    "fsdp=8": {"wq_DQ": P(None, "fsdp"), "w_down_FD": P(None, None, "fsdp"), "embed_VD": P(None, "fsdp"),
               "head_DV": P("fsdp")},
    "data=2,fsdp=2,tensor=2": {"wq_DQ": P(None, "fsdp", "tensor"), "wo_QD": P(None, "tensor", "fsdp"),
                               "w_down_FD": P(None, "tensor", "fsdp"), "embed_VD": P("tensor", "fsdp"),
                               "head_DV": P("fsdp", "tensor")},
    "fsdp=4,tensor=2": {"wk_DK": P(None, "fsdp", "tensor"), "w_gate_DF": P(None, "fsdp", "tensor"),
                        "embed_VD": P("tensor", "fsdp"), "attn_norm": P()},
}


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_sharded_matches_one_device(spec, reference, capfd):
  mesh = sharding.make_mesh(spec)
  params, grads, logits = logits_and_grads(mesh)
  _, ref_grads, ref_logits = reference

  flat = {path[-1].key: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  for name, spec_ in EXPECTED[spec].items():
    assert flat[name].sharding.spec == spec_, (name, flat[name].sharding.spec)
  for leaf, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads)):
    assert g.sharding.is_equivalent_to(leaf.sharding, leaf.ndim)  # gradients come back in the params' layout

  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               grads, ref_grads)
  # a layout GSPMD cannot reach makes it replicate whole tensors; that is a sharding bug, not a warning
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_batch_split_over_data_axes_and_indivisible_batch_refused():
  mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
  x = sharding.shard_batch(TOKENS, mesh)
  assert x.sharding.spec == P(("data", "fsdp"))
  assert x.addressable_shards[0].data.shape == (2, 33)
  with pytest.raises(sharding.ShardingError, match="size 6.*does not divide"):
    sharding.shard_batch(TOKENS[:6], mesh)


def test_optimizer_state_takes_the_parameter_sharding():
  import optax
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  _, state, shardings = sharding.init_train_state(model_fn, optax.adamw(1e-3), mesh)
  adam = state["opt_state"][0]
  jax.tree.map(lambda m, p: m.sharding.is_equivalent_to(p.sharding, p.ndim) or pytest.fail("mu not like params"),
               adam.mu, state["params"])
  assert adam.count.sharding.spec == P()
