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
# # ExFusion: train the FFNs as fused experts, deploy one dense FFN
#
# ExFusion (Ruan, Dong, Qu et al., IEEE TMM 2026) upcycles each FFN into several weighted experts at initialisation,
# fuses them in weight space for every forward pass (dense compute), and fuses them into one FFN after training, so
# inference costs what the dense model costs. The layer is `models/exfusion.py` (the fusion rule and the experts'
# initialisation are stated there: only the paper's abstract was readable); the experiment is
# `research/experiments/exfusion.py`: dense training against ExFusion with 2 and 4 experts (and 4 identical copies,
# the reparameterisation control) at equal steps, each evaluated as the deployed dense model. Its full-size results
# (3 seeds, a tuned lr per arm) are in [research/results/exfusion/results.md](../research/results/exfusion/results.md),
# made by `python -m research.experiments.exfusion`.
#
# Here it runs at smoke size: one seed, a few steps, the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, exfusion

result = exfusion.main(exfusion.Config(smoke=True))
for arm, r in result["seeds"][0]["arms"].items():
  print(f"{exfusion.label(arm):<44} val loss of the deployed model {r['final']:.4f}")
display(Markdown("\n".join(exfusion.tables(result))))

# %% [markdown]
# The val loss during training (for the ExFusion arms, of the expanded model before fusion; the fused model computes
# the same function).

# %%
fig = exfusion.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("exfusion")))
