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
# # PAD-Net: how much of an MoE's experts must stay dynamic?
#
# PAD-Net (He, Ding, Dong et al., ACL 2023) partitions a dynamic network's parameters into a dynamic part and a
# static part shared by all experts, W_e = λ_d·M⊙W_e + λ_s·(1 − M)⊙W_static, choosing the mask M by its Iterative
# Mode Partition at the start of fine-tuning; the paper reports a partly static MoE matching or beating the fully
# dynamic one. The experiment is `research/experiments/pad_net.py` (the layer is `models/padnet.py`): an MoE
# pretrained on the stdlib corpus is fine-tuned on the package-description corpus as it is and in PAD-Net form at
# dynamic shares of 100%, 50%, 30% and 10%. Its full-size results (3 seeds, a tuned lr per arm) are in
# [research/results/pad_net/results.md](../research/results/pad_net/results.md), made by
# `python -m research.experiments.pad_net`.
#
# Here it runs at smoke size: one seed, a few steps, the MoE and one share, the same code path.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from research.experiments import common, pad_net

result = pad_net.main(pad_net.Config(smoke=True))
for arm, r in result["seeds"][0]["arms"].items():
  print(f"{pad_net.label(arm):<36} dynamic entries {r['counts']['dynamic']:>7,}  IMP shares {r['shares']}  "
        f"docs val at start {r['start']['docs']:.4f}, after fine-tuning {r['final']:.4f}")
display(Markdown("\n".join(pad_net.tables(result))))

# %% [markdown]
# Left: the docs corpus' val loss during fine-tuning (step 0: right after the partition). Right: the final val loss
# against the number of expert entries left dynamic.

# %%
fig = pad_net.plot(result)
plt.show()

# %% [markdown]
# ## The full-size run

# %%
display(Markdown(common.full_results("pad_net")))
