"""models/peft.py: every method starts as the identity and merges to what it computes; only adapters are Params;
LoRA and DoRA agree with Hugging Face `peft` (logits and adapter gradients) on transformers models with the same
weights; Pre-Diag, SORA and the sparse adapter agree with float64 NumPy forms of the paper equations, written in PEFT's
(out, in) orientation; SNIP pruning keeps the budget and the identity start; adapted training is the same on sharded
meshes as on one device; the adapters' factorized products equal the merged weights' (values and gradients) and form
no (fan_in, fan_out) array in a compiled train step."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from models import HFError, Transformer, cross_entropy, from_hf, peft, preset, to_hf_peft
from sharding import make_mesh, place_variables

TOKENS = np.random.default_rng(0).integers(0, 256, (4, 16))


def _model(name="tiny", seed=0):
  return Transformer(preset(name), rngs=nnx.Rngs(seed))


def _logits(model, tokens=TOKENS):
  return np.asarray(model(jnp.asarray(tokens)))


def _perturb(model, seed=1, scale=0.05):
  """Every adapter Param moved off its initial value (so that merge and the references see a real update)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  params = jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
  return nnx.merge(graphdef, params, rest)


# every method on the dense model; on the MoE (experts: one more leading axis, the same code) the most involved one
@pytest.mark.parametrize("method, name", [(m, "tiny") for m in tuple(peft.ADAPTERS)] + [("sora", "moe_tiny")])
def test_identity_at_init_and_merge_is_exact(method, name):
  model = _model(name)
  base = _logits(model)
  peft.apply(model, method, rank=4, alpha=8)
  np.testing.assert_allclose(_logits(model), base, atol=1e-6 if method == "dora" else 0)
  model = _perturb(model)
  adapted = _logits(model)
  assert np.abs(adapted - base).max() > 1e-3, "the perturbed adapters changed nothing"
  merged = peft.merge(model)
  assert not peft.adapters(merged) and not jax.tree.leaves(nnx.state(merged, peft.Frozen))
  np.testing.assert_allclose(_logits(merged), adapted, rtol=1e-5, atol=1e-5)


def test_only_adapters_are_params_and_get_gradients():
  model = peft.apply(_model("moe_tiny"), "lora", rank=2, alpha=4, base_dtype=jnp.bfloat16)
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert {p[-1] for p, _ in params} == {"a_IR", "b_RO"}
  frozen = jax.tree.leaves(nnx.state(model, peft.Frozen))
  assert frozen and all(x.dtype == jnp.bfloat16 for x in frozen)
  assert {p[-2] for p, _ in params} == {"wq_DQ", "wk_DK", "wv_DK", "wo_QD", "w_gate_EDF", "w_up_EDF", "w_down_EFD"}
  c = model.c
  L, D, r = c.n_layers, c.d_model, 2
  E, F = c.moe.num_experts, c.moe.d_expert
  attn = D * r + r * c.n_heads * c.hd + 2 * (D * r + r * c.kv_heads * c.hd) + c.n_heads * c.hd * r + r * D
  assert peft.trainable_count(model) == L * (attn + E * 3 * r * (D + F))
  grads = nnx.grad(lambda m: jnp.mean(m(jnp.asarray(TOKENS)) ** 2))(model)
  assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))
  # B = 0 at init: only B gets a gradient (A's is B-times-something)
  flat = dict(nnx.to_flat_state(grads))
  assert all(float(jnp.abs(g).max()) > 0 for p, g in flat.items() if p[-1] == "b_RO")
  assert all(float(jnp.abs(g).max()) == 0 for p, g in flat.items() if p[-1] == "a_IR")


