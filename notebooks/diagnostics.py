# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # In-step diagnostics: per-layer statistics, sharpness and the gradient noise scale
#
# How big is each layer's update relative to its weights, how sharp is the loss against the edge of stability 2/lr,
# and how noisy is the gradient? The trainer answers inside its compiled step, on the steps of each diagnostic's
# cadence (`--watch`, `--spectra-every`, `--sharpness-every`, `--gns-every`; the site's page *In-step diagnostics*,
# `docs/diagnostics.md`), and the same functions, `optim.diagnostics`, run on any parameter tree from a notebook.
# The full-size study (AdamW, Muon and NorMuon on `small`, and what watching costs) is
# `research/experiments/diagnostics.py`, its results in `research/results/diagnostics/results.md`. Here: the 2-layer
# `tiny` preset for 6 steps, data-parallel over the devices, with the per-layer statistics, the sharpness and the
# noise scale at cadence 2.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import io
import tempfile

import matplotlib.pyplot as plt
from IPython.display import Image, Markdown, display

from research.experiments import common, diagnostics
from research.plot import heatmap, read_metrics
from research.train import TrainConfig, run
from research.train.observers.sharpness import ALPHAS

out = tempfile.mkdtemp(prefix="optlab-diagnostics-")
lr = diagnostics.CONTENDERS["adamw"]
run(TrainConfig(model="tiny", steps=6, batch_size=16, seq_len=32, eval_batches=1, eval_every=6,
                log_every=6, warmup_steps=1, mesh="data=-1", optimizer="adamw", lr=lr, out=out, progress=False,
                tracker=("none",),
                # the observers: --watch params,grads,updates --watch-every 2 --sharpness-every 2 ... --gns-every 2
                watch=("params,grads,updates",), watch_every=2, sharpness_every=2, sharpness_iters=5,
                sharpness_rows=8, gns_every=2, gns_groups=2))
records = read_metrics(out)  # metrics.jsonl: every observed step is logged
for r in records:
  print(r["step"], sorted({k.split("/")[0] for k in r if "/" in k}))

# %% [markdown]
# ## Per-layer statistics (`--watch`)
#
# Each watched leaf stacks its layers (its leading logical axis is `layers`), so every statistic is a list with one
# number per layer: here the last observed step's update RMS over the learning rate and the relative update
# ‖ΔW‖/‖W‖ of the hidden matrices.

# %%
last = [r for r in records if "watch/updates/rms/blocks/wq_DQ" in r][-1]
leaves = sorted(k.split("/", 3)[3] for k in last if k.startswith("watch/updates/rms/blocks/w"))  # not the norms
rows = ["| leaf | layer | RMS(W) | RMS(grad) | RMS(ΔW) / lr | ‖ΔW‖/‖W‖ |", "|---|---|---|---|---|---|"]
for leaf in leaves:
  for layer, (w, g, u, rel) in enumerate(zip(last[f"watch/params/rms/{leaf}"], last[f"watch/grads/rms/{leaf}"],
                                             last[f"watch/updates/rms/{leaf}"], last[f"watch/relative_update/{leaf}"])):
    rows.append(f"| {leaf} | {layer} | {w:.3g} | {g:.3g} | {u / last['lr']:.3g} | {rel:.3g} |")
display(Markdown(f"Step {last['step']}, lr {last['lr']:.3g}\n\n" + "\n".join(rows)))

# %% [markdown]
# The same numbers over the steps, one panel per parameter, layers against steps (`python -m research.plot RUN
# --heatmap watch/updates/rms` draws it from a run directory):

# %%
display(Image(heatmap(records, "watch/relative_update", os.path.join(out, "heatmap.png"), "tiny, adamw"), width=800))

# %% [markdown]
# ## Sharpness (`--sharpness-every`) and the gradient noise scale (`--gns-every`)
#
# λ_max is the top Hessian eigenvalue on 8 held-out rows (power iteration); gradient descent is stable below 2/lr
# (Cohen et al. 2021). B_simple = tr(Σ)/|G|² (McCandlish et al. 2018) from the batch's 2 halves and the whole, its EMA
# over the measurements beside it.

