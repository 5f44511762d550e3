"""Optimizers as optax GradientTransformations. Pure optax: imports no models/ or research/."""

from optim.registry import (OPTIMIZERS, UnknownOptimizerError, decay_mask, get_optimizer, hyperparameters,
                            needs_prev_grads, register)
from optim.schedules import make_schedule
from optim.newton_schulz import COEFFICIENTS, coefficient_table, ns_flops, orthogonalize
from optim.muon import MuonState, muon, muon_labels, orthogonalize_tree, scale_by_muon, shape_scale
from optim.distributed import DistributedError, orthogonalize_distributed
from optim.mars import MarsError, MarsState, mars, mars_correction, mars_labels, muon_mvr, with_global_norm_clip
from optim.badam import BAdamError, BAdamState, badam, badam_adamw, badam_labels, block_index

__all__ = ["COEFFICIENTS", "MuonState", "OPTIMIZERS", "UnknownOptimizerError", "coefficient_table", "decay_mask",
           "get_optimizer", "hyperparameters", "make_schedule", "muon", "muon_labels", "ns_flops", "orthogonalize",
           "orthogonalize_tree", "register", "scale_by_muon", "shape_scale"]
__all__ += ["MarsError", "MarsState", "mars", "mars_correction", "mars_labels", "muon_mvr", "needs_prev_grads",
            "with_global_norm_clip"]
__all__ += ["DistributedError", "orthogonalize_distributed"]
__all__ += ["BAdamError", "BAdamState", "badam", "badam_adamw", "badam_labels", "block_index"]
