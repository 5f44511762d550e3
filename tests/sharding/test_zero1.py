"""ZeRO-1: the optimizer state split over `data` on top of the parameters' sharding, the parameters replicated
there, and training steps equal to the run without it."""

import dataclasses

import jax
import numpy as np
import tyro
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import optim
import sharding
from research.train import TrainConfig, make_steps
from research.train.steps import train_state


def test_zero1_shardings_pick_the_first_dimension_that_divides():
  mesh = sharding.make_mesh("data=2,fsdp=4")
  sh = lambda *spec: NamedSharding(mesh, P(*spec))
  leaf = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
  shardings = {"stack": sh(None, "fsdp"), "odd_first": sh(None, "fsdp"), "odd": sh(), "scalar": sh(),
               "taken": sh("data"), "fsdp_dim": sh("fsdp")}
  shapes = {"stack": leaf(2, 64, 32), "odd_first": leaf(3, 64), "odd": leaf(3, 5), "scalar": leaf(),
            "taken": leaf(4, 6), "fsdp_dim": leaf(8, 3)}
  got = {k: s.spec for k, s in sharding.zero1_shardings(shardings, shapes).items()}
  assert got == {"stack": P("data", "fsdp"), "odd_first": P(None, ("fsdp", "data")), "odd": P(), "scalar": P(),
                 "taken": P("data"), "fsdp_dim": P(("fsdp", "data"))}
  one = sharding.make_mesh("fsdp=8")  # no data axis to split over: unchanged
  assert sharding.zero1_shardings({"a": NamedSharding(one, P(None, "fsdp"))}, {"a": leaf(2, 64)})["a"].spec == \
      P(None, "fsdp")


def device0_bytes(tree, shardings=None):
  """Bytes device 0 holds of a tree of arrays, or would hold under `shardings`."""
  if shardings is None:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device.id == 0)
  return sum(np.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
             for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def test_zero1_train_steps_equal_the_plain_run():
  """Tiny model, Muon (distributed NS) on the matrices and AdamW on the rest, so both kinds of state are split;
  the same mesh without ZeRO-1 is the reference (only the state's placement differs)."""
  cfg = models.preset("tiny", qk_norm=False, n_kv_heads=None)  # the plainest tiny model: a third less to compile
  mf = lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))
  tx = optim.muon(0.02, distributed=True)
  batches = [np.random.default_rng(k).integers(0, 256, (8, 17)) for k in range(3)]
  mesh, runs = sharding.make_mesh("data=2,fsdp=4"), {}
  for zero1 in (False, True):
    graphdef, state, shardings = train_state.create(mf, tx, mesh, zero1=zero1)
    if zero1:
      opt, params = state.opt_state, state.params
      mu_muon = opt.inner_states["muon"].inner_state[0].mu["blocks"]["w_up_DF"]  # (L, D, F), params (·, fsdp, ·)
      mu_adam = opt.inner_states["adam"].inner_state[0].mu["embed_VD"]  # (V, D), params (·, fsdp)
      assert mu_muon.sharding.spec == P("data", "fsdp") and mu_adam.sharding.spec == P("data", "fsdp")
      for p, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings.params)):
        assert p.sharding == sh and "data" not in jax.tree.leaves(tuple(sh.spec))
      plain = sharding.shardings_like_params(opt, params, shardings.params, mesh)
      assert device0_bytes(opt) < 0.55 * device0_bytes(opt, plain)  # half the state per device, bar scalars
    train_step, _ = make_steps(graphdef, tx, shardings, sharding.batch_sharding(mesh, (8, 16)))
    losses = []
    with jax.set_mesh(mesh):
      for b in batches:
        state, out = train_step(state, *sharding.shard_batch((b[:, :-1], b[:, 1:]), mesh))
        losses.append(float(out["loss"]))
    runs[zero1] = losses, jax.tree.map(np.asarray, state.params)
  assert len(set(runs[False][0])) == 3  # the steps change the model
  np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-6), runs[True][1], runs[False][1])


def test_train_cli_flag_reaches_the_saved_config():
  cfg = tyro.cli(TrainConfig, args=["--zero1"])
  assert cfg.mesh.zero1 is True and dataclasses.asdict(cfg)["mesh"]["zero1"] is True  # run() saves it as "train"
  assert tyro.cli(TrainConfig, args=[]).mesh.zero1 is False
