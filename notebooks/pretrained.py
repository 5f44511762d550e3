# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Pretrained models: import, fine-tune, sample, export
#
# The path a Hugging Face checkpoint takes through optlab, end to end, on a random tiny Llama built here (nothing is
# downloaded): write it in the Hugging Face format, import it onto a mesh, fine-tune it with the train CLI's
# `run`, sample from the fine-tuned run with a KV cache, and export the result back to the Hugging Face format.
# The same calls take a real checkpoint directory (`config.json` + `*.safetensors`).

# %%
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

try:
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:  # backend already up
  pass
work = tempfile.mkdtemp(prefix="optlab-pretrained-")
print(len(jax.devices()), "devices; files in", work)

# %% [markdown]
# ## 1. A tiny Llama in the Hugging Face format
#
# `models.to_hf` writes `config.json` and `model.safetensors` the way `transformers` saves a `LlamaForCausalLM`:
# grouped-query attention (4 query heads, 2 key/value heads), an untied head, a byte-sized vocabulary.

# %%
import json

from flax import nnx

import models

llama = models.TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                 tie_embeddings=False)
hf_dir = models.to_hf(models.Transformer(llama, rngs=nnx.Rngs(0)), os.path.join(work, "tiny-llama"))
print(sorted(os.listdir(hf_dir)))
print({k: v for k, v in json.load(open(os.path.join(hf_dir, "config.json"))).items()
       if k in ("architectures", "hidden_size", "num_key_value_heads", "tie_word_embeddings")})

# %% [markdown]
# ## 2. Import it onto a mesh
#
# `models.from_hf` reads each parameter shard by shard straight onto its devices; the logical rules decide the
# layout (here the query projection split over `fsdp` rows and `tensor` columns).

# %%
import sharding

mesh = sharding.make_mesh("fsdp=2,tensor=2", devices=jax.devices()[:4])
model, config = models.from_hf(hf_dir, mesh=mesh)
print(config == llama, model.blocks.wq_DQ[...].sharding.spec)

# %% [markdown]
# ## 3. Fine-tune it
#
# `--init-from hf:PATH` takes the model config from the checkpoint and starts a fresh optimizer (Muon here) on the
# built-in corpus; `--freeze` could keep parts fixed. The run directory resumes like any other run.

# %%
from research.train import TrainConfig, run

ft_dir = os.path.join(work, "finetune")
records = run(TrainConfig(init_from=f"hf:{hf_dir}", optimizer="muon", lr=1e-2, steps=30, batch_size=8, seq_len=64,
                          eval_every=10, log_every=1, mesh="data=2,fsdp=2,tensor=2", progress=False, out=ft_dir))
print(f"loss: {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")

# %%
from IPython.display import Image

from research.plot import plot, read_metrics

Image(plot({"finetune": read_metrics(ft_dir)}, os.path.join(work, "curves.png")))

# %% [markdown]
# ## 4. Sample from the fine-tuned run
#
# `models.generate` keeps a KV cache: one prefill of the prompt, then one token's work per new token. A run on the
# built-in corpus reads and writes UTF-8 bytes.

# %%
from research.train.store.pretrained import load_model

tuned, _, tok = load_model(ft_dir)
out = models.generate(tuned, tok.encode("def "), 60, temperature=0.8, top_k=20, seed=0)
print("sampled:", repr(tok.decode(out)))

# %% [markdown]
# ## 5. Export it back
#
# `python -m research.export RUN_DIR OUT_DIR` does this from the shell. The export loads in `transformers`
# (`AutoModelForCausalLM.from_pretrained(OUT_DIR)`); here it is read back with `from_hf` and gives the same logits.

# %%
import numpy as np

exported = models.to_hf(tuned, os.path.join(work, "finetune-hf"))
back, _ = models.from_hf(exported)
tokens = np.asarray(out)[None, :32]
same = np.array_equal(np.asarray(back(tokens)), np.asarray(tuned(tokens)))
print("exported to", exported, "| round trip gives the same logits:", same)
