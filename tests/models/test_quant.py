"""models/quant.py and models/quant_store.py against references no one here wrote: qwix's quantize/dequantize and
quantized dot_general, qwix's own GPTQ (small matrix), and float64 NumPy references of GPTQ's column sweep, AWQ's
scale search and SmoothQuant's migration written from the papers (tests/models/quant_reference.py)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from models import Transformer, from_hf, generate, preset, quant, quant_store
from sharding.mesh import make_mesh
from sharding.state import place_variables


def _load_reference():
  import importlib.util
  import pathlib
  spec = importlib.util.spec_from_file_location("quant_reference",
                                                pathlib.Path(__file__).with_name("quant_reference.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


ref = _load_reference()  # float64 NumPy, from the papers


def _correlated(rng, n, i):
  """Inputs with unequal, correlated channels (and a few large ones), as a trained layer's inputs are."""
  mix = rng.normal(size=(i, i)) / np.sqrt(i) + np.eye(i)
  x = rng.normal(size=(n, i)) @ mix * np.exp(rng.normal(size=i))
  x[:, :3] *= 8.0  # outlier channels
  return x.astype(np.float32)


def _weights(rng, i, o):
  return (rng.normal(size=(i, o)) / np.sqrt(i)).astype(np.float32)


# ---- round to nearest is qwix's -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group,symmetric", [(2, 0, True), (3, 16, True), (4, 0, True), (4, 16, False),
                                                  (8, 0, True), (8, 32, False)])
def test_rtn_is_qwix_quantize_and_the_reference_grid(bits, group, symmetric):
  w = _weights(np.random.default_rng(bits), 64, 48)
  spec = quant.Spec("rtn", bits, group, symmetric)
  piece = quant.quantize_weight(w, spec)
  qt = {2: "int2", 3: "int3", 4: jnp.int4, 8: jnp.int8}[bits]
  q = qwix.quantize(jnp.asarray(w), qt, channelwise_axes=(1,), tiled_axes={0: group} if group else None,
                    calibration_method="absmax" if symmetric else "minmax")
  np.testing.assert_array_equal(piece.codes, np.asarray(q.qvalue, np.float32))
  np.testing.assert_array_equal(quant.dequantize(piece.codes, piece.scale, piece.zero), qwix.dequantize(q))
  codes, deq, unrounded = ref.rtn(w.T.astype(np.float64), bits, group, symmetric, unrounded=True)
  tie = np.abs(np.abs(unrounded - np.floor(unrounded)) - 0.5) < 1e-5  # float32 and float64 round a tie apart
  differ = codes.T != np.asarray(piece.codes)
  assert not np.any(differ & ~tie.T) and np.abs(codes.T - np.asarray(piece.codes)).max() <= 1
  np.testing.assert_allclose(deq.T[~differ], quant.dequantize(piece.codes, piece.scale, piece.zero)[~differ],
                             rtol=1e-6, atol=1e-7)


# ---- GPTQ ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group,symmetric", [(4, 0, True), (3, 128, True), (4, 0, False)])
def test_gptq_equals_the_float64_column_sweep(bits, group, symmetric):
  rng = np.random.default_rng(7)
  w, x = _weights(rng, 256, 32), _correlated(rng, 1024, 256)
  spec = quant.Spec("gptq", bits, group, symmetric)
  piece = quant.quantize_weight(w, spec, quant.Stats.of(x))
  ours = np.asarray(quant.dequantize(piece.codes, piece.scale, piece.zero), np.float64)
  codes, deq = ref.gptq(w.T, x, bits, group, symmetric)
  assert np.mean(codes.T == np.asarray(piece.codes)) > 0.99
  err = lambda d: np.sum((x.astype(np.float64) @ (d - w)) ** 2)
  assert abs(err(ours) - err(deq.T)) <= 0.01 * err(deq.T)
  _, rtn_deq = ref.rtn(w.T.astype(np.float64), bits, group, symmetric)
  assert err(deq.T) < 0.8 * err(rtn_deq.T)  # the point of GPTQ: less output error than rounding each weight


