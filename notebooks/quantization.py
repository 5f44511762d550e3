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
# # Experiment: post-training quantization, CALM and loss-aware mixed precision
#
# A model pretrained here is quantized after training every way `models/quant.py` offers: RTN, GPTQ, AWQ and
# SmoothQuant at W3 (groups of 64) and W8A8; CALM's per-layer choice of algorithm by the CKA of each layer's output
# with full precision (`models/quant_select.py`), the same choice by MSE, and an oracle that asks the held-out loss
# itself, one layer at a time; and mixed-precision layouts (a width per layer and projection from {2, 3, 4, 8, 16})
# chosen by the first-order effect of the quantization noise on the loss, by HAWQ's Hessian trace, or uniform
# (`models/quant_mixed.py`). Everything is judged on held-out data; the calibration windows are drawn from the
# training split. The full protocol (`small` and `base`, 3 calibration seeds) is in
# `research/experiments/quantization.py`; its results are in
# [`research/results/quantization/`](../research/results/quantization/results.md). Here the same steps run at smoke
# size: a two-layer `tiny`, a few pretraining steps, one calibration seed.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import io

from IPython.display import Image, Markdown, display

from research.experiments import common, quantization

result = quantization.main(quantization.Config(smoke=True))
display(Markdown("\n".join(quantization.tables(result))))
display(Markdown("\n\n".join(quantization.findings(result))))

# %% [markdown]
# Held-out loss change against size on disk: circles are uniform algorithms, stars the per-layer choices (CALM, MSE,
# oracle), triangles the mixed-precision layouts. Below the line is below full precision.

# %%
png = io.BytesIO()
quantization.plot(result).savefig(png, format="png", dpi=100)
display(Image(png.getvalue()))

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.quantization` (`small` and `base` pretrained, 3 calibration seeds) wrote this:

# %%
display(Markdown(common.full_results("quantization")))
