"""Sampling with a KV cache (`models.generate`): greedy tokens equal transformers' `generate(do_sample=False)` on
every imported architecture and equal re-running the whole prefix per token; sampling is reproducible by seed and
respects top_k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models import from_hf
from models.generate import generate

PROMPT = np.random.default_rng(1).integers(0, 96, (2, 5))


def test_greedy_equals_transformers_and_the_uncached_loop(hf_checkpoints, hf_name):
  path, _ = hf_checkpoints[hf_name]
  hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  with torch.no_grad():
    want = hf.generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False, pad_token_id=0,
                       eos_token_id=None).numpy()
  model, _ = from_hf(path)
  got = np.asarray(generate(model, PROMPT, 12))
  np.testing.assert_array_equal(got, want)
  # no cache: the whole sequence again for every token (padded to the final length, so one compiled program:
  # causal attention makes the logits at t independent of the padding after it)
  seq, forward = np.pad(PROMPT, ((0, 0), (0, 12))), jax.jit(model)
  for t in range(PROMPT.shape[1] - 1, PROMPT.shape[1] + 11):
    seq[:, t + 1] = np.argmax(np.asarray(forward(jnp.asarray(seq)))[:, t], -1)
  np.testing.assert_array_equal(got, seq)


def test_sampling_is_seeded_and_top_k_restricts_the_choice(hf_checkpoints):
  model, _ = from_hf(hf_checkpoints["qwen3"][0])
  a = np.asarray(generate(model, PROMPT[0], 16, temperature=1.0, seed=3))
  assert a.shape == (5 + 16,) and (a[:5] == PROMPT[0]).all()
  np.testing.assert_array_equal(a, np.asarray(generate(model, PROMPT[0], 16, temperature=1.0, seed=3)))
  assert not np.array_equal(a, np.asarray(generate(model, PROMPT[0], 16, temperature=1.0, seed=4)))
  # top_k=1 is greedy whatever the temperature
  np.testing.assert_array_equal(np.asarray(generate(model, PROMPT, 8, temperature=5.0, top_k=1, seed=0)),
                                np.asarray(generate(model, PROMPT, 8)))
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    generate(model, PROMPT, 0)
