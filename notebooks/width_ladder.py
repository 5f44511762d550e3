# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Does the win survive scale? A width ladder
#
# The rigorous optimizer benchmarks ("Fantastic Pretraining Optimizers", Wen et al. 2025; "Benchmarking Optimizers
# for LLM Pretraining", Semenov et al. 2025) tune every optimizer on its own at every scale and measure the speedup
# over AdamW as the data AdamW needs to reach the same loss. Here the same protocol runs on a ladder of widths of the
# `small` transformer: per width and contender an lr scan (the transfer plot), quasi-random trials over its other
# knobs, seeds at the optimum, every contender at AdamW's shorter budgets and AdamW at 2× and 4× its tokens (AdamW's
# runs give its fitted L(D), which then spans the contenders' losses; the others' part the speedup's trend with width
# from its trend with tokens per parameter, which move together along the ladder). Every group of runs of one shape
# trains in one vmapped program (`research/train/vmapped.py`). The verdicts (speedup with a t interval over seeds, on
# AdamW's fit and read between its runs with no law, the fit's lack-of-fit test, Welch's test, the lr optimum per
# width and how sharply the scan pins it, the speedup's exponents in width and tokens per parameter) come from
# `research.verdicts`. The experiment is
# `research/experiments/width_ladder/`; its full-size results are in
# [research/results/width_ladder/results.md](../research/results/width_ladder/results.md), made by
# `python -m research.experiments.width_ladder`.
#
# Here it runs at smoke size: two tiny widths, AdamW and Muon, a few steps — the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile

from IPython.display import Image, Markdown, display

from research.experiments import common, width_ladder
from research.experiments.width_ladder import plots, report, study, tables

result = width_ladder.main(width_ladder.Config(smoke=True))
cfg = study.Config(**width_ladder.SMOKE)
display(Markdown("\n".join(tables.tables(cfg, result["done"], result["verdicts"]))))
for line in report.findings(result["verdicts"]):
  print(line)

# %% [markdown]
# The speedup over AdamW against width (95% intervals over seeds), on AdamW's fitted L(D) and read between
# its runs, each contender's final loss against its learning rate at every width (µP's transfer plot), and the speedup
# at every budget against tokens per parameter, a line per width, both ways.

# %%
for path in plots.plots(cfg, result["done"], result["verdicts"], tempfile.mkdtemp()):
  display(Image(path))

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("width_ladder")))
