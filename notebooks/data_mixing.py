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
# # Dynamic data mixing for MoE tuning
#
# Zhu, Dong, Qu et al. (NAACL 2025) move the sampling weights of the datasets in an MoE's tuning mixture toward the
# datasets the router treats least like the others (Algorithm 1, from each dataset's expert loads). The experiment is
# `research/experiments/data_mixing.py`: a dense model pretrained on the stdlib corpus, upcycled into a top-2-of-8
# MoE, tuned on stdlib + package descriptions + package licenses with uniform, size-proportional and dynamic weights
# (the trainer's `--mix` sampler, `research/data/mixture.py`). Its full-size results (3 seeds, a tuned lr per arm) are
# in [research/results/data_mixing/results.md](../research/results/data_mixing/results.md), made by
# `python -m research.experiments.data_mixing`.
#
# Here it runs at smoke size: a one-layer `tiny`, a few steps, one seed, the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, data_mixing

result = data_mixing.main(data_mixing.Config(smoke=True))
display(Markdown("\n".join(data_mixing.tables(result))))
for arm, r in result["seeds"][0]["arms"].items():
  print(f"{arm:<8} weights over the run: {r['weights']}")

# %% [markdown]
# Left: each corpus's held-out loss after tuning, per weighting. Right: the dynamic weights over the steps.

# %%
fig = data_mixing.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("data_mixing")))
