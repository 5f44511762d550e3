"""Pipeline parallelism: the GPipe schedule over `stage` gives the sequential stack's outputs, aux and gradients."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import sharding
from models import moe
from research.train import RunError, TrainConfig, main, run
from sharding.pipeline import PipelineError, bubble_fraction, check_pipeline, pipeline, run_stages, shift_stages

# --- the schedule on a generic residual layer, against a float64 NumPy reference ---------------------------------

def np_stack(w, x):
  """float64 reference: x <- x + tanh(x A_l) B_l for l = 0..L-1; aux_l = mean over rows of |tanh(x A_l)|^2."""
  aux = []
  for a, b in zip(w["a"], w["b"]):
    h = np.tanh(x @ a)
    aux.append(np.mean(np.sum(h * h, -1)))
    x = x + h @ b
  return x, np.array(aux)


def stage_fn(w_Q, x):  # the Q layers of one stage, scanned like models.transformer.run_blocks
  def layer(x, w):
    h = jnp.tanh(x @ w["a"])
    return x + h @ w["b"], {"h2": jnp.mean(jnp.sum(h * h, -1))}
  return jax.lax.scan(layer, x, w_Q)


def generic(L=4, B=12, D=6, F=10, seed=0):
  rng = np.random.default_rng(seed)
  w = {"a": rng.normal(size=(L, D, F)) / 2, "b": rng.normal(size=(L, F, D)) / 3}
  return w, rng.normal(size=(B, D))


@pytest.mark.parametrize("stages, microbatches", [(2, 3), (4, 2)])
def test_schedule_equals_sequential_float64(stages, microbatches):
  w, x = generic()
  y_ref, aux_ref = np_stack(w, x)
  with jax.enable_x64(True):
    def loss(w, x, piped):
      y, aux = pipeline(stage_fn, w, x, microbatches=microbatches, stages=stages) if piped else stage_fn(w, x)
      return jnp.sum(jnp.sin(y)) + jnp.sum(aux["h2"] ** 2), (y, aux["h2"])

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, (y, aux)), g = grad(w, x, True)
    _, g_seq = grad(w, x, False)
  assert y.dtype == jnp.float64
  np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(aux, aux_ref, rtol=1e-12, atol=1e-12)  # a per-row mean: microbatch means average to it
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), g, g_seq)
  # and against NumPy: the directional derivative along a random (dw, dx) by central differences
  rng = np.random.default_rng(2)
  dw, dx = jax.tree.map(lambda a: rng.normal(size=a.shape), w), rng.normal(size=x.shape)
  f = lambda e: (lambda y, aux: np.sum(np.sin(y)) + np.sum(aux ** 2))(
      *np_stack(jax.tree.map(lambda a, d: a + e * d, w, dw), x + e * dx))
  slope = sum(np.vdot(np.asarray(a), d) for a, d in zip(jax.tree.leaves(g[0]), jax.tree.leaves(dw)))
  np.testing.assert_allclose(slope + np.vdot(np.asarray(g[1]), dx), (f(1e-5) - f(-1e-5)) / 2e-5, rtol=1e-7)


def test_bubble_fraction_and_layout_errors():
  assert bubble_fraction(1, 4) == 0.0
  assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
  assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
  check_pipeline(n_layers=8, batch=16, stages=4, microbatches=4, data_parallel=2)
  with pytest.raises(PipelineError, match=r"n_layers=6 does not split into stage=4 .*use a multiple of 4 layers"):
    check_pipeline(n_layers=6, batch=16, stages=4, microbatches=4)
  with pytest.raises(PipelineError, match=r"batch of 10 rows does not split into 4 microbatches"):
    check_pipeline(n_layers=8, batch=10, stages=4, microbatches=4)
  with pytest.raises(PipelineError, match=r"microbatch of 2 rows .* does not split over the 4 devices"):
    check_pipeline(n_layers=8, batch=8, stages=4, microbatches=4, data_parallel=4)
  with pytest.raises(PipelineError, match="must be positive"):
    bubble_fraction(2, 0)
  w, x = generic(L=3)
  with pytest.raises(PipelineError, match="n_layers=3 does not split into stage=2"):
    pipeline(stage_fn, w, x, microbatches=2, stages=2)
  with pytest.raises(models.ConfigError, match="microbatches must be positive"):
    models.preset("tiny", microbatches=0)


# --- the two shard_maps against their plain versions --------------------------------------------------------------

def test_shift_and_stage_run_equal_roll_and_vmap():
  mesh = sharding.make_mesh("stage=4,fsdp=2")
  w, x = generic(L=4, B=8)
  w_S = jax.tree.map(lambda a: a.reshape(4, 1, *a.shape[1:]).astype(np.float32), w)  # one layer per stage
  x_S = x.reshape(4, 2, -1).astype(np.float32)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  ws, xs = jax.tree.map(lambda a: put(a, P("stage")), w_S), put(x_S, P("stage", "fsdp"))
  with jax.set_mesh(mesh):
    shift, run_ = jax.jit(shift_stages), jax.jit(lambda w, x: run_stages(stage_fn, w, x))
    y, (z, aux) = shift(xs), run_(ws, xs)
    hlo_shift, hlo_run = shift.lower(xs).compile().as_text(), run_.lower(ws, xs).compile().as_text()
  np.testing.assert_array_equal(np.asarray(y), np.roll(x_S, 1, axis=0))
  assert y.sharding.is_equivalent_to(xs.sharding, 3)  # fsdp stayed with GSPMD, no gather
  assert len(re.findall(r" collective-permute(?:-start)?\(", hlo_shift)) == 1
  z_ref, aux_ref = jax.jit(jax.vmap(stage_fn))(w_S, x_S)
  np.testing.assert_allclose(np.asarray(z), np.asarray(z_ref), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(aux["h2"]), np.asarray(aux_ref["h2"]), rtol=1e-6)
  assert z.sharding.is_equivalent_to(xs.sharding, 3)
  # each stage computes on its own weights and rows: nothing is gathered or moved (the one all-reduce is the row
  # mean of the aux over fsdp)
  assert not re.search(r" (all-gather|all-to-all|collective-permute)(?:-start)?\(", hlo_run)
  assert not re.search(r" (all-gather|all-reduce|all-to-all)(?:-start)?\(", hlo_shift)
  np.testing.assert_array_equal(np.asarray(jax.jit(shift_stages)(x_S)), np.roll(x_S, 1, axis=0))  # no mesh: roll


# --- the transformer: pipelined on 8 devices == sequential on 1 ----------------------------------------------------

# logit_stats: the dense model's aux is each head's max attention logit, a maximum over microbatches, not a mean
CFG = models.preset("tiny", n_layers=4, tie_embeddings=False, logit_stats=True)
MOE = models.preset("moe_tiny", n_layers=4, tie_embeddings=False)  # dropless routing: no layout-dependent drops
OPTS = {"xla_backend_optimization_level": 0}  # LLVM -O0: half the compile time; the partitioned HLO is the same
TOKENS = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)


def host_params(cfg):
  """Random weights (norm scales around 1) as NumPy arrays: no compile, unlike the initialiser."""
  _, abstract, _ = sharding.logical_names(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(1)
  draw = lambda path, a: (1 if path[-1].key.endswith("norm") else 0) + 0.05 * rng.normal(size=a.shape)
  return jax.tree_util.tree_map_with_path(lambda path, a: draw(path, a).astype(np.float32), abstract)


def loss_and_grads(cfg, mesh, host):
  """((loss, per-layer aux), grads, params, compiled HLO) of cross entropy + the MoE aux losses (0 if dense)."""
  graphdef, abstract, names = sharding.logical_names(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  p_sh = sharding.param_shardings(abstract, names, mesh)
  params = jax.device_put(host, p_sh)

  def loss(p, x):
    logits, aux = nnx.merge(graphdef, p).forward(x[:, :-1])
    return models.cross_entropy(logits, x[:, 1:]) + moe.aux_loss(aux, cfg), aux

  with jax.set_mesh(mesh):
    x = sharding.shard_batch(TOKENS, mesh)
    f = jax.jit(jax.value_and_grad(loss, has_aux=True), out_shardings=((None, None), p_sh))
    compiled = f.lower(params, x).compile(compiler_options=OPTS)
    value_aux, grads = compiled(params, x)
  return value_aux, grads, params, compiled.as_text()


@pytest.fixture(scope="module")
def reference():
  """Per model: its host weights and the sequential model's loss, aux and gradients on the whole batch, one device.
  (The MoE aux entries are token means, so their microbatch average is the whole batch's; the Switch loss is formed
  from them afterwards.)"""
  one = sharding.make_mesh("data=1", devices=jax.devices()[:1])
  out = {}
  for name, cfg in (("dense", CFG), ("moe", MOE)):
    host = host_params(cfg)
    out[name] = host, *loss_and_grads(cfg, one, host)[:2]
  return out


def collective_permutes(hlo: str) -> list[tuple[str, bool]]:
  """(instruction, inside a loop) for each collective-permute of a compiled program's HLO; a computation is in a
  loop when it is a while body or is called from one."""
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name = head.group(1)
      comps[name] = []
    elif name:
      comps[name].append(line)
  loop = {b for body in comps.values() for line in body for b in re.findall(r"body=%?([\w.\-]+)", line)}
  frontier = set(loop)
  while frontier:
    called = {c for n in frontier for line in comps.get(n, ()) for c in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)",
                                                                                     line)}
    frontier = called - loop
    loop |= called
  return [(line, n in loop) for n, body in comps.items() for line in body
          if re.search(r" collective-permute(?:-start)?\(", line)]


@pytest.mark.parametrize("model, spec, M, wq_spec", [
    ("dense", "stage=2,data=2,tensor=2", 2, P("stage", None, "tensor")),
    ("moe", "stage=2,data=2,tensor=2", 2, P("stage", None, "tensor")),
    ("moe", "stage=4,fsdp=2", 2, P("stage", "fsdp"))])  # M < S; M > S: test_schedule_equals_sequential_float64
def test_pipelined_transformer_matches_one_device(model, spec, M, wq_spec, reference, capfd):
  host, (ref_value, ref_aux), ref_grads = reference[model]
  mesh = sharding.make_mesh(spec)
  S = mesh.shape["stage"]
  cfg = dataclasses.replace(CFG if model == "dense" else MOE, microbatches=M)
  (value, aux), grads, params, hlo = loss_and_grads(cfg, mesh, host)

  blocks = params["blocks"]
  assert blocks["wq_DQ"].sharding.spec == wq_spec
  assert all(leaf.sharding.spec[0] == "stage" for leaf in jax.tree.leaves(blocks))  # each stage holds its layers
  for leaf, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads)):
    assert g.sharding.is_equivalent_to(leaf.sharding, leaf.ndim)

  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               grads, ref_grads)
  assert set(aux) == (set(moe.AUX_KEYS) if model == "moe" else {"max_logit"})
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               aux, ref_aux)  # per layer (L, ...): the microbatch average (max_logit: maximum) equals the batch's
  # M + S - 2 shifts forward and their transposes backward (GSPMD adds permutes that bring the last stage's output
  # to the other stages); none inside a loop, where XLA:CPU can deadlock (see pipeline.py)
  permutes = collective_permutes(hlo)
  assert sum("shard_map/ppermute" in line for line, _ in permutes) == 2 * (M + S - 2)
  assert not any(in_loop for _, in_loop in permutes)
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


# --- the train CLI -------------------------------------------------------------------------------------------------

TINY = dict(model="tiny", steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=3, eval_batches=1,
            warmup_steps=1, progress=False, peak_flops=1e12, mesh="stage=2,data=2,fsdp=2")


def test_train_runs_the_pipeline_and_reports_the_bubble(tmp_path, capfd):
  records = run(TrainConfig(out=str(tmp_path), microbatches=2, **TINY))
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) for r in records) and records[-1]["loss"] < records[0]["loss"]
  assert np.isfinite(records[-1]["val_loss"])
  meta = json.load(open(tmp_path / "config.json"))
  assert meta["pipeline"] == {"schedule": "gpipe", "stages": 2, "layers_per_stage": 1, "microbatches": 2,
                              "bubble_fraction": 1 / 3}
  assert "2 microbatches of 4 sequences, GPipe bubble (S-1)/(M+S-1) = 33.3%" in capfd.readouterr().err


def test_train_refuses_layers_or_batch_that_do_not_split(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    main(["--model", "tiny", "--mesh", "stage=2,data=2,fsdp=2", "--n-layers", "3", "--out", str(tmp_path)])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      "error: --mesh data=2,stage=2,fsdp=2: n_layers=3 does not split into stage=2 pipeline stages; "
      "use a multiple of 2 layers or a stage size that divides 3")
  with pytest.raises(RunError, match=r"--mesh data=2,stage=2,fsdp=2: n_layers=3 does not split into stage=2"):
    run(TrainConfig(out=str(tmp_path), n_layers=3, **TINY))
  with pytest.raises(RunError, match=r"batch of 8 rows does not split into 3 microbatches"):
    run(TrainConfig(out=str(tmp_path), microbatches=3, **TINY))
  with pytest.raises(RunError, match=r"microbatch of 2 rows .* does not split over the 4 devices"):
    run(TrainConfig(out=str(tmp_path), microbatches=4, **TINY))
