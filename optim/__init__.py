"""Optimizers as optax GradientTransformations. Pure optax: imports no models/ or research/."""

from optim.registry import (OPTIMIZERS, UnknownOptimizerError, decay_mask, get_optimizer, hyperparameters,
                            register)
from optim.schedules import make_schedule
from optim.newton_schulz import COEFFICIENTS, coefficient_table, ns_flops, orthogonalize
from optim.muon import MuonState, muon, muon_labels, orthogonalize_tree, scale_by_muon, shape_scale
from optim.distributed import DistributedError, orthogonalize_distributed

__all__ = ["COEFFICIENTS", "MuonState", "OPTIMIZERS", "UnknownOptimizerError", "coefficient_table", "decay_mask",
           "get_optimizer", "hyperparameters", "make_schedule", "muon", "muon_labels", "ns_flops", "orthogonalize",
           "orthogonalize_tree", "register", "scale_by_muon", "shape_scale"]
__all__ += ["DistributedError", "orthogonalize_distributed"]
