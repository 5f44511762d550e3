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
# # Experiment 6b: BAdam fine-tuning a pretrained model — learning, forgetting and state bytes
#
# BAdam (Luo, Yu & Li, arXiv 2404.02827) is a fine-tuning method: one transformer layer trains at a time with Adam,
# the embedding and head stay frozen. Experiment 6 ran it from random init; here it runs in its own regime. A 6-layer
# `tiny` is pretrained on the standard library's Python source, then fine-tuned with `--init-from` on a second
# corpus, the package descriptions of optlab's runtime dependencies (`research/data/docs_corpus.py`: English prose and
# markup). Learning is the held-out loss on the new corpus, forgetting the held-out loss on the old one. The
# full-size protocol (an lr grid at one seed, three seeds at each one's best lr) is in
# `research/experiments/badam_finetune.py`; its results are in
# [`research/results/badam_finetune/`](../research/results/badam_finetune/results.md). Here the same steps run at
# smoke size: a 2-layer model, a few steps of pretraining and of fine-tuning, one lr and one seed.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import io

import matplotlib.pyplot as plt
from IPython.display import Image, Markdown, display

from research.experiments import badam_finetune, common

result = badam_finetune.main(badam_finetune.Config(smoke=True))
display(Markdown("\n".join(badam_finetune.tables(result))))
display(Markdown("\n\n".join(badam_finetune.findings(result))))

# %% [markdown]
# Left: the new corpus's validation loss during fine-tuning (at step 0, the pretrained model's). Right: each lr of the
# grid as a point (learning on x, forgetting on y); the star is the pretrained model. Down and left is better.

# %%
fig = badam_finetune.plot(result)
png = io.BytesIO()
fig.savefig(png, format="png", dpi=100)  # shown as a PNG: the sweep switches matplotlib to Agg, plt.show shows nothing
plt.close(fig)
display(Image(png.getvalue()))

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.badam_finetune` (one pretraining run, 14 fine-tuning runs) wrote this:

# %%
display(Markdown(common.full_results("badam_finetune")))
