"""Expert parallelism: a tiny dropless MoE model gives the same loss, router statistics, gradients and Muon
updates on 8 simulated devices as on 1; the capacity path drops per batch shard exactly as the plain dispatch
does on that shard; the ragged all-to-all path lowers; the train CLI runs MoE on an EP x TP mesh and resumes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import optim
import sharding
from models import MoEConfig, TransformerConfig
from models.moe import swiglu_dense, swiglu_grouped
from sharding import experts

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=32, tie_embeddings=False,
                        moe=MoEConfig(num_experts=8, top_k=2, d_expert=16, num_shared=1))
TOKENS = np.random.default_rng(0).integers(0, 64, (8, 9)).astype(np.int32)
EXPERTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
MESHES = {  # expected expert-weight layout (layers, experts, fan_in, fan_out) and whether tokens travel
    "data=8": (P(), False),
    "fsdp=8": (P(None, None, "fsdp"), False),
    "data=2,tensor=2,expert=2": (P(None, "expert", None, "tensor"), True),
    "expert=8": (P(None, "expert"), True),
}


def model_fn():
  return models.Transformer(CFG, rngs=nnx.Rngs(0))


@functools.cache
def host_params():
  """Random host parameters of the model's shapes (the initializer is not under test; compiling it costs ~3 s)."""
  graphdef, abstract, _ = sharding.logical_names(model_fn)
  rng = np.random.default_rng(0)
  return graphdef, jax.tree.map(lambda a: (0.2 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)


def loss_grads_muon(mesh):
  """(params, (loss, aux, grads, Muon updates of the expert stacks), compiled HLO text) on `mesh`."""
  graphdef, host = host_params()
  _, abstract, names = sharding.logical_names(model_fn)
  p_sh = sharding.param_shardings(abstract, names, mesh)
  params = jax.device_put(host, p_sh)
  muon = optim.scale_by_muon(0.95, scale="moonlight")

  def step(p, x):
    def loss(p):
      logits, aux = nnx.merge(graphdef, p).forward(x[:, :-1])
      return models.cross_entropy(logits, x[:, 1:]) + models.aux_loss(aux, CFG), aux

    (l, aux), g = jax.value_and_grad(loss, has_aux=True)(p)
    stacks = {k: g["blocks"]["moe"][k] for k in EXPERTS}
    return l, aux, g, muon.update(stacks, muon.init(stacks))[0]

  with jax.set_mesh(mesh):
    x = sharding.shard_batch(TOKENS, mesh)
    # LLVM at -O0: a third less compile time; the HLO (and its partitioning) is what is under test
    compiled = jax.jit(step, out_shardings=(None, None, p_sh, None)).lower(params, x).compile(
        {"xla_backend_optimization_level": 0})
    return params, compiled(params, x), compiled.as_text()


@pytest.fixture(scope="module")
def reference():
  return loss_grads_muon(sharding.make_mesh("data=1", devices=jax.devices()[:1]))[1]


@pytest.mark.parametrize("spec", list(MESHES))
def test_sharded_moe_matches_one_device(spec, reference, capfd):
  params, (loss, aux, grads, muon), hlo = loss_grads_muon(sharding.make_mesh(spec))
  ref_loss, ref_aux, ref_grads, ref_muon = reference
  layout, travels = MESHES[spec]
  assert params["blocks"]["moe"]["w_gate_EDF"].sharding.spec == layout
  assert ("all-to-all" in hlo) == travels  # expert parallelism is chosen by the mesh alone
  for leaf, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads)):
    assert g.sharding.is_equivalent_to(leaf.sharding, leaf.ndim)

  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               aux, ref_aux)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               grads, ref_grads)
  # Muon per expert on the sharded stacks: Newton–Schulz amplifies the fp32 reduction-order noise of the
  # gradients (~1e-7 relative) through its steep polynomial; updates have RMS ≈ 0.2 (moonlight scale)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4), muon, ref_muon)
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


def routed_inputs(B=8, T=6, D=8, F=8, E=8, K=2):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  logits = rng.standard_normal((B, T, E)).astype(np.float32) + np.linspace(0, 2, E, dtype=np.float32)  # skewed
  idx = np.argsort(-logits, -1)[..., :K].astype(np.int32)
  gate = np.take_along_axis(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), idx, -1)
  w = {"gate": rng.standard_normal((E, D, F)), "up": rng.standard_normal((E, D, F)),
       "down": rng.standard_normal((E, F, D))}
  return x, idx, gate, {k: v.astype(np.float32) / 3 for k, v in w.items()}


NAMES = {"gate": ("expert", None, "mlp"), "up": ("expert", None, "mlp"), "down": ("expert", "mlp", None)}