def test_bad_settings_are_refused():
  with pytest.raises(peft.PEFTError, match="unknown PEFT method 'qlora'"):
    peft.apply(_model(), "qlora")
  with pytest.raises(peft.PEFTError, match="match no weight matrix"):
    peft.apply(_model(), "lora", targets="nothing_here")
  with pytest.raises(peft.PEFTError, match="not a regular expression"):
    peft.apply(_model(), "lora", targets="(")
  with pytest.raises(peft.PEFTError, match="rank"):
    peft.apply(_model(), "lora", rank=0)
  with pytest.raises(peft.PEFTError, match="sparsity"):
    peft.apply(_model(), "sparse_adapter", sparsity=1.0)
  with pytest.raises(peft.PEFTError, match=r"sparsity must lie in \[0, 1\), got 1.5"):  # another method's option
    peft.apply(_model(), "lora", sparsity=1.5)
  with pytest.raises(peft.PEFTError, match="r_p must be >= 1, got r_p=0"):
    peft.apply(_model(), "sora", r_p=0)
  with pytest.raises(peft.PEFTError, match="unknown PEFT option.s. dropout"):
    peft.apply(_model(), "lora", dropout=0.1)
  with pytest.raises(peft.PEFTError, match="already has adapters"):
    peft.apply(peft.apply(_model(), "lora"), "dora")
  biased = Transformer(preset("tiny", qkv_bias=True), rngs=nnx.Rngs(0))
  with pytest.raises(peft.PEFTError, match="sora on blocks/w[qkv]_D[QK]: the projection has a bias"):
    peft.apply(biased, "sora")
  assert not peft.adapters(biased) and not jax.tree.leaves(nnx.state(biased, peft.Frozen))  # left as it was
  peft.apply(Transformer(preset("tiny", qkv_bias=True), rngs=nnx.Rngs(0)), "dora")  # PEFT's DoRA keeps the bias


# ---- float64 NumPy references of the paper equations, PEFT's orientation: W (out, in), y = x Wᵀ ----------------------

def _np(x):
  return np.asarray(x, np.float64)


def _reference(method, a, x_NI):
  """y_NO of adapter `a` (one matrix: no leading axes) from its parameters, in float64."""
  W0 = _np(a.w0[...]).T  # (out, in)
  s = a.scale
  if method == "sparse_adapter":
    A, B = (_np(a.a_IR[...]) * _np(a.mask_a[...])).T, (_np(a.b_RO[...]) * _np(a.mask_b[...])).T
  else:
    A, B = _np(a.a_IR[...]).T, _np(a.b_RO[...]).T  # lora_A (r, in), lora_B (out, r)
  if method in ("lora", "sparse_adapter"):
    return x_NI @ (W0 + s * B @ A).T
  if method == "dora":
    V = W0 + s * B @ A
    return x_NI @ (_np(a.m_O[...])[:, None] * V / np.linalg.norm(V, axis=1, keepdims=True)).T
  d = _np(a.d_O[...])
  y = (x_NI @ W0.T) * d + s * (x_NI @ A.T) @ B.T  # Pre-Diag: (x W0ᵀ) ⊙ d + s·B(A x)
  if method == "prediag":
    return y
  C, D = _np(a.c_OP[...]), _np(a.d_OP[...])  # (out, r_p)
  s_p = min(a.s0 / (np.linalg.norm(C) + np.linalg.norm(D) + 1e-6), 1.0)
  return y + s_p * (y @ C @ D.T - y @ D @ C.T)  # y (I + S), S = s_p (C Dᵀ − D Cᵀ)


@pytest.mark.parametrize("method", tuple(peft.ADAPTERS))
def test_forward_equals_the_float64_reference(method):
  model = _perturb(peft.apply(_model(), method, rank=3, alpha=5, r_p=2), scale=0.3)
  for path, stacked in peft.adapters(model):
    x = np.random.default_rng(1).standard_normal((5, stacked.w0.shape[-2]))
    graphdef, state = nnx.split(stacked)
    for layer in range(model.c.n_layers):
      a = nnx.merge(graphdef, jax.tree.map(lambda v: v[layer], state))
      got = x.astype(np.float32) @ np.asarray(a.weight())
      want = _reference(method, a, x)
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{path}[{layer}]")


def test_sora_rotation_is_norm_preserving_to_first_order():
  """S is skew-symmetric, so ‖y(I + S)‖² = ‖y‖² + ‖yS‖² exactly (the reference's argument)."""
  model = _perturb(peft.apply(_model(), "sora", rank=2, alpha=2), scale=0.5)
  a = dict(peft.adapters(model))["blocks/wq_DQ"]
  C, D = _np(a.c_OP[...])[0], _np(a.d_OP[...])[0]
  S = C @ D.T - D @ C.T
  np.testing.assert_allclose(S, -S.T, atol=1e-12)
  y = np.random.default_rng(2).standard_normal((3, S.shape[0]))
  np.testing.assert_allclose(np.sum((y + y @ S) ** 2, 1), np.sum(y ** 2, 1) + np.sum((y @ S) ** 2, 1), rtol=1e-10)


