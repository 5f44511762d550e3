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
# # Experiment 5: MoE-DisCo vs end-to-end MoE training at equal tokens
#
# MoE-DisCo (Ye, Cheng et al., arXiv 2601.06857) clusters the training data, trains one dense submodel (the shared
# backbone + one expert) per cluster independently, merges the submodels into the MoE and fine-tunes it briefly.
# Does it match end-to-end training at equal tokens, and does the clustering matter, or only the staging? The
# control trains the same way on a random partition of the same windows (same cluster sizes).
#
# The protocol (arms, token accounting, the lr grid, 3 seeds) is in `research/experiments/moe_disco.py`; the
# committed full-size results are in `research/results/moe_disco/`. Here the same code runs at smoke size: a few
# steps, one seed, one learning rate.

# %%
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# every training phase compiles its own step; a persistent cache lets equal phases share one compilation
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="optlab-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, moe_disco

result = moe_disco.main(moe_disco.Config(smoke=True))
display(Markdown("\n".join(moe_disco.tables(result))))
display(Markdown("\n\n".join(moe_disco.findings(result))))

# %% [markdown]
# Left: validation loss against training tokens. DisCo's S-phase curve is the submodels' mean loss against all
# submodels' tokens; the vertical step is the merge, the rest the G-phase. Right: after the S-phase, each
# submodel's loss on the validation windows of each k-means cluster (a low diagonal = specialists).

# %%
moe_disco.plot(result)
plt.show()

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.moe_disco` (an lr grid on seed 0, then seeds 0-2) wrote:

# %%
display(Markdown(common.full_results("moe_disco")))

# %% [markdown]
# ## From a pretrained start
#
# The paper's submodels start from a pretrained checkpoint. `python -m research.experiments.moe_disco --init
# pretrained` pretrains a dense model (d_ff = E·F) with the train CLI, upcycles it into the MoE for every seed
# (random neuron split, fresh router), and runs the same arms and controls from there; the random-init result above
# stays as it is. It wrote this:

# %%
display(Markdown(common.full_results("moe_disco_pretrained")))
