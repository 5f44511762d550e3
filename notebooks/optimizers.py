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
# # Experiment 1: optimizers at equal tokens
#
# Which optimizer reaches the lowest validation loss on the `small` preset at equal tokens, each at its own best
# learning rate, and how many steps does each save over AdamW? The full-size protocol (an lr grid with one seed,
# then three seeds at each contender's best lr) is in `research/experiments/optimizers.py`; its committed results
# are in `research/results/optimizers/`. Here the same two stages run at smoke size: the `tiny` preset, 8 steps.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, optimizers

result = optimizers.main(optimizers.Config(smoke=True))
display(Markdown("\n".join(optimizers.tune_table(result["tune"], result["grid"]))))
display(Markdown("\n".join(optimizers.summary_table(result["summary"], result["target"]))))

# %%
optimizers.plot(result)
plt.show()

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.optimizers` (the first version: 8 contenders × 100 steps, about 40 runs, an hour and
# a half on 2 CPU cores; the current one: 14 contenders × 300 steps, about 70 runs, resumable across sessions) wrote
# this table. The ranking at half length against the end (Kendall τ; the pairs that swap) says whether the run was
# long enough; at smoke size:

# %%
print(result["ranking"])
display(Markdown(common.full_results("optimizers")))