def test_snip_prunes_to_the_budget_and_keeps_the_identity():
  model = _model()
  base = _logits(model)
  peft.apply(model, "sparse_adapter", rank=4, alpha=8, sparsity=0.5)
  width = dict(peft.adapters(model))["blocks/wq_DQ"].a_IR.shape[-1]
  assert width == 8  # Large-Sparse: rank 4 / (1 - 0.5)
  dense = peft.trainable_count(model)
  x, y = jnp.asarray(TOKENS[:, :-1]), jnp.asarray(TOKENS[:, 1:])
  loss = lambda m: jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(m(x)), y[..., None], -1))
  peft.snip_prune(model, loss, 0.5)
  assert abs(peft.trainable_count(model) - dense / 2) <= 1
  np.testing.assert_array_equal(_logits(model), base)  # B is zero again
  # the kept weights are the ones of largest |θ·∂L/∂θ| at the probe: re-scoring one matrix shows no kept weight
  # scoring below a pruned one of the same matrix (a global threshold implies it per matrix)
  masks = [np.asarray(a.mask_a[...]) for _, a in peft.adapters(model)]
  assert all(0 < m.mean() < 1 for m in masks)
  with pytest.raises(peft.PEFTError, match="sparse_adapter"):
    peft.snip_prune(peft.apply(_model(), "lora"), loss, 0.5)


# ---- Hugging Face peft as the oracle --------------------------------------------------------------------------------

HF_TARGETS = {"wq_DQ": "self_attn.q_proj", "wk_DK": "self_attn.k_proj", "wv_DK": "self_attn.v_proj",
              "wo_QD": "self_attn.o_proj", "w_gate_DF": "mlp.gate_proj", "w_up_DF": "mlp.up_proj",
              "w_down_FD": "mlp.down_proj"}


@pytest.mark.parametrize("method, hf", [("lora", "llama"), ("dora", "llama"), ("dora", "qwen2")])  # qwen2: q/k/v biases
def test_logits_and_adapter_gradients_equal_hf_peft(hf_checkpoints, hf_tokens, hf, method):
  import peft as hf_peft
  import transformers
  path, _ = hf_checkpoints[hf]
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  cfg = hf_peft.LoraConfig(r=4, lora_alpha=8, target_modules=[t.split(".")[1] for t in HF_TARGETS.values()],
                           use_dora=method == "dora", lora_dropout=0.0)
  ref = hf_peft.get_peft_model(ref, cfg).eval()
  layers = ref.base_model.model.model.layers
  with torch.no_grad():  # a real update: B (zero at init) and the magnitude moved
    for layer in layers:
      for t in HF_TARGETS.values():
        mod = layer.get_submodule(t)
        mod.lora_B["default"].weight.normal_(0, 0.05)
        if method == "dora":
          mod.lora_magnitude_vector["default"].weight.mul_(1 + 0.1 * torch.randn_like(mod.lora_magnitude_vector[
              "default"].weight))
  model, _ = from_hf(path)
  peft.apply(model, method, targets="blocks/(" + "|".join(HF_TARGETS) + ")$", rank=4, alpha=8)
  adapters = dict(peft.adapters(model))
  for name, t in HF_TARGETS.items():
    mods = [layer.get_submodule(t) for layer in layers]
    a = adapters[f"blocks/{name}"]
    a.a_IR.set_value(jnp.asarray(np.stack([m.lora_A["default"].weight.detach().numpy().T for m in mods])))
    a.b_RO.set_value(jnp.asarray(np.stack([m.lora_B["default"].weight.detach().numpy().T for m in mods])))
    if method == "dora":
      a.m_O.set_value(jnp.asarray(np.stack([m.lora_magnitude_vector["default"].weight.detach().numpy() for m in mods])))
  R = np.random.default_rng(3).standard_normal(hf_tokens.shape + (ref.config.vocab_size,)).astype(np.float32)
  logits = ref(torch.tensor(hf_tokens)).logits
  (logits * torch.tensor(R)).sum().backward()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(hf_tokens))), logits.detach().numpy(), atol=2e-5, rtol=1e-4)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.asarray(hf_tokens)) * R))(model)
  for name, t in HF_TARGETS.items():
    mods = [layer.get_submodule(t) for layer in layers]
    g = grads["blocks"][name]
    want_a = np.stack([m.lora_A["default"].weight.grad.numpy().T for m in mods])
    want_b = np.stack([m.lora_B["default"].weight.grad.numpy().T for m in mods])
    for got, want in ((g["a_IR"][...], want_a), (g["b_RO"][...], want_b)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-4 * np.abs(want).max(), err_msg=name)
    if method == "dora":
      want_m = np.stack([m.lora_magnitude_vector["default"].weight.grad.numpy() for m in mods])
      np.testing.assert_allclose(np.asarray(g["m_O"][...]), want_m, rtol=1e-3, atol=1e-4 * np.abs(want_m).max())


