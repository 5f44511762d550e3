"""Hugging Face import/export against `transformers` (torch, CPU, float32) on random tiny models built here.

For every supported architecture: logits on random tokens equal transformers' on one device and on sharded meshes
(fsdp=2,tensor=2; expert=4 for MoE); `from_hf(to_hf(m))` is bit-exact; an optlab model exported loads in
transformers with the same logits; configs and checkpoints the model cannot represent are refused by name.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import models
from models import HFError, from_hf, to_hf
from sharding import make_mesh


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _logits(model, tokens, mesh=None):
  if mesh is None:
    return np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
  graphdef, state = nnx.split(model)
  with jax.set_mesh(mesh):
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))


def test_logits_equal_transformers(hf_checkpoints, hf_tokens, hf_name):
  path, want = hf_checkpoints[hf_name]
  model, config = from_hf(path)
  assert (config.moe is not None) == hf_name.endswith(("moe", "mixtral"))
  np.testing.assert_allclose(_logits(model, hf_tokens), want, rtol=1e-4, atol=1e-5)


def _check_sharded(hf_checkpoints, hf_tokens, name, spec):
  path, want = hf_checkpoints[name]
  mesh = make_mesh(spec)
  model, _ = from_hf(path, mesh=mesh)
  state = nnx.state(model, nnx.Param)
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(state)}
  assert any(s != "PartitionSpec()" for s in specs), "nothing was sharded"
  np.testing.assert_allclose(_logits(model, hf_tokens, mesh=mesh), want, rtol=1e-4, atol=1e-5)


def test_sharded_import_fsdp_tensor(hf_checkpoints, hf_tokens, hf_name):
  _check_sharded(hf_checkpoints, hf_tokens, hf_name, "data=-1,fsdp=2,tensor=2")


def test_sharded_import_expert_parallel(hf_checkpoints, hf_tokens, hf_moe_name):
  _check_sharded(hf_checkpoints, hf_tokens, hf_moe_name, "data=-1,expert=4")
  if hf_moe_name == "qwen2_moe":
    _check_sharded(hf_checkpoints, hf_tokens, hf_moe_name, "data=2,expert=2,tensor=2")


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(hf_checkpoints, hf_tokens, hf_name, tmp_path):
  path, want = hf_checkpoints[hf_name]
  model, config = from_hf(path)
  out = to_hf(model, str(tmp_path / "out"))
  again, config2 = from_hf(out)
  assert config2 == config
  a, b = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(again, nnx.Param))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded).__name__ == json.load(open(os.path.join(path, "config.json")))["architectures"][0]
  np.testing.assert_allclose(_hf_logits(reloaded, hf_tokens), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", [
    models.preset("tiny", vocab_size=96),
    models.preset("tiny", vocab_size=96, qk_norm=False, tie_embeddings=False),
    models.preset("tiny", vocab_size=96, qk_norm=False, qkv_bias=True),
    models.preset("moe_tiny", vocab_size=96),
    models.preset("moe_tiny", vocab_size=96, qk_norm=False,
                  moe=models.MoEConfig(num_experts=4, top_k=2, d_expert=16, normalize_top_k=True)),
    models.preset("moe_tiny", vocab_size=96, qk_norm=False, qkv_bias=True,
                  moe=models.MoEConfig(num_experts=4, top_k=2, d_expert=16, num_shared=1, d_shared=24,
                                       shared_gate=True)),
], ids=["qwen3", "llama_untied", "qwen2", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_an_optlab_model_exports_with_its_logits(config, hf_tokens, tmp_path):
  model = models.Transformer(config, rngs=nnx.Rngs(1))
  out = to_hf(model, str(tmp_path / "export"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(_hf_logits(reloaded, hf_tokens), _logits(model, hf_tokens), rtol=1e-4, atol=1e-5)


def _edited(hf_checkpoints, tmp_path, name, config_edit=None, tensors_edit=None):
  src, _ = hf_checkpoints[name]
  dst = str(tmp_path / "edited")
  shutil.copytree(src, dst)
  if config_edit:
    cfg = json.load(open(os.path.join(dst, "config.json")))
    config_edit(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
  if tensors_edit:
    from safetensors.numpy import load_file, save_file
    t = load_file(os.path.join(dst, "model.safetensors"))
    tensors_edit(t)
    save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  return dst


@pytest.mark.parametrize("name,config_edit,tensors_edit,match", [
    ("llama", lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), None,
     "rope_scaling: rope type 'llama3' is not implemented"),
    ("llama", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), None,
     "rope_parameters: rope type 'yarn'"),
    ("qwen2", lambda c: c.update(use_sliding_window=True), None, "use_sliding_window=True: sliding-window"),
    ("mixtral", lambda c: c.update(sliding_window=4096), None, "sliding_window=4096"),
    ("llama", lambda c: c.update(architectures=["GPT2LMHeadModel"]), None, "architectures=\\['GPT2LMHeadModel'\\]"),
    ("llama", lambda c: c.update(attention_bias=True), None, "attention_bias=True"),
    ("llama", lambda c: c.update(hidden_act="gelu"), None, "hidden_act='gelu'"),
    ("qwen3_moe", lambda c: c.update(mlp_only_layers=[1]), None, "mlp_only_layers=\\[1\\]"),
    ("llama", None, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     "model.layers.1.self_attn.k_proj.weight: missing"),
    ("llama", None, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}),
     "model.layers.0.extra.weight: a tensor this LlamaForCausalLM config does not use"),
    ("llama", lambda c: c.update(intermediate_size=40), None,
     "mlp.gate_proj.weight: shape \\(48, 32\\), the config implies \\(40, 32\\)"),
])
def test_what_the_model_cannot_represent_is_refused_by_name(hf_checkpoints, tmp_path, name, config_edit,
                                                             tensors_edit, match):
  path = _edited(hf_checkpoints, tmp_path, name, config_edit, tensors_edit)
  with pytest.raises(HFError, match=match):
    model, _ = from_hf(path)
    nnx.to_pure_dict(nnx.state(model))  # arrays are read lazily: touch them


def test_missing_or_corrupt_files_are_one_line_errors(hf_checkpoints, tmp_path):
  with pytest.raises(HFError, match="config.json: not found"):
    from_hf(str(tmp_path))
  path = _edited(hf_checkpoints, tmp_path, "llama")
  with open(os.path.join(path, "model.safetensors"), "r+b") as f:
    f.truncate(100)
  with pytest.raises(HFError, match="cannot be read as safetensors"):
    from_hf(path)


def test_export_never_overwrites(hf_checkpoints, tmp_path):
  model, _ = from_hf(hf_checkpoints["llama"][0])
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  with pytest.raises(HFError, match="exists and is not empty; nothing was written"):
    to_hf(model, str(out))
  assert os.listdir(out) == ["keep.txt"]
  with pytest.raises(HFError, match="moe.router='sigmoid'"):
    to_hf(models.Transformer(models.preset("moe_tiny", moe=models.MoEConfig(num_experts=4, router="sigmoid")),
                             rngs=nnx.Rngs(0)), str(tmp_path / "x"))


def test_sharded_checkpoint_index(hf_checkpoints, hf_tokens, tmp_path):
  """A checkpoint split over several files with model.safetensors.index.json (how large models ship)."""
  src, want = hf_checkpoints["qwen3"]
  model = transformers.AutoModelForCausalLM.from_pretrained(src)
  model.save_pretrained(str(tmp_path / "split"), max_shard_size="20KB")
  assert os.path.exists(tmp_path / "split" / "model.safetensors.index.json")
  ours, _ = from_hf(str(tmp_path / "split"))
  np.testing.assert_allclose(_logits(ours, hf_tokens), want, rtol=1e-4, atol=1e-5)