def test_gptq_equals_qwix_gptq_with_groups_inside_a_batch():
  from qwix._src.core import qarray
  from qwix.contrib import gptq_core
  rng = np.random.default_rng(3)
  w, x = _weights(rng, 16, 8), _correlated(rng, 256, 16)
  spec = quant.Spec("gptq", 4, group=8)
  piece = quant.quantize_weight(w, spec, quant.Stats.of(x))
  how = qarray.HowToQuantize(qtype=jnp.int4, channelwise_axes=(0,), tiled_axes={1: 8})
  theirs, _ = gptq_core.quantize_weight(jnp.asarray(w.T), gptq_core.compute_hessian(jnp.asarray(x.T)), how)
  np.testing.assert_array_equal(piece.codes, np.asarray(theirs.qvalue, np.float32).T)
  np.testing.assert_allclose(piece.scale, np.asarray(theirs.scale).T, rtol=1e-6)


# ---- AWQ, SmoothQuant, W8A8 ------------------------------------------------------------------------------------


def test_awq_search_equals_the_reference_on_the_calibration_output_error():
  """In AWQ's own setting (4-bit with zero points, small groups). Symmetric absmax grids put each group's largest
  weight on a rounding tie (±(2^(b−1) − 0.5) steps), which float32 and float64 resolve apart; zero points do not."""
  rng = np.random.default_rng(11)
  w, x = _weights(rng, 64, 40), _correlated(rng, 512, 64)
  spec = quant.Spec("awq", 4, group=16, symmetric=False)
  s, losses = quant.awq_scale(w, quant.Stats.of(x), spec)
  s_ref, errors = ref.awq(w.T, x, 4, 16, symmetric=False)
  np.testing.assert_allclose(np.asarray(losses), errors, rtol=2e-3)
  np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-5)
  assert errors.argmin() > 0  # the search matters here: the outlier channels make α = 0 (plain RTN) worse


def _positive_extremes(a, axis, seen=1.0):
  """`a` with each slice along `axis` signed so that the largest-magnitude entry of `a · seen` (what is quantized)
  is positive. A symmetric grid puts that entry on a rounding tie (2^(b−1) − 0.5 steps): on the positive side it
  rounds to 2^(b−1) − 1 either way (clipped), on the negative side to −2^(b−1) or −2^(b−1) + 1 by the last bit of a
  division (XLA's and numpy's differ there). Sign flips of whole slices change no absolute maximum."""
  idx = np.expand_dims(np.argmax(np.abs(a * seen), axis), axis)
  return a * np.sign(np.take_along_axis(a, idx, axis))


def test_smoothquant_migration_and_w8a8_product_equal_the_reference():
  rng = np.random.default_rng(5)
  w, x = _weights(rng, 64, 32), _correlated(rng, 256, 64)
  spec = quant.Spec("smoothquant", 8, act_bits=8, alpha=0.5)
  s_ours = np.asarray(quant.quantize_weight(w, spec, quant.Stats.of(x)).smooth)
  w, x = _positive_extremes(w, 0, s_ours[:, None]), _positive_extremes(x, 1, 1 / s_ours[None, :])
  piece = quant.quantize_weight(w, spec, quant.Stats.of(x))
  s = ref.smoothquant(w.T, x, 0.5)
  np.testing.assert_allclose(piece.smooth, s, rtol=1e-5)
  # the W8A8 product: per-token int8 activations X/s times per-channel int8 W·diag(s), rounded on the float32 grid
  # with our float32 s (equal to the formula's above), multiplied in float64
  s32 = np.asarray(piece.smooth)
  _, wq = ref.rtn((w * s32[:, None]).T, 8)
  expect = ref.per_token_int8(x / s32[None, :]).astype(np.float64) @ wq.T.astype(np.float64)
  layer = quant._LayerQuantized(piece, spec)
  got = layer.matmul(jnp.asarray(x)[None], jnp.float32)[0]
  np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)
  full = x @ w
  naive = ref.per_token_int8(x).astype(np.float64) @ ref.rtn(w.T, 8)[1].T.astype(np.float64)
  assert np.sum((expect - full) ** 2) < np.sum((naive - full) ** 2)  # smoothing helps with outlier channels