# ---- sharded meshes equal one device ------------------------------------------------------------------------------

def _adapted_step(model, tokens, mesh=None):
  """One SGD step on the adapters (jitted, on `mesh` if given): (loss, the adapters after the step)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, r, t):
    logits, aux = nnx.merge(graphdef, p, r).forward(t[:, :-1])
    lp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(lp, t[:, 1:, None], -1))

  @jax.jit
  def step(p, r, t):
    loss, g = jax.value_and_grad(loss_fn)(p, r, t)
    return loss, jax.tree.map(lambda x, y: x - 0.5 * y, p, g)

  if mesh is None:
    return jax.tree.map(np.asarray, step(params, rest, jnp.asarray(tokens)))
  with jax.set_mesh(mesh):
    out = step(place_variables(params, mesh), place_variables(rest, mesh), jnp.asarray(tokens))
  return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("name, mesh", [("tiny", "fsdp=4,tensor=2"), ("moe_tiny", "expert=4,data=2")])
def test_adapted_training_on_a_mesh_equals_one_device(name, mesh):
  model = _perturb(peft.apply(_model(name), "dora", rank=2, alpha=4))
  tokens = np.random.default_rng(4).integers(0, 256, (8, 9))  # the batch splits over 8 devices
  want = _adapted_step(model, tokens)
  got = _adapted_step(model, tokens, make_mesh(mesh))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), got[1], want[1])


# ---- the adapter alone, in PEFT's format ----------------------------------------------------------------------------

def test_adapter_export_loads_in_hf_peft(hf_checkpoints, hf_tokens, tmp_path):
  """DoRA (A, B and the magnitude) on Qwen2 (biased q/k/v): PEFT's PeftModel.from_pretrained on the base directory
  computes what the adapted model does."""
  import peft as hf_peft
  import transformers
  path, _ = hf_checkpoints["qwen2"]
  model = _perturb(peft.apply(from_hf(path)[0], "dora", rank=4, alpha=8))
  to_hf_peft(model, str(tmp_path / "adapter"), path)
  base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  ref = hf_peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  with torch.no_grad():
    want = ref(torch.tensor(hf_tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(hf_tokens))), want, atol=2e-5, rtol=1e-4)
  with pytest.raises(HFError, match="exists and is not empty"):
    to_hf_peft(model, str(tmp_path / "adapter"))


def test_adapter_export_refuses_what_peft_cannot_hold(tmp_path):
  with pytest.raises(HFError, match="LoRA or DoRA adapters, this model has SORA"):
    to_hf_peft(peft.apply(_model(), "sora"), str(tmp_path / "a"))
  with pytest.raises(HFError, match="adapters on MoE experts"):
    to_hf_peft(peft.apply(_model("moe_tiny"), "lora"), str(tmp_path / "b"))
  with pytest.raises(HFError, match="no adapters"):
    to_hf_peft(_model(), str(tmp_path / "c"))
  assert not list(tmp_path.iterdir())


# ---- any optimizer trains the adapters --------------------------------------------------------------------------

def test_every_optimizer_trains_the_adapters_and_muon_orthogonalizes_only_the_factors():
  """Each registered optimizer takes a step on DoRA's adapters (A, B stacked per layer; the magnitude m_O a vector per
  layer). Muon orthogonalizes A (I, r) and B (r, O) and leaves m_O to AdamW; no optimizer decays m_O."""
  from optim import OPTIMIZERS, get_optimizer
  from optim.muon import muon_labels
  from optim.registry import decay_mask
  model = _perturb(peft.apply(_model(), "dora", rank=2, alpha=4))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  grads = nnx.to_pure_dict(nnx.grad(lambda m: jnp.mean(m(jnp.asarray(TOKENS)) ** 2))(model))
  labels = jax.tree_util.tree_leaves_with_path(muon_labels(params))
  assert {p[-1].key: l for p, l in labels} == {"a_IR": "muon", "b_RO": "muon", "m_O": "adam"}
  assert not any(jax.tree.leaves(decay_mask(params)["blocks"]["wq_DQ"]["m_O"]))
  one = lambda tree: {"blocks": {"wq_DQ": tree["blocks"]["wq_DQ"]}}  # one adapter's three arrays: fast to compile
  params, grads = one(params), one(grads)
  for name in sorted(OPTIMIZERS):
    tx = get_optimizer(name, 1e-3)
    state = tx.init(params)
    for _ in range(2):  # SOAP's first step only builds its preconditioner (as its reference does); the second moves
      updates, state = tx.update(grads, state, params)
    moved = [float(jnp.abs(u).max()) for u in jax.tree.leaves(updates)]
    assert all(np.isfinite(moved)) and max(moved) > 0, name


# ---- factorized products: `matmul` computes x @ weight() without forming W or dL/dW ---------------------------------

def _merged_products(mp: pytest.MonkeyPatch):
  """The adapters as they were: without their `matmul` the model reads `[...]`, forms W and projects dL/dW."""
  for cls in (peft.Adapter, *peft.ADAPTERS.values()):
    if "matmul" in vars(cls):
      mp.delattr(cls, "matmul")


def _masked(model, seed=5, keep=0.6):
  """Sparse adapters' masks drawn at random (so that they matter); other adapters unchanged."""
  rng = np.random.default_rng(seed)
  for _, a in peft.adapters(model):
    if isinstance(a, peft.SparseAdapter):
      for mask in (a.mask_a, a.mask_b):
        mask.set_value(jnp.asarray(rng.random(mask.shape) < keep, mask.dtype))
  return model


