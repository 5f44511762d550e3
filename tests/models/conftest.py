"""Random tiny Hugging Face models, built locally with `transformers` (nothing downloaded), saved once per session.

Tests take `hf_name` (every supported architecture) or `hf_moe_name` (the MoE ones) as parameters and the
`hf_checkpoints` fixture: name -> (directory written by save_pretrained, transformers' logits on `HF_TOKENS`)."""

import numpy as np
import pytest

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, rope_theta=5000.0)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)
# each exercises what its architecture adds: head_dim != d/n, tying, biases, QK-norm, routing, shared expert
CONFIGS = {
    "llama": ("LlamaConfig", dict(COMMON, head_dim=12)),
    "llama_tied": ("LlamaConfig", dict(COMMON, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", COMMON),
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, **MOE, num_experts=4, shared_expert_intermediate_size=40)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, **MOE, num_experts=4, norm_topk_prob=True)),
}
MOE_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe")
HF_TOKENS = np.random.default_rng(0).integers(0, 96, (8, 11))


def pytest_generate_tests(metafunc):
  if "hf_name" in metafunc.fixturenames:
    metafunc.parametrize("hf_name", sorted(CONFIGS))
  if "hf_moe_name" in metafunc.fixturenames:
    metafunc.parametrize("hf_moe_name", MOE_NAMES)


@pytest.fixture(scope="session")
def hf_tokens():
  return HF_TOKENS


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
  import torch
  import transformers
  out = {}
  for name, (cls, kwargs) in CONFIGS.items():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs)).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a misplaced scale or bias
      for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path)
    with torch.no_grad():
      out[name] = path, model(torch.tensor(HF_TOKENS)).logits.numpy()
  return out
