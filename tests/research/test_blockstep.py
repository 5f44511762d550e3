"""The blockwise BAdam step (research/train/steps/blockstep.py) equals optim.badam_adamw with full backprop (the
trainer's step before it), update for update across block switches, and its BREAD-SGD form optim.bread_adamw(mode="sgd")
(whose update is tested against a float64 reference of the equations in tests/optim/test_bread.py); with bfloat16
storage only the active layer moves."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer
from research.bench.timing import trainer_optimizer, trainer_plan
from research.train import TrainConfig, make_steps
from research.train.setup.blockwise import eligible
from research.train.setup.build import optimizer_needs
from research.train.steps import train_state
from research.train.steps.blockstep import Parts, init_state, make_block_steps
from sharding import batch_sharding, devices_for, make_mesh

B, T, L = 4, 16, 3


def setup(model, mesh_spec, optimizer="badam", opt=(), **kw):
  # eps 1e-3: Adam's m/(√v + eps) divides by |g| where |g| >> eps, so an entry whose gradient is ~1e-8 turns the two
  # backward passes' float32 rounding (~1e-6 relative) into a visible update difference (seen: 1 entry of 12,288 off
  # by 1% of a step at eps 1e-8); with eps above the gradients' rounding both steps are well conditioned.
  cfg = TrainConfig(model=model, n_layers=L, optimizer=optimizer,
                    opt=("switch_every=2", "order=\"ascending\"", "eps=1e-3", *opt),
                    **{"grad_clip": 0.0, "batch_size": B, "seq_len": T, "mesh": mesh_spec, "steps": 50,
                       "warmup_steps": 2, "lr": 3e-3, **kw})
  mesh = make_mesh(mesh_spec, devices=devices_for(mesh_spec))
  tx, schedule = trainer_optimizer(cfg)
  mcfg = trainer_plan(cfg, mesh=mesh).model
  graphdef, state, shardings = train_state.create(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)), tx, mesh)
  return cfg, mesh, tx, schedule, graphdef, state, shardings, batch_sharding(mesh, (B, T))


def _eligible(cfg, mesh):
  plan = trainer_plan(cfg, mesh=mesh)
  return eligible(plan.needs, plan.features)


def batches(n, vocab=256):
  rng = np.random.default_rng(0)
  return [tuple(rng.integers(0, vocab, (B, T), dtype=np.int32) for _ in range(2)) for _ in range(n)]


BREAD_SGD = ("mode=\"sgd\"", "inactive_lr_ratio=0.5")
BREAD_LOWRANK = ("rank=2", "alpha=4.0", "inactive_lr_ratio=0.5")


@pytest.mark.parametrize("model,mesh_spec,optimizer,opt", [
    ("tiny", "data=1", "badam", ()), ("tiny", "data=2,fsdp=2,tensor=2", "badam", ()),
    ("moe_tiny", "data=1", "badam", ()), ("tiny", "data=1", "bread", BREAD_SGD),
    ("tiny", "data=2,fsdp=2,tensor=2", "bread", (*BREAD_SGD, "sgd_sign=true")),
    ("moe_tiny", "data=1", "bread", BREAD_SGD), ("tiny", "data=2,fsdp=2,tensor=2", "bread", BREAD_LOWRANK),
    ("moe_tiny", "data=1", "bread", BREAD_LOWRANK)])
def test_blockwise_badam_equals_full_backprop_badam(model, mesh_spec, optimizer, opt):
  """BREAD-SGD: the layers above the active one step by ρ·lr·g (sign(g)) inside the layer-by-layer backward; BREAD
  low-rank: their factors' gradients, AdamW steps and merges are taken in it, layer by layer, from the same initial
  factors as optim.bread's."""
  cfg, mesh, tx, schedule, graphdef, state, shardings, batch_sh = setup(model, mesh_spec, optimizer, opt)
  assert _eligible(cfg, mesh) is None
  copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=shardings)
  full_state = copy(state)
  full, _ = make_steps(graphdef, tx, shardings, batch_sh)
  parts = Parts(schedule, optimizer_needs(cfg.optim).blockwise, L, cfg.optim.grad_clip, optimizer)
  block_state, block_sh = init_state(copy(state), shardings, parts, jnp.float32)
  block, _ = make_block_steps(graphdef, parts, block_sh, batch_sh)
  blocks_seen = []
  with jax.set_mesh(mesh):
    for x, y in batches(7):  # switch_every 2: the first block runs 1 update, then 2 each: blocks 0, 1, 1, 2, 2, 0, 0
      x, y = jax.device_put(x, batch_sh), jax.device_put(y, batch_sh)
      blocks_seen.append(int(block_state.opt_state["block"]))
      full_state, a = full(full_state, x, y)
      block_state, b = block(block_state, x, y)
      np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-6)
      for (path, pa), pb in zip(jax.tree_util.tree_flatten_with_path(full_state.params)[0],
                                jax.tree.leaves(block_state.params)):
        np.testing.assert_allclose(pb, pa, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  assert blocks_seen == [0, 1, 1, 2, 2, 0, 0]


def test_bfloat16_storage_moves_only_the_active_layer():
  cfg, mesh, tx, schedule, graphdef, state, shardings, batch_sh = setup("tiny", "data=1", warmup_steps=0)
  parts = Parts(schedule, optimizer_needs(cfg.optim).blockwise, L, 1.0, cfg.optim.optimizer)
  block_state, block_sh = init_state(state, shardings, parts, jnp.bfloat16)
  before = jax.tree.map(np.asarray, block_state.params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(block_state.params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(block_state.master))
  block, _ = make_block_steps(graphdef, parts, block_sh, batch_sh)
  with jax.set_mesh(mesh):
    x, y = (jax.device_put(a, batch_sh) for a in batches(1)[0])
    block_state, out = block(block_state, x, y)  # update 1 trains block 0, then switches to block 1
  after = block_state.params
  assert np.isfinite(out["loss"]) and int(block_state.opt_state["block"]) == 1
  np.testing.assert_array_equal(after["embed_VD"], before["embed_VD"])
  assert not np.array_equal(after["blocks"]["wq_DQ"][0], before["blocks"]["wq_DQ"][0])
  np.testing.assert_array_equal(after["blocks"]["wq_DQ"][1:], before["blocks"]["wq_DQ"][1:])
  np.testing.assert_array_equal(block_state.master["wq_DQ"], np.asarray(after["blocks"]["wq_DQ"][1], np.float32))


def test_settings_the_blockwise_step_does_not_run_are_named():
  cfg, mesh, *_ = setup("tiny", "data=1")
  with_embedding = dataclasses.replace(cfg, opt=("include_embedding=true",))
  assert _eligible(with_embedding, mesh) == "--opt include_embedding=True"
  c = TrainConfig(model="tiny", optimizer="badam", freeze="embed")
  assert _eligible(c, mesh) == "--freeze"
  assert _eligible(TrainConfig(model="tiny"), mesh) == "not blockwise"
  bread = TrainConfig(model="tiny", optimizer="bread")
  assert _eligible(dataclasses.replace(bread, opt=("reach=\"all\"",)), mesh).startswith("--opt reach=all")  # optax's
  assert _eligible(dataclasses.replace(bread, opt=("mode=\"sgd\"",)), mesh) is None and _eligible(bread, mesh) is None


@pytest.mark.parametrize("opt", [BREAD_SGD, BREAD_LOWRANK])
def test_bread_moves_the_layers_above_the_active_one_and_none_below(opt):
  """bfloat16 storage, start at the middle layer: it and the layer above move, the layer below and the embedding keep
  every bit (no gradient below the active layer exists in the layer-by-layer backward)."""
  cfg, mesh, tx, schedule, graphdef, state, shardings, batch_sh = setup(
      "tiny", "data=1", "bread", (*opt, "start_block=1"), warmup_steps=0)
  parts = Parts(schedule, optimizer_needs(cfg.optim).blockwise, L, 1.0, cfg.optim.optimizer)
  block_state, block_sh = init_state(state, shardings, parts, jnp.bfloat16)
  before = jax.tree.map(np.asarray, block_state.params)
  block, _ = make_block_steps(graphdef, parts, block_sh, batch_sh)
  with jax.set_mesh(mesh):
    x, y = (jax.device_put(a, batch_sh) for a in batches(1)[0])
    block_state, out = block(block_state, x, y)
  after = block_state.params
  assert np.isfinite(out["loss"])
  np.testing.assert_array_equal(after["embed_VD"], before["embed_VD"])
  for name in ("wq_DQ", "w_up_DF"):
    np.testing.assert_array_equal(after["blocks"][name][0], before["blocks"][name][0])
    for layer in (1, 2):
      assert not np.array_equal(after["blocks"][name][layer], before["blocks"][name][layer]), (name, layer)
