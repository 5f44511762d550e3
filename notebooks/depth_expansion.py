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
# # Depth expansion: insert a zero-initialised block, train on
#
# Does inserting a zero-initialised block into the middle of a trained transformer, then training on, beat
# training the original model on for the same tokens, and how does that depend on the amount of training data?
# The experiment is `research/experiments/depth_expansion.py`; its full-size results (3 data sizes, 3 seeds) are in
# [research/results/depth_expansion/results.md](../research/results/depth_expansion/results.md), made by
# `python -m research.experiments.depth_expansion`.
#
# Here it runs at smoke size (one seed, 4,096 training bytes, a few steps), the same code path: train, insert a
# block whose output projections are zero (the function is unchanged), measure the gradient of those projections
# (the first-order descent condition), then continue both models on the same batches.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, depth_expansion

result = depth_expansion.main(depth_expansion.Config(smoke=True))
for by_seed in result["runs"].values():
  for seed, r in by_seed.items():
    ins = r["insertion"]
    print(f"n={r['n']} seed {seed}: val before / after insertion {ins['val_before']:.6f} / {ins['val_after']:.6f}")
    print("  ‖∂L/∂W‖ of the new block: " + ", ".join(f"{k} {v:.3g}" for k, v in ins["grad_new"].items())
          + f"; other new weights: max |grad| {ins['grad_other_max_abs']:g}")
    print("  after phase 2: " + ", ".join(f"{a} {v['final']:.4f}" for a, v in r["arms"].items()))

# %%
fig = depth_expansion.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("depth_expansion")))