def test_capacity_dispatch_drops_per_batch_shard_like_the_plain_version():
  """On data=2,tensor=2,expert=2 the batch splits 4 ways (data x expert): each shard is a group with its own
  C = ceil(cf·G·K/E); the slot buffers travel by all_to_all and the tensor halves of F are summed. The result
  equals the plain capacity dispatch run on each shard's tokens alone."""
  x, idx, gate, w = routed_inputs()
  mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
  f = functools.partial(experts.dispatch, names=NAMES, num_experts=8, grouped=swiglu_grouped, dense=swiglu_dense,
                        capacity_factor=1.0)
  with jax.set_mesh(mesh):
    w_sh = {k: NamedSharding(mesh, sharding.logical_to_spec(NAMES[k], mesh, v.shape)) for k, v in w.items()}
    y, keep = jax.jit(f)(*sharding.shard_batch((x, idx, gate), mesh), jax.device_put(w, w_sh))
    # bf16 compute (its tensor-parallel partial sums are added in fp32: a bf16 all-reduce here crashed XLA:CPU)
    y16 = jax.jit(f)(*sharding.shard_batch((x.astype(jnp.bfloat16), idx, gate), mesh), jax.device_put(w, w_sh))[0]
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y), atol=0.05 * np.abs(np.asarray(y)).max())
  ref = []
  for g in range(4):  # batch rows split over ("data", "expert"): shard g holds rows 2g, 2g+1
    rows = slice(2 * g, 2 * g + 2)
    G = 2 * x.shape[1]
    yg, kg = experts.capacity_local(x[rows].reshape(G, -1), idx[rows].reshape(G, -1), gate[rows].reshape(G, -1), w,
                                    swiglu_dense, 8, experts.capacity(G, 2, 8, 1.0))
    ref.append((np.asarray(yg).reshape(2, x.shape[1], -1), np.asarray(kg).reshape(2, x.shape[1], -1)))
  np.testing.assert_array_equal(np.asarray(keep), np.concatenate([k for _, k in ref]))
  np.testing.assert_allclose(np.asarray(y), np.concatenate([y_ for y_, _ in ref]), rtol=1e-5, atol=1e-5)
  assert 0.05 < 1 - np.asarray(keep).mean() < 0.5  # it really dropped, and not everything


def test_ragged_all_to_all_path_lowers_with_its_gradient():
  """XLA:CPU cannot run ragged-all-to-all (parallelism.md §3.4); the GPU/TPU path is checked to lower to it, in
  the forward (there and back) and in the backward pass (the transposes), on an expert=8 mesh."""
  x, idx, gate, w = routed_inputs()
  mesh = sharding.make_mesh("expert=8")
  f = functools.partial(experts.dispatch, names=NAMES, num_experts=8, grouped=swiglu_grouped, dense=swiglu_dense,
                        ragged=True)
  loss = lambda x, w, idx, gate: (f(x, idx, gate, w)[0] ** 2).sum()
  with jax.set_mesh(mesh):
    w_sh = {k: NamedSharding(mesh, sharding.logical_to_spec(NAMES[k], mesh, v.shape)) for k, v in w.items()}
    x, idx, gate = sharding.shard_batch((x, idx, gate), mesh)
    w = jax.device_put(w, w_sh)
    assert jax.jit(f).lower(x, idx, gate, w).as_text().count("ragged_all_to_all") == 2
    assert jax.jit(jax.grad(loss, (0, 1))).lower(x, w, idx, gate).as_text().count("ragged_all_to_all") == 4


def test_experts_that_do_not_split_over_the_expert_axis_are_refused():
  cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32, moe=MoEConfig(num_experts=4))
  with pytest.raises(sharding.ShardingError, match=r"size 4.*does not divide by mesh axes \('expert',\)"):
    sharding.init_params(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)), sharding.make_mesh("expert=8"))


def test_train_cli_moe_on_an_expert_parallel_mesh_logs_router_metrics_and_resumes(tmp_path):
  """--moe.* flags on data=2,expert=2,tensor=2: router metrics in metrics.jsonl every step; the aux-free bias is
  state beside the params, checkpointed and restored: after a run stopped at step 2 and resumed to step 3, the
  saved bias is u·Σ_s sign(mean load − load_s) over all three steps' logged loads (one layer)."""
  import json

  import orbax.checkpoint as ocp

  from research.train import main

  rate = 0.01
  args = ["--model", "moe_tiny", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2",
          "--moe.num-experts", "4", "--moe.top-k", "2", "--moe.d-expert", "16", "--moe.router", "sigmoid",
          "--moe.bias-rate", str(rate), "--mesh", "data=2,expert=2,tensor=2", "--steps", "3", "--batch-size", "8",
          "--seq-len", "16", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1", "--peak-flops", "1e12",
          "--qk-norm", "False", "--optimizer", "sgd", "--no-progress", "--out", str(tmp_path)]  # sgd: compiles faster
  main(args + ["--stop-at", "2"])
  main(args)
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3] and "val_loss" in records[-1]
  for r in records:
    assert len(r["moe/load"]) == 4 and abs(sum(r["moe/load"]) - 1) < 1e-6
    assert r["moe/dropped"] == 0 and 0 < r["moe/entropy"] <= np.log(4) + 1e-6
    assert r["moe/load_max"] >= 1 >= r["moe/load_min"] and r["aux_loss"] > 0 and r["moe/lb_loss"] > 0
  signs = [np.sign(0.25 - np.asarray(r["moe/load"])) for r in records]
  assert np.any(signs[0] + signs[1] != 0)  # the bias at the stop is not zero, so losing it would show
  with ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("state", "meta")) as manager:
    state = manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  assert "router_bias" not in str(jax.tree_util.tree_structure(state["opt_state"]))
  np.testing.assert_allclose(np.asarray(state["buffers"]["blocks"]["moe"]["router_bias"]),
                             rate * np.sum(signs, 0)[None], atol=1e-6)
