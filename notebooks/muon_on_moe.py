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
# # Muon on MoE experts: per expert, flattened, or AdamW?
#
# An MoE layer stores its experts as stacks `(L, E, d_in, d_out)`. Muon orthogonalizes "each matrix", and which
# matrix that is decides the update every expert gets:
#
# - **per_expert**: Newton–Schulz batched over (L, E), Moonlight scale 0.2·√max(d_in, d_out) from each expert's
#   own shape (what `optim.muon` does);
# - **flat_stack**: a layer's experts as one (E·d_in, d_out) matrix: the stack has RMS 0.2, split between the
#   experts by their gradient share;
# - **moonlight_toy**: Moonlight's `view(E, -1)` with the scale from `shape[:2]`: every expert's RMS is
#   0.2·√max(E, d_in)/√(d_in·d_out), about 5.7× too small here;
# - **adamw_experts**: AdamW on the experts, Muon elsewhere; **adam_at_muon_lr**: Adam on the experts at
#   Keller's Muon lr 0.02 (the old optax fallback for ≥ 3-D parameters).
#
# Below, the experiment at smoke size (12 steps of `moe_tiny`, one lr, two seeds: enough to see the update
# sizes, not to rank the arms). The full-size numbers (lr grid, three seeds, 200 steps) are in
# [research/results/muon_on_moe/results.md](../research/results/muon_on_moe/results.md), made by
# `python -m research.experiments.muon_on_moe`.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, muon_on_moe

result = muon_on_moe.main(muon_on_moe.Config(smoke=True))
print(f"{result['tokens_per_run']:,} training tokens per run, {len(result['runs'])} runs, "
      f"{result['seconds']:.0f} s")

# %% [markdown]
# ## Update size per expert
#
# "expert RMS" is the RMS of each expert's update direction with the learning rate and weight decay removed
# (`d = −u/lr_t − wd·W`), averaged over steps after warmup, layers and experts. Moonlight's target is 0.2; the
# quintic Newton–Schulz iteration leaves singular values in about [0.68, 1.13], so per_expert measures a little
# under 0.2. The "rare / busy" column compares the experts in the lowest and highest load decile.

# %%
display(Markdown("\n".join(muon_on_moe.table(result)[:2 + len(result["arms"])])))

# %%
fig = muon_on_moe.plot(result)
plt.show()

# %% [markdown]
# ## Full-size results
#
# The committed table from the full run, if this checkout has it.

# %%
display(Markdown(common.full_results("muon_on_moe")))

# %% [markdown]
# ## The stress setting: attention logits and MuonClip
#
# `python -m research.experiments.muon_on_moe --stress`: `moe_tiny` without QK-norm (as Kimi K2, whose MLA has
# none), 1000 steps, the lr grid ×3 higher, each step's largest attention logit logged, and a third arm, per-expert
# Muon with QK-clip at τ = 100 (`optim.muonclip`'s step). Results in `research/results/muon_on_moe_stress/`.

# %%
display(Markdown(common.full_results("muon_on_moe_stress")))