def test_quantized_matmul_equals_the_dequantized_float32_matmul():
  """qwix's int8 × int8 dot_general (per-token activations, per-channel weights) against what `Quantized.matmul`
  computes (dequantize both, multiply in float32): equal to rounding."""
  rng = np.random.default_rng(2)
  w, x = _weights(rng, 64, 48), _correlated(rng, 96, 64)
  xq = qwix.quantize(jnp.asarray(x), jnp.int8, channelwise_axes=(0,))
  wq = qwix.quantize(jnp.asarray(w), jnp.int8, channelwise_axes=(1,))
  real = qwix.dot_general(xq, wq, (((1,), (0,)), ((), ())))
  layer = quant._LayerQuantized(quant.quantize_weight(w, quant.Spec("rtn", 8, act_bits=8)), quant.Spec())
  ours = layer.matmul(jnp.asarray(x), jnp.float32)
  np.testing.assert_allclose(real, ours, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours, qwix.dequantize(xq) @ qwix.dequantize(wq), rtol=1e-6, atol=1e-6)


# ---- a quantized model -------------------------------------------------------------------------------------------

TOKENS = np.random.default_rng(0).integers(0, 256, (4, 33))


def _mixed_plan(model):
  plan = quant.uniform_plan(model, quant.Spec("gptq", 4, group=32))
  plan["blocks/w_up_DF"] = [quant.Spec("rtn", 16), quant.Spec("awq", 3, group=32)]
  plan["blocks/wo_QD"] = [quant.Spec("smoothquant", 8, act_bits=8), quant.Spec("rtn", 8, symmetric=False)]
  plan["blocks/wk_DK"] = [quant.Spec("rtn", 2), quant.Spec("awq", 4)]
  plan["blocks/wv_DK"] = [quant.Spec("rtn", 32), quant.Spec("gptq", 4, group=32)]  # layer 0 left in float32
  return plan


@pytest.fixture(scope="module")
def mixed():
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  full = np.asarray(model(TOKENS[:, :-1]))
  plan = _mixed_plan(model)
  quant.quantize(model, plan, TOKENS[:, :-1])
  return model, plan, full


full_wv0 = np.asarray(Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0)).blocks.wv_DK[...][0])


def test_the_plan_is_applied_as_given_and_weights_are_their_dequantized_codes(mixed):
  model, plan, full = mixed
  for path, q in quant.quantized(model):
    assert list(q.specs) == plan[path] and q.bits == tuple(s.bits for s in plan[path])
    for layer, bits in enumerate(q.bits):
      codes = np.asarray(q.codes[...][layer].astype(jnp.float32))
      if bits < 16:  # integers in the width's range (16, 32: the weight itself)
        assert codes.min() >= -2 ** (bits - 1) and codes.max() <= 2 ** (bits - 1) - 1
  assert model.blocks.w_up_DF.codes.dtype == jnp.bfloat16 and model.blocks.wq_DQ.codes.dtype == jnp.int8
  assert model.blocks.wv_DK.codes.dtype == jnp.float32
  np.testing.assert_array_equal(model.blocks.wv_DK.weight()[0], full_wv0)
  np.testing.assert_array_equal(model.blocks.wo_QD.act[...], [8, 0])
  logits = np.asarray(model(TOKENS[:, :-1]))
  assert 0 < np.abs(logits - full).max() < 0.5  # quantized: changed, and still the same model