def _moe_shared():
  """moe_tiny with a shared expert, whose projections reach `matmul` from models/moe.py."""
  c = preset("moe_tiny")
  return Transformer(preset("moe_tiny", moe=dataclasses.replace(c.moe, num_shared=1)), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("method, name", [(m, "tiny") for m in tuple(peft.ADAPTERS)] + [("dora", "moe_tiny")])
def test_factorized_product_and_gradients_equal_the_merged_weight(method, name):
  """On each stacked adapter (x with its leading axes: layers, and experts for moe_tiny) a.matmul(x) = x @ a.weight()
  to float32 rounding, and so are the gradients of ⟨y, R⟩ w.r.t. the adapter's Params (DoRA: the column norm a
  constant of the backward in both)."""
  model = _masked(_perturb(peft.apply(_model(name), method, rank=3, alpha=5, r_p=2), scale=0.3))
  rng = np.random.default_rng(6)
  forms = {"factorized": lambda a, x: a.matmul(x, jnp.float32), "merged": lambda a, x: x @ a.weight()}

  def inner(f, x, R):  # a -> (⟨y, R⟩, y)
    def loss(a):
      y = f(a, x)
      return jnp.sum(y * R), y
    return loss

  for path, a in peft.adapters(model):
    *lead, fan_in, fan_out = a.w0.shape
    x = jnp.asarray(rng.standard_normal((*lead, 5, fan_in)), jnp.float32)
    R = jnp.asarray(rng.standard_normal((*lead, 5, fan_out)), jnp.float32)
    out = {k: nnx.value_and_grad(inner(f, x, R), has_aux=True)(a) for k, f in forms.items()}
    (_, y), grads = out["factorized"]
    (_, want_y), want_grads = out["merged"]
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * np.abs(want_y).max(), err_msg=path)
    got, want = nnx.to_flat_state(grads), dict(nnx.to_flat_state(want_grads))
    assert {p for p, _ in got} == set(want) and len(want) == {"dora": 3, "prediag": 3, "sora": 5}.get(method, 2)
    for p, g in got:
      w = np.asarray(want[p][...])
      np.testing.assert_allclose(g[...], w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=f"{path}/{p}")


