"""--freeze-layers N (research/train/steps/layerfreeze.py): the same updates as full backprop with the frozen part's
updates masked (AdamW and Muon, dense and MoE, one device and a 3-axis mesh), the backward provably stopping at layer N
(its matmul FLOPs are full backprop's less exactly 2N layers' forwards), frozen layers keeping every bit in bfloat16
(and an MoE's frozen routing), exact resume, and the combinations it cannot run refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from refusals import bad

from models import Transformer
from research.bench.finetune import matmul_flops
from research.bench.timing import trainer_optimizer, trainer_plan
from research.train import RunError, TrainConfig, make_steps, run
from research.train.config import MoEFlags
from research.train.steps import train_state
from research.train.steps.layerfreeze import init_state, make_layer_steps
from sharding import batch_sharding, devices_for, make_mesh

B, T, L = 4, 16, 4


def _model(cfg, mesh):
  """The model the trainer builds for `cfg`, as a function (seed 0)."""
  return lambda: Transformer(trainer_plan(cfg, mesh=mesh).model, rngs=nnx.Rngs(0))


def setup(model="tiny", mesh_spec="data=1", optimizer="adamw", **kw):
  cfg = TrainConfig(model=model, n_layers=L, optimizer=optimizer, grad_clip=0.0, batch_size=B, seq_len=T,
                    mesh=mesh_spec, steps=50, warmup_steps=2, lr=3e-3, **kw)
  mesh = make_mesh(mesh_spec, devices=devices_for(mesh_spec))
  tx, _ = trainer_optimizer(cfg)
  graphdef, state, shardings = train_state.create(_model(cfg, mesh), tx, mesh)
  return cfg, mesh, tx, graphdef, state, shardings, batch_sharding(mesh, (B, T))


def masked(tx, n):
  """`tx` with the updates of layers 0..n-1 and the embedding set to zero: what --freeze-layers n trains."""
  def zero(updates):
    blocks = jax.tree.map(lambda u: u.at[:n].set(0), updates["blocks"])
    return {**updates, "blocks": blocks, "embed_VD": jnp.zeros_like(updates["embed_VD"])}
  return optax.chain(tx, optax.stateless(lambda u, p=None: zero(u)))


def batches(k, vocab=256):
  rng = np.random.default_rng(0)
  return [tuple(rng.integers(0, vocab, (B, T), dtype=np.int32) for _ in range(2)) for _ in range(k)]


@pytest.mark.parametrize("model,mesh_spec,optimizer", [
    ("tiny", "data=1", "muon"), ("tiny", "data=2,fsdp=2,tensor=2", "adamw"), ("moe_tiny", "data=1", "adamw")])
def test_updates_equal_full_backprop_with_the_frozen_part_masked(model, mesh_spec, optimizer):
  n = 2
  cfg, mesh, tx, graphdef, state, shardings, batch_sh = setup(model, mesh_spec, optimizer, freeze_layers=n)
  copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=shardings)
  ref_tx = masked(tx, n)
  _, ref_state, ref_sh = train_state.create(_model(cfg, mesh), ref_tx, mesh)
  full, _ = make_steps(graphdef, ref_tx, ref_sh, batch_sh)
  fl_state, fl_sh = init_state(copy(state), shardings, tx, None, n, jnp.float32)
  step, _ = make_layer_steps(graphdef, tx, fl_sh, batch_sh, n)
  before = jax.tree.map(np.asarray, fl_state.params)
  with jax.set_mesh(mesh):
    for x, y in batches(4):
      x, y = jax.device_put(x, batch_sh), jax.device_put(y, batch_sh)
      ref_state, a = full(ref_state, x, y)
      fl_state, b = step(fl_state, x, y)
      np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-6)
      for (path, pa), pb in zip(jax.tree_util.tree_flatten_with_path(ref_state.params)[0],
                                jax.tree.leaves(fl_state.params)):
        np.testing.assert_allclose(pb, pa, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  after = fl_state.params
  np.testing.assert_array_equal(after["embed_VD"], before["embed_VD"])
  np.testing.assert_array_equal(after["blocks"]["wq_DQ"][:n], before["blocks"]["wq_DQ"][:n])
  assert not np.array_equal(after["blocks"]["wq_DQ"][n:], before["blocks"]["wq_DQ"][n:])
  np.testing.assert_array_equal(fl_state.master["blocks"]["wq_DQ"], after["blocks"]["wq_DQ"][n:])


def step_flops(n_layers: int, freeze: int) -> float:
  """The matmul FLOPs of one train step (tiny, untied head, no remat): --freeze-layers `freeze`, or the plain step."""
  cfg = TrainConfig(model="tiny", n_layers=n_layers, batch_size=B, seq_len=T, mesh="data=1", steps=50,
                    freeze_layers=freeze, tie_embeddings=False)
  mesh = make_mesh("data=1", devices=devices_for("data=1"))
  tx, _ = trainer_optimizer(cfg)
  graphdef, state, shardings = train_state.create(_model(cfg, mesh), tx, mesh)
  batch_sh = batch_sharding(mesh, (B, T))
  if freeze:
    state, shardings = init_state(state, shardings, tx, None, freeze, jnp.float32)
    step = make_layer_steps(graphdef, tx, shardings, batch_sh, freeze)[0]
  else:
    step = make_steps(graphdef, tx, shardings, batch_sh)[0]
  x = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sh)
  with jax.set_mesh(mesh):
    return matmul_flops(step.trace(state, x, x).jaxpr.jaxpr)


def test_the_backward_stops_at_layer_n():
  """Full backprop costs 3 layer forwards per layer (forward, activation gradient, weight gradient); each frozen layer
  saves exactly its 2: no weight gradient and no activation gradient below layer N exists in the step."""
  layer = (step_flops(L, 0) - step_flops(L - 1, 0)) / 3  # one layer's forward
  assert layer > 0
  for n in (1, 2, 3):
    assert step_flops(L, n) == pytest.approx(step_flops(L, 0) - 2 * n * layer, rel=1e-9), n
  assert step_flops(L, L // 2) / step_flops(L, 0) <= 0.85  # the goal for half the layers


def test_bfloat16_storage_keeps_the_frozen_layers_bit_for_bit():
  n = 1
  cfg, mesh, tx, graphdef, state, shardings, batch_sh = setup(freeze_layers=n)
  fl_state, fl_sh = init_state(state, shardings, tx, "final_norm", n, jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(fl_state.params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fl_state.master))
  assert "final_norm" not in fl_state.master and "embed_VD" not in fl_state.master  # --freeze's regex too
  before = jax.tree.map(np.asarray, fl_state.params)
  step, _ = make_layer_steps(graphdef, tx, fl_sh, batch_sh, n)
  with jax.set_mesh(mesh):
    for x, y in batches(2):
      fl_state, out = step(fl_state, jax.device_put(x, batch_sh), jax.device_put(y, batch_sh))
      assert bool(out["finite"])
  after = fl_state.params
  for name in ("wq_DQ", "w_up_DF"):
    np.testing.assert_array_equal(after["blocks"][name][:n], before["blocks"][name][:n])
    assert not np.array_equal(after["blocks"][name][n:], before["blocks"][name][n:])
  np.testing.assert_array_equal(after["final_norm"], before["final_norm"])
  np.testing.assert_array_equal(after["blocks"]["wq_DQ"][n:],
                                np.asarray(fl_state.master["blocks"]["wq_DQ"]).astype(jnp.bfloat16))


def test_the_frozen_layers_routing_stays_fixed():
  """MoE with the aux-loss-free router bias: the frozen layers' bias rows keep every bit, the trained layers' move."""
  n = 1
  cfg, mesh, tx, graphdef, state, shardings, batch_sh = setup("moe_tiny", freeze_layers=n,
                                                                      moe=MoEFlags(bias_rate=1e-2))
  fl_state, fl_sh = init_state(state, shardings, tx, None, n, jnp.float32)
  before = jax.tree.map(np.asarray, fl_state.buffers)
  step, _ = make_layer_steps(graphdef, tx, fl_sh, batch_sh, n)
  with jax.set_mesh(mesh):
    for x, y in batches(3):
      fl_state, out = step(fl_state, jax.device_put(x, batch_sh), jax.device_put(y, batch_sh))
  for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(fl_state.buffers)):
    np.testing.assert_array_equal(new[:n], old[:n])
    assert not np.array_equal(new[n:], old[n:])


TINY = dict(model="tiny", steps=6, batch_size=8, seq_len=32, log_every=1, eval_every=3, ckpt_every=3,
            warmup_steps=1, eval_batches=1, progress=False, mesh="data=8", freeze_layers=1)


def test_a_run_resumes_exactly_and_records_the_split(tmp_path):
  trace = lambda rs: [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in rs]
  ref = run(TrainConfig(out=str(tmp_path / "ref"), **TINY))
  assert ref[-1]["val_loss"] < ref[0]["loss"]
  run(TrainConfig(out=str(tmp_path / "cut"), stop_at=3, **TINY))
  assert trace(run(TrainConfig(out=str(tmp_path / "cut"), **TINY))) == trace(ref)
  with pytest.raises(RunError, match=r"different model/optimizer \(frozen_layers"):
    run(TrainConfig(out=str(tmp_path / "cut"), **{**TINY, "freeze_layers": 0, "steps": 9}))


@pytest.mark.parametrize("args, message", [
    (["--freeze-layers", "2", "--n-layers", "2"], r"--freeze-layers 2: the model has 2 layers; freeze 1..1 of them"),
    (["--freeze-layers", "1", "--optimizer", "badam"], r"--freeze-layers does not combine with --optimizer badam"),
    (["--freeze-layers", "1", "--peft", "lora"], r"--freeze-layers does not combine with --peft"),
    (["--freeze-layers", "1", "--mesh", "stage=2,data=4"], r"--freeze-layers does not combine with a stage mesh"),
    (["--freeze-layers", "1", "--freeze", "blocks"], r"--freeze 'blocks' freezes every leaf of the layer stack"),
])
def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, capsys, args, message):
  import re
  assert re.search(message, bad(tmp_path, capsys, *args))
