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
# # Experiment: the fine-tuning methods study (parameter-efficient fine-tuning, block optimizers, weight conditioning)
#
# A pretrained model is fine-tuned on a second corpus ten ways: full fine-tuning with AdamW and with Muon, the block
# optimizers BAdam, BREAD (low-rank) and BREAD-SGD (Luo et al., NeurIPS 2024 and 2025), and five adapters from
# `models/peft.py` at an equal trainable budget: LoRA, DoRA, Pre-Diag and SORA (Chang et al., "Calibrating and
# Rotating", AAAI 2026) and a SNIP-pruned sparse adapter (He et al., SparseAdapter). Each run is the train CLI with
# `--init-from` (and `--peft METHOD` for the adapters), as a user runs it: frozen weights in bfloat16, BAdam and
# BREAD (both modes) by the blockwise step. Beside learning and forgetting, each contender's step cost is measured side
# by side: matmul FLOPs against full AdamW's, train-state bytes per parameter, the peak estimate and the wall time per
# step (`research.bench finetune`'s measurements at the study's model and batch). Learning is the held-out loss on the
# new corpus (the package descriptions of `research/data/docs_corpus.py`), forgetting the held-out loss on the
# pretraining corpus (the standard library's Python source). The paper's claim is about the update
# ΔW = W_final − W_pretrained: DoRA raises its singular-value entropy toward full fine-tuning's, and Pre-Diag and SORA
# keep that more cheaply; the last table measures it. The full protocol (`small` pretrained, an lr grid per contender
# at one seed, three seeds at each one's best) is in `research/experiments/peft.py`; its results are in
# [`research/results/peft/`](../research/results/peft/results.md). Here the same steps run at smoke size: a
# one-layer `tiny`, a few steps, one lr, one seed, AdamW and the five adapters.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import io

from IPython.display import Image, Markdown, display

from research.experiments import common, peft

result = peft.main(peft.Config(smoke=True))
display(Markdown("\n".join(peft.tables(result))))
display(Markdown("\n\n".join(peft.findings(result))))

# %% [markdown]
# Left: the new corpus's validation loss during fine-tuning (step 0: the pretrained model), full fine-tuning solid,
# adapters dashed. Right: learning (x) against forgetting (y) at each one's best lr; the marker grows with H(ΔW).

# %%
png = io.BytesIO()
peft.plot(result).savefig(png, format="png", dpi=100)
display(Image(png.getvalue()))

# %% [markdown]
# ## The full-size result
#
# `python -m research.experiments.peft` (one pretraining run, 10 contenders over an lr grid each, then 3 seeds at each
# one's best) wrote this:

# %%
display(Markdown(common.full_results("peft")))