# %%
sharp = [r for r in records if "sharpness/lambda_max" in r]
rows = ["| step | λ_max | 2/lr | uᵀHu/uᵀu | overlap | B_simple | B_simple (EMA) |", "|---|---|---|---|---|---|---|"]
for r in sharp:
  rows.append(f"| {r['step']} | {r['sharpness/lambda_max']:.3g} | {2 / max(r['lr'], 1e-12):.3g} | "
              f"{r['sharpness/update_curvature']:.3g} | {r['sharpness/overlap']:.2g} | {r['gns/b_simple']:.3g} | "
              f"{r['gns/b_simple_ema']:.3g} |")
display(Markdown("\n".join(rows)))

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(ALPHAS, sharp[-1]["sharpness/interpolation"], "o-")
ax.set(xlabel="α (1 = the step taken)", ylabel="held loss at params + α·update",
       title=f"the loss along the update, step {sharp[-1]['step']}")
png = io.BytesIO()
fig.savefig(png, format="png", dpi=90, bbox_inches="tight")  # a PNG: research.plot switched matplotlib to Agg
plt.close(fig)
display(Image(png.getvalue()))

# %% [markdown]
# ## The library on any tree: `optim.diagnostics`
#
# The observers are thin: each calls these pure functions on the step's trees. On the run's trained parameters,
# read back from its checkpoint: the hidden matrices' spectra (what `--spectra-every` logs of the updates), per-layer
# statistics split along the logical axis names, and the top Hessian eigenvalue of a loss closed over one batch.

# %%
import jax
from flax import nnx

from models import Transformer, cross_entropy
from optim import muon_labels
from optim.diagnostics import layers, sharpness, spectra
from optim.trees import path_name
from research.data import get_batch, load_corpus
from research.train.store.pretrained import load_run
from sharding import logical_names

model, cfg, step = load_run(out)  # one device
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
params = nnx.to_pure_dict(params)
names = logical_names(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))[2]  # the logical axes, per leaf

hidden = {path_name(p) for p, lab in jax.tree_util.tree_leaves_with_path(muon_labels(params)) if lab == "muon"}
spec = jax.jit(lambda p: spectra.matrix_spectra(p, select=hidden.__contains__))(params)
stats = layers.tree_stats(params, names)
print(f"{'matrix':<18} {'layer':>5} {'RMS':>8} {'σ_max':>8} {'eff. rank':>9} {'orth. error':>11}")
for leaf, s in sorted(spec.items()):
  for layer in range(cfg.n_layers):
    print(f"{leaf:<18} {layer:>5} {float(stats[leaf]['rms'][layer]):8.4f} {float(s['spectral_norm'][layer]):8.3f} "
          f"{float(s['effective_rank'][layer]):9.1f} {float(s['orthogonality_error'][layer]):11.3f}")

x, y = get_batch(load_corpus().train, 0, 0, 4, 32)
loss = lambda p: cross_entropy(nnx.merge(graphdef, p, rest)(x), y)
at_batch, (lam, v) = jax.jit(lambda p: (loss(p), sharpness.top_eigenvalue(loss, p, iters=10)))(params)
print(f"\nstep {step}: loss {float(at_batch):.4f} on one training batch, top Hessian eigenvalue {float(lam):.3g} "
      f"(2/lr = {2 / records[-1]['lr']:.3g} at the last step's lr)")

# %% [markdown]
# `result` (what the experiment's `summarize` makes of this run's records) is the notebook's summary.

# %%
result = {"rows": [diagnostics.summarize("adamw", records, lr)], "cost": {}}
print({k: round(v, 4) for k, v in result["rows"][0].items() if isinstance(v, float)})

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.diagnostics` (AdamW, Muon and NorMuon on `small`, 300 steps each, and the default
# run's throughput with observers off and on) wrote this:

# %%
display(Markdown(common.full_results("diagnostics")))