# the products themselves are checked per method above (and LoRA, DoRA against PEFT): here the model's plumbing, with
# the most involved method on the dense model and the shared expert's call sites of models/moe.py
@pytest.mark.parametrize("method, name", [("sora", "tiny"), ("lora", "moe_shared")])
def test_factorized_model_equals_the_merged_one(method, name, monkeypatch):
  """The whole model under the layer scan (moe_shared: the shared expert's projections too, the routed experts merged
  either way): logits and adapter gradients of the factorized products equal those of the merged weights."""
  model = _moe_shared() if name == "moe_shared" else _model(name)
  model = _masked(_perturb(peft.apply(model, method, rank=3, alpha=5, r_p=2), scale=0.3))
  R = np.random.default_rng(7).standard_normal(TOKENS.shape + (model.c.vocab_size,)).astype(np.float32)

  def loss(m):  # ⟨logits, R⟩ and the logits
    logits = m(jnp.asarray(TOKENS))
    return jnp.sum(logits * R), logits

  (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  _merged_products(monkeypatch)
  (_, want_logits), want_grads = nnx.value_and_grad(loss, has_aux=True)(model)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  want = dict(nnx.to_flat_state(want_grads))
  for p, g in nnx.to_flat_state(grads):
    w = np.asarray(want[p][...])
    np.testing.assert_allclose(g[...], w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg="/".join(map(str, p)))


def _compiled_grad(model, tokens_BT):
  """The compiled gradient of the next-token loss w.r.t. `nnx.state(model, nnx.Param)` (adapters, or every weight)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p, r, t: cross_entropy(nnx.merge(graphdef, p, r)(t[:, :-1]), t[:, 1:])
  return jax.jit(jax.grad(loss)).lower(params, rest, jnp.asarray(tokens_BT)).compile()


def _dot_shapes(compiled) -> set:
  """The shapes of every `dot` result in the compiled HLO (fusions' bodies included)."""
  found = re.findall(r"= \w+\[([\d,]*)\]\S* dot\(", compiled.as_text())
  return {tuple(int(n) for n in s.split(",") if n) for s in found}


@pytest.mark.parametrize("method", tuple(peft.ADAPTERS))
def test_the_train_step_forms_no_frozen_weight_sized_product(method, monkeypatch):
  """No `dot` of the compiled adapter gradient yields a (fan_in, fan_out) array (or its transpose; behind any leading
  axes) of an adapted weight, while the merged form (W = W0 + ΔW, dL/dW projected) yields one for every weight; and
  the factorized step costs fewer flops (XLA's cost analysis) than the merged one. The 2·9 = 18 rows, 9 positions and
  r = 4 match no fan_in or fan_out."""
  model = _perturb(peft.apply(_model(), method, rank=4, alpha=8, r_p=2))
  weights = {a.w0.shape[-2:] for _, a in peft.adapters(model)}
  sized = lambda shapes: {w for w in weights for s in shapes if len(s) >= 2 and s[-2:] in (w, w[::-1])}
  tokens = np.random.default_rng(8).integers(0, 256, (2, 10))
  factorized = _compiled_grad(model, tokens)
  assert not sized(_dot_shapes(factorized))
  _merged_products(monkeypatch)
  merged = _compiled_grad(model, tokens)
  assert sized(_dot_shapes(merged)) == weights  # the check sees what it looks for
  assert factorized.cost_analysis()["flops"] < merged.cost_analysis()["flops"]


def test_factorized_sora_trains_on_a_mesh_as_on_one_device():
  """SORA's rotation (products over fan_out, which `tensor` splits) and the factorized Pre-Diag under FSDP + TP."""
  model = _perturb(peft.apply(_model(), "sora", rank=2, alpha=4, r_p=2))
  tokens = np.random.default_rng(4).integers(0, 256, (8, 9))
  want = _adapted_step(model, tokens)
  got = _adapted_step(model, tokens, make_mesh("fsdp=4,tensor=2"))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), got[1], want[1])