def test_save_and_load_give_the_same_logits_and_the_real_size(mixed, tmp_path):
  model, plan, _ = mixed
  path = quant_store.save(model, str(tmp_path / "q"))
  loaded, config, plan2 = quant_store.load(path)
  assert plan2 == plan
  np.testing.assert_array_equal(loaded(TOKENS[:, :-1]), model(TOKENS[:, :-1]))
  # the file holds each layer's codes at its width: the packed bytes are what the widths say, not int8's
  from safetensors.numpy import load_file
  tensors = load_file(os.path.join(path, quant_store.WEIGHTS))
  for p, q in quant.quantized(model):
    n = int(np.prod(q.codes.shape[1:]))
    for layer, bits in enumerate(q.bits):
      assert tensors[f"{p}.codes.{layer}"].nbytes == -(-n * bits // 8)
  assert sum(t.nbytes for t in tensors.values()) < quant_store.stored_bytes(path) < \
      sum(t.nbytes for t in tensors.values()) + 64 * 1024  # + the header and config
  assert quant_store.stored_bytes(path) < quant_store.full_bytes(config)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), n=st.integers(1, 200), seed=st.integers(0, 2 ** 16))
def test_pack_unpack_round_trip(bits, n, seed):
  codes = np.random.default_rng(seed).integers(-2 ** (bits - 1), 2 ** (bits - 1), n)
  packed = quant_store.pack(codes, bits)
  assert packed.dtype == np.uint8 and packed.size == -(-n * bits // 8)
  np.testing.assert_array_equal(quant_store.unpack(packed, bits, (n,)), codes)


def test_bfloat16_layers_pack_their_bit_patterns():
  w = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.bfloat16)
  np.testing.assert_array_equal(quant_store.unpack(quant_store.pack(w, 16), 16, w.shape), w)


@pytest.fixture(scope="module")
def weights_only():
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  return quant.quantize(model, quant.uniform_plan(model, quant.Spec("rtn", 4, group=32)), TOKENS[:, :-1])


@pytest.mark.parametrize("spec", ["fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"])
@pytest.mark.parametrize("which", ["weights_only", "mixed"])
def test_forward_on_a_mesh_equals_one_device(request, which, spec):
  """Weight-only quantization: equal to float32 rounding. With 8-bit activations (the mixed plan's W8A8 layer) a
  sharded sum that differs in its last bit can move an activation across a rounding boundary: one step of a
  per-token int8 grid, |x|max/127.5, bounds what the logits may move."""
  model = request.getfixturevalue(which)
  model = model[0] if isinstance(model, tuple) else model
  mesh = make_mesh(spec)
  graphdef, state = nnx.split(model)
  f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  one = f(state, TOKENS[:, :-1])
  with jax.set_mesh(mesh):
    placed = place_variables(state, mesh)
    codes = [v for v in jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, nnx.Variable))
             if isinstance(v, quant.QuantCodes)]
    assert any(len(v.get_value().sharding.device_set) > 1 for v in codes)  # the codes are sharded, not copied
    sharded = f(placed, TOKENS[:, :-1])
  tol = 1e-5 if which == "weights_only" else 2e-3
  np.testing.assert_allclose(sharded, one, rtol=tol, atol=tol)


def test_a_quantized_model_samples_deterministically(mixed):
  model, _, _ = mixed
  a = generate(model, [[1, 2, 3]], 8, temperature=0.0)
  b = generate(model, [[1, 2, 3]], 8, temperature=0.0)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (1, 11)


def test_a_plan_file_round_trips_and_an_edit_is_applied(tmp_path):
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  plan = quant.uniform_plan(model, quant.Spec("rtn", 4))
  quant.write_plan(plan, str(tmp_path / "plan.json"))
  data = json.load(open(tmp_path / "plan.json"))
  data["layers"]["blocks/wv_DK"][1]["bits"] = 8
  json.dump(data, open(tmp_path / "plan.json", "w"))
  edited = quant.read_plan(str(tmp_path / "plan.json"))
  quant.quantize(model, edited, TOKENS[:2, :-1])
  assert model.blocks.wv_DK.bits == (4, 8) and model.blocks.wq_DQ.bits == (4, 4)


