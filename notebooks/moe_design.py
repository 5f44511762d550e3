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
# # MoE design at a fixed active-parameter budget
#
# How many experts, how fine-grained (expert width and top-k together) and whether a shared expert helps, with every
# arm holding the same active FFN width per token, compared with the published guidance (Switch Transformer and Clark
# et al. on the expert count, DeepSeekMoE, Krajewski et al. and OLMoE on fine-grained experts, DeepSeekMoE against
# OLMoE and Qwen3 on shared experts). The experiment is `research/experiments/moe_design.py`; its full-size results
# (3 seeds, a tuned lr per arm) are in
# [research/results/moe_design/results.md](../research/results/moe_design/results.md), made by
# `python -m research.experiments.moe_design`.
#
# Here it runs at smoke size: one seed, a few steps, the dense arm and two MoE arms, the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, moe_design

result = moe_design.main(moe_design.Config(smoke=True))
display(Markdown("\n".join(moe_design.tables(result))))
display(Markdown("\n\n".join(moe_design.findings(result))))

# %% [markdown]
# Val loss against the number of routed experts, one line per top-k (its expert width A/k); the dotted line is the
# dense FFN of the same active width.

# %%
fig = moe_design.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("moe_design")))
