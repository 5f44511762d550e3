"""--freeze is free: the train step differentiates the trained parameters only (no frozen weight's gradient in the
compiled program), updates them exactly as the full-gradient step did, and stores the frozen ones in --frozen-dtype."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer
from research.bench.timing import trainer_optimizer, trainer_plan
from research.train import TrainConfig, make_steps
from research.train.setup.build import step_options
from research.train.steps import frozen, train_state
from research.train.steps.step import value_and_grad_trained
from sharding import batch_sharding, devices_for, make_mesh

# tiny: D = 64 = N·H, K·H = 32, F = 128, V = 256. Batch 4 x 24 = 96 tokens: no activation is 64 x 64.
FREEZE = "blocks/(wq_DQ|wo_QD)|embed"  # the only (64, 64) weights, and the (256, 64) table
B, T = 4, 24


def _model(cfg, mesh):
  """The model the trainer builds for `cfg`, as a function (seed 0)."""
  return lambda: Transformer(trainer_plan(cfg, mesh=mesh).model, rngs=nnx.Rngs(0))


def _options(cfg, mesh):
  """`make_steps`' keyword arguments the trainer gives for `cfg`."""
  return step_options(trainer_plan(cfg, mesh=mesh))


def setup(mesh_spec="data=1", **kw):
  cfg = TrainConfig(model="tiny", freeze=FREEZE, grad_clip=0.0, batch_size=B, seq_len=T, mesh=mesh_spec, steps=20,
                    warmup_steps=0, lr=1e-2, **kw)
  mesh = make_mesh(mesh_spec, devices=devices_for(mesh_spec))
  tx, _ = trainer_optimizer(cfg)
  graphdef, state, shardings = train_state.create(_model(cfg, mesh), tx, mesh)
  return cfg, mesh, tx, graphdef, state, shardings, batch_sharding(mesh, (B, T))


def dot_shapes(compiled) -> set[tuple[int, ...]]:
  """The output shapes of every dot in a compiled program (fused computations included)."""
  return {tuple(int(d) for d in m.split(",")) for m in re.findall(r"= f32\[([\d,]+)\][^ ]* dot\(", compiled.as_text())}


def test_value_and_grad_trained_is_the_gradient_of_the_trained_leaves():
  params = {"a": jnp.arange(3.0), "b": {"c": jnp.ones((2, 2)), "d": jnp.full((2,), 2.0)}}
  loss = lambda p, s: (jnp.sum(p["a"] ** 2) * s + jnp.sum(p["b"]["c"] * p["b"]["d"]), ())  # noqa: E731
  (v0, _), g0 = jax.value_and_grad(loss, has_aux=True)(params, 3.0)
  (v1, _), g1 = value_and_grad_trained(loss, params, {"a": False, "b": {"c": True, "d": False}}, 3.0)
  assert v0 == v1
  np.testing.assert_array_equal(g1["a"], g0["a"])
  np.testing.assert_array_equal(g1["b"]["d"], g0["b"]["d"])
  np.testing.assert_array_equal(g1["b"]["c"], np.zeros((2, 2)))  # frozen: zeros, not its gradient (ones * 2)


@pytest.mark.parametrize("mesh_spec", ["data=1", "data=2,fsdp=2,tensor=2"])
def test_trained_parameters_update_as_with_full_backprop(mesh_spec):
  """Three AdamW steps of the freeze-aware step equal the full-gradient step (the implementation before: every
  gradient computed, the frozen ones discarded by optax.set_to_zero) for every parameter, to float32 rounding."""
  cfg, mesh, tx, graphdef, state, shardings, batch_sh = setup(mesh_spec)
  full, _ = make_steps(graphdef, tx, shardings, batch_sh)
  free, _ = make_steps(graphdef, tx, shardings, batch_sh, **_options(cfg, mesh))
  copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=shardings)
  a, b = copy(state), copy(state)
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    for _ in range(3):
      x, y = (jax.device_put(rng.integers(0, 256, (B, T), dtype=np.int32), batch_sh) for _ in range(2))
      a, out_a = full(a, x, y)
      b, out_b = free(b, x, y)
      np.testing.assert_allclose(out_b["loss"], out_a["loss"], rtol=1e-6)
  for (path, pa), pb in zip(jax.tree_util.tree_flatten_with_path(a.params)[0], jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(pb), np.asarray(pa), rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  np.testing.assert_array_equal(b.params["embed_VD"], state_before(cfg, mesh, tx).params["embed_VD"])
  assert not np.allclose(b.params["blocks"]["wk_DK"], state_before(cfg, mesh, tx).params["blocks"]["wk_DK"])


def state_before(cfg, mesh, tx):
  return train_state.create(_model(cfg, mesh), tx, mesh)[1]


def test_the_compiled_step_computes_no_frozen_weight_gradient():
  """No dot of the compiled step produces a frozen weight's per-layer shape, (64, 64) here; the full-gradient step
  has them (so the check can fail). The step's FLOPs (XLA's cost analysis) fall accordingly."""
  cfg, mesh, tx, graphdef, state, shardings, batch_sh = setup()
  x = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sh)
  with jax.set_mesh(mesh):
    full = make_steps(graphdef, tx, shardings, batch_sh)[0].lower(state, x, x).compile()
    free = make_steps(graphdef, tx, shardings, batch_sh, **_options(cfg, mesh))[0].lower(state, x, x).compile()
  assert (64, 64) in dot_shapes(full) and (256, 64) in dot_shapes(full)  # wq/wo and the tied table's gradients
  assert (64, 64) not in dot_shapes(free) and (256, 64) not in dot_shapes(free)
  assert (64, 32) in dot_shapes(free)  # wk/wv train: their gradients are still there
  # tiny, 96 tokens: 3 of the per-token weight-gradient dots gone of 2 layers' 7 + the head's
  assert free.cost_analysis()["flops"] < 0.9 * full.cost_analysis()["flops"]


def test_frozen_parameters_are_stored_in_the_frozen_dtype():
  cfg, mesh, tx, graphdef, state, shardings, batch_sh = setup()
  stored = frozen.store_frozen(state.params, shardings.params, cfg.trains.freeze, jnp.bfloat16)
  assert stored["embed_VD"].dtype == jnp.bfloat16 and stored["blocks"]["wq_DQ"].dtype == jnp.bfloat16
  assert stored["blocks"]["wk_DK"].dtype == jnp.float32 and stored["final_norm"].dtype == jnp.float32
  assert stored["embed_VD"].sharding == shardings.params["embed_VD"]
  step, _ = make_steps(graphdef, tx, shardings, batch_sh, **_options(cfg, mesh))
  expected = np.asarray(stored["embed_VD"])  # the step donates its input
  x = jax.device_put(np.zeros((B, T), np.int32), batch_sh)
  with jax.set_mesh(mesh):
    new, out = step(state.replace(params=stored), x, x)
  assert np.isfinite(out["loss"]) and new.params["embed_VD"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(new.params["embed_VD"], expected)
