"""Optimizers as optax GradientTransformations. Pure optax: imports no models/ or research/."""

from optim.registry import (OPTIMIZERS, UnknownOptimizerError, decay_mask, get_optimizer, hyperparameters,
                            needs_prev_grads, register)
from optim.schedules import make_schedule
from optim.newton_schulz import COEFFICIENTS, coefficient_table, ns_flops, orthogonalize
from optim.muon import MuonState, muon, muon_labels, muon_with_adamw, orthogonalize_tree, scale_by_muon, shape_scale
from optim.distributed import DistributedError, orthogonalize_distributed
from optim.mars import MarsError, MarsState, mars, mars_correction, mars_labels, muon_mvr, with_global_norm_clip
from optim.trees import ParameterTreeError, leaf_name, path_name, reject_complex, resolve_labels
from optim.badam import BAdamError, BAdamState, badam, badam_adamw, badam_labels, block_index
from optim.alignment import (AlignmentError, cautious_mask, cautious_mgup_mask, cautious_policy, mgup_mask,
                             mgup_policy, topk_mask, with_alignment_mask)
from optim.mgup import mgup_adamw, mgup_lion, mgup_muon, scale_by_reference_adam
from optim.cautious import cautious_adamw, cautious_lion, cautious_muon

__all__ = ["AlignmentError", "badam", "badam_adamw", "badam_labels", "BAdamError", "BAdamState", "block_index",
           "cautious_adamw", "cautious_lion", "cautious_mask", "cautious_mgup_mask", "cautious_muon",
           "cautious_policy", "coefficient_table", "COEFFICIENTS", "decay_mask", "DistributedError", "get_optimizer",
           "hyperparameters", "make_schedule", "mars", "mars_correction", "mars_labels", "MarsError", "MarsState",
           "mgup_adamw", "mgup_lion", "mgup_mask", "mgup_muon", "mgup_policy", "muon", "muon_labels", "muon_mvr",
           "muon_with_adamw", "MuonState", "needs_prev_grads", "ns_flops", "OPTIMIZERS", "orthogonalize",
           "orthogonalize_distributed", "orthogonalize_tree", "ParameterTreeError", "path_name", "leaf_name",
           "register", "reject_complex", "resolve_labels", "scale_by_muon", "scale_by_reference_adam",
           "shape_scale", "topk_mask", "UnknownOptimizerError", "with_alignment_mask", "with_global_norm_clip"]
