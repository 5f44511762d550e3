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
# # Experiment 6: BAdam vs AdamW — optimizer-state bytes and validation loss at equal steps
#
# BAdam (Luo, Yu & Li, arXiv 2404.02827) trains one block — a transformer layer, or the embedding — at a time with
# Adam and drops Adam's state at every switch, so it keeps moments for one block only. How much optimizer state does
# that save against AdamW, and what does it cost in held-out loss at equal steps? The full-size protocol (a deeper
# `tiny` trained from scratch, an lr grid at one seed, then three seeds at each one's best lr, and the state bytes of
# the `small` and `base` presets) is in `research/experiments/badam.py`; its committed results are in
# [`research/results/badam/`](../research/results/badam/results.md). Here the same steps run at smoke size: a
# 3-layer model, 8 steps, one lr and one seed.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import io

import matplotlib.pyplot as plt
from IPython.display import Image, Markdown, display

from research.experiments import badam, common

result = badam.main(badam.Config(smoke=True))
display(Markdown("\n".join(badam.tables(result))))
display(Markdown("\n\n".join(badam.findings(result))))

# %% [markdown]
# Left: validation loss of each contender at its best lr (the reference default, whose frozen tied embedding caps
# the logits, dashed, with its loss floor). Right: optimizer-state bytes per model, next to the parameters' own.

# %%
fig = badam.plot(result)
png = io.BytesIO()
fig.savefig(png, format="png", dpi=100)  # shown as a PNG: the sweep switches matplotlib to Agg, plt.show shows nothing
plt.close(fig)
display(Image(png.getvalue()))

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.badam` (16 training runs of a 6-layer `tiny`, 200 steps each) wrote this:

# %%
display(Markdown(common.full_results("badam")))
