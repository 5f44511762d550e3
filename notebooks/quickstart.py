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
# # optlab quick start
#
# From a bare process to a trained, sharded transformer in five steps: devices, a mesh, a sharded
# model, a short training run, a loss curve. Everything runs on 8 simulated CPU devices, so a
# laptop is enough; the same calls run unchanged on 8 accelerators.

# %% [markdown]
# ## 1. Devices
#
# JAX can split the host CPU into several devices. The setting has to be made before anything
# touches a device: once the backend is up JAX refuses it with a `RuntimeError`, which we let
# pass so the notebook also runs in a kernel where JAX is already initialized (it then keeps
# the devices it has).

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # export JAX_PLATFORMS=cuda first to use 8 GPUs

import jax

try:
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:  # backend already up
  pass
print(jax.devices())

# %% [markdown]
# ## 2. A mesh
#
# `sharding.make_mesh` always builds the five axes `data, stage, fsdp, expert, tensor`; axes
# the spec leaves out have size 1. Here: 2-way data parallel x 2-way FSDP x 2-way tensor
# parallel. `tensor` is the last (fastest-varying) axis, so tensor-parallel partners are
# neighbouring devices.

# %%
import numpy as np

import sharding

mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
print(mesh)
print("device ids as [data, fsdp, tensor]:")
print(np.vectorize(lambda d: d.id)(mesh.devices).squeeze())

# %% [markdown]
# ## 3. A sharded model
#
# Models name *logical* axes only (`embed`, `mlp`, `heads`, ...); `sharding/rules.py` is the one
# table that maps them to mesh axes. `init_train_state` builds the model abstractly, derives a
# `NamedSharding` for every parameter and every optimizer moment, and then creates them inside
# `jit` already sharded, so no device ever holds a full copy.
#
# Parameter names carry their shapes: V vocab, D model width, N query heads, K key/value heads,
# H head dim, F MLP width; the leading axis of `blocks/*` stacks the layers.

# %%
from flax import nnx

import models
import optim


def model_fn():
  return models.Transformer(cfg, rngs=nnx.Rngs(0))


cfg = models.preset("tiny")
graphdef, state, shardings = sharding.init_train_state(model_fn, optim.get_optimizer("adamw", 3e-3), mesh)
print(f"tiny: {models.count_params(cfg):,} parameters, {cfg.n_layers} layers, d_model {cfg.d_model}\n")

_, _, names = sharding.logical_names(model_fn)
print(f"{'parameter':<18} {'shape':<16} {'logical axes':<38} PartitionSpec")
for path in [("embed_VD",), ("blocks", "wq_DQ"), ("blocks", "wk_DK"), ("blocks", "wo_QD"), ("blocks", "w_up_DF"),
             ("blocks", "w_down_FD"), ("blocks", "attn_norm")]:
  param, logical = state["params"], names
  for key in path:
    param, logical = param[key], logical[key]
  print(f"{'/'.join(path):<18} {str(param.shape):<16} {str(logical):<38} {param.sharding.spec}")

# %% [markdown]
# ## 4. Train
#
# `research.train.run` is the engine of the `python -m research.train` CLI: from a `TrainConfig`
# it builds the mesh, model and optimizer as above (plus a warmup + cosine learning-rate schedule
# and gradient clipping), trains on the byte-level corpus made of Python's own standard library
# (built once, then cached in `~/.cache/optlab`), evaluates on held-out bytes, and returns the
# logged metrics. It also writes `metrics.jsonl`, `config.json` and a checkpoint to `out`.

# %%
import tempfile

from research.train import TrainConfig, run

out = tempfile.mkdtemp(prefix="optlab-quickstart-")
records = run(TrainConfig(model="tiny", steps=20, batch_size=16, seq_len=64, mesh="data=2,fsdp=2,tensor=2", out=out,
                          eval_every=10, log_every=2, warmup_steps=2, progress=False))

print(f"{'step':>4} {'loss':>7} {'val_loss':>8} {'lr':>8} {'tokens/s':>9}")
for r in records:
  val = f"{r['val_loss']:8.4f}" if "val_loss" in r else " " * 8
  print(f"{r['step']:4d} {r['loss']:7.4f} {val} {r['lr']:8.2e} {r['tokens_per_s']:9.0f}")

# %% [markdown]
# ## 5. The loss curve
#
# Losses are in nats per byte; a uniform guess over 256 bytes scores ln 256 = 5.55.

# %%
import matplotlib.pyplot as plt

evals = [r for r in records if "val_loss" in r]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label="train")
ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o", label="val")
ax.set(xlabel="step", ylabel="loss (nats/byte)", title="tiny on data=2,fsdp=2,tensor=2")
ax.legend()
fig.savefig(os.path.join(out, "loss.png"), dpi=100)
plt.show()

print(f"loss: {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} "
      f"(steps {records[0]['step']} -> {records[-1]['step']})")
print(f"val_loss: {evals[0]['val_loss']:.4f} -> {evals[-1]['val_loss']:.4f}")
print(f"outputs in {out}")