def test_moe_experts_take_rtn_and_refuse_the_rest():
  model = Transformer(preset("moe_tiny", vocab_size=256), rngs=nnx.Rngs(0))
  full = np.asarray(model(TOKENS[:, :-1]))
  plan = quant.uniform_plan(model, quant.Spec("rtn", 8))
  assert "blocks/moe/w_up_EDF" in plan
  with pytest.raises(quant.QuantError, match="only rtn"):
    quant.check_plan(model, {**plan, "blocks/moe/w_up_EDF": [quant.Spec("gptq", 4)] * 2})
  with pytest.raises(quant.QuantError, match="only rtn"):
    quant.check_plan(model, {**plan, "blocks/moe/w_up_EDF": [quant.Spec("rtn", 8, act_bits=8)] * 2})
  quant.quantize(model, plan, TOKENS[:, :-1])
  assert isinstance(model.blocks.moe.w_up_EDF, quant.Quantized)
  np.testing.assert_allclose(model(TOKENS[:, :-1]), full, atol=0.05)  # 8 bits: close to full precision


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.update({"blocks/wq_DQ": p["blocks/wq_DQ"][:1]}), "1 specs for 2 layers"),
    (lambda p: p.update({"blocks/nope": p["blocks/wq_DQ"]}), "not a layer-stacked weight"),
    (lambda p: p.update({"blocks/wq_DQ": [quant.Spec("rtn", 4, group=48)] * 2}), "does not divide"),
    (lambda p: p.update({"blocks/wq_DQ": [quant.Spec("rtn", 4, group=16), quant.Spec("rtn", 4, group=32)]}),
     "mixes group sizes"),
])
def test_bad_plans_are_refused_in_one_line(edit, message):
  model = Transformer(preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
  plan = quant.uniform_plan(model, quant.Spec("rtn", 4))
  edit(plan)
  with pytest.raises(quant.QuantError, match=message) as e:
    quant.check_plan(model, plan)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec,message", [(quant.Spec("nope"), "unknown algorithm"), (quant.Spec(bits=5), "bits"),
                                          (quant.Spec(bits=3, symmetric=False), "asymmetric"),
                                          (quant.Spec(act_bits=4), "act_bits")])
def test_bad_specs_are_refused(spec, message):
  with pytest.raises(quant.QuantError, match=message):
    spec.check()


def test_bad_plan_files_and_checkpoints_are_one_line_errors(tmp_path, mixed):
  with pytest.raises(quant.QuantError, match="no such plan"):
    quant.read_plan(str(tmp_path / "missing.json"))
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(quant.QuantError, match="not valid JSON"):
    quant.read_plan(str(tmp_path / "bad.json"))
  (tmp_path / "other.json").write_text('{"format": "x"}')
  with pytest.raises(quant.QuantError, match="not a quantization plan"):
    quant.read_plan(str(tmp_path / "other.json"))
  path = quant_store.save(mixed[0], str(tmp_path / "q"))
  with pytest.raises(Exception, match="not empty"):
    quant_store.save(mixed[0], path)
  weights = os.path.join(path, quant_store.WEIGHTS)
  data = open(weights, "rb").read()
  open(weights, "wb").write(data[: len(data) // 2])
  with pytest.raises(quant.QuantError, match="unreadable"):
    quant_store.load(path)
  with pytest.raises(quant.QuantError, match="no config.json"):
    quant_store.load(str(tmp_path))


def test_an_imported_hugging_face_model_quantizes(hf_checkpoints, hf_tokens):
  """A random tiny Llama built by transformers, imported, quantized at 8 bits by GPTQ: its logits stay close to
  transformers' own; at 3 bits RTN they move further (the quantization is real)."""
  path, logits = hf_checkpoints["llama"]
  errs = {}
  for spec in (quant.Spec("gptq", 8), quant.Spec("rtn", 3)):
    model, _ = from_hf(path)
    quant.quantize(model, quant.uniform_plan(model, spec), hf_tokens)
    errs[spec.bits] = float(np.abs(np.asarray(model(hf_tokens)) - logits).max())
  assert errs[8] < 0.02 < errs[3]
