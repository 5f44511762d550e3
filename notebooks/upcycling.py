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
# # Upcycling: dense → top-2-of-8 MoE
#
# Does a trained dense model turned into a mixture of experts (its FFN neurons split into 8 experts, randomly or
# by balanced k-means, LLaMA-MoE style) win back the loss the conversion costs, and does it beat the dense model
# trained on for the same tokens? The experiment is `research/experiments/upcycling.py`; its full-size results
# (3 seeds, a tuned lr per arm) are in
# [research/results/upcycling/results.md](../research/results/upcycling/results.md), made by
# `python -m research.experiments.upcycling`.
#
# Here it runs at smoke size: one seed, a few steps of batches of 4 × 32 bytes, the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, upcycling

result = upcycling.main(upcycling.Config(smoke=True))
run = result["seeds"][0]
print(f"split exactness (max relative error of Σ experts vs the dense FFN): {max(run['split_error'].values()):.1e}")
print(f"dense val loss before conversion: {run['dense_val']:.4f}")
for arm, r in run["arms"].items():
  at = "" if r["at_conversion"] is None else f"right after conversion {r['at_conversion']:.4f}, "
  print(f"{upcycling.LABELS[arm]:<30} {at}final {r['final']:.4f}")

# %% [markdown]
# Val loss against training step: the dense model's pretraining (dotted), then each arm after the conversion on
# the same batches; the MoE from scratch trains on the same batches from step 0.

# %%
fig = upcycling.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("upcycling")))
