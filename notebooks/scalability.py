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
# # Does the data bound parallel scalability?
#
# Cheng et al. ("Dataset Matters", arXiv 1910.11510) argue that a dataset's characters — feature variance,
# sparsity, diversity, similarity along the sampling order — bound how far parallel training algorithms scale. Here
# synchronous SGD (`--sync allreduce`), local SGD / DiLoCo (`local:H`), gossip (`gossip`) and simulated asynchronous
# workers (`stale:TAU:random`) run with W workers on datasets built to differ in those characters: a convex case
# (logistic regression on scikit-learn's digits) and the `tiny` transformer on bytes. The speedup each reaches
# (steps to a target held-out loss, against one worker) sits beside the characters and the gradient noise scale,
# whose model predicts synchronous SGD's speedup. The experiment is `research/experiments/scalability/`; its
# full-size results are in [research/results/scalability/results.md](../research/results/scalability/results.md),
# made by `python -m research.experiments.scalability`.
#
# Here it runs at smoke size: one and two workers, a few steps, one seed — the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, scalability
from research.experiments.scalability import report

result = scalability.main(scalability.Config(smoke=True))
display(Markdown("\n".join(report.tables(result))))
for line in report.findings(result):
  print(line)

# %% [markdown]
# Speedup against the number of workers (dotted: linear), and DiLoCo's loss against the bytes its replicas send.

# %%
report.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("scalability")))
