"""Optimizers as optax GradientTransformations. Pure optax: imports no models/ or research/."""

from optim import orthogonalizers
from optim.adamuon import AdaMuonState, adamuon, scale_by_adamuon
from optim.alignment import (
                            AlignmentError,
                            cautious_mask,
                            cautious_mgup_mask,
                            cautious_policy,
                            mgup_mask,
                            mgup_policy,
                            topk_mask,
                            with_alignment_mask,
)
from optim.badam import (
                            BAdamError,
                            BAdamState,
                            badam,
                            badam_adamw,
                            badam_labels,
                            block_index,
                            block_plan,
                            switches_before,
)
from optim.bread import BreadError, BreadState, bread, bread_adamw, factor_delta, factor_grads, init_factors
from optim.cautious import cautious_adamw, cautious_lion, cautious_muon
from optim.dion import DionError, DionState, dion, dion_rank, right_factor_spec, scale_by_dion
from optim.distributed import DistributedError, orthogonalize_distributed
from optim.kron import KronError, KronState, kron, kron_draws, precond_update_prob_schedule, scale_by_kron
from optim.mars import MarsError, MarsState, mars, mars_correction, mars_labels, muon_mvr, with_global_norm_clip
from optim.mgup import mgup_adamw, mgup_lion, mgup_muon, scale_by_reference_adam
from optim.muon import MuonState, muon, muon_labels, muon_with_adamw, orthogonalize_tree, scale_by_muon, shape_scale
from optim.muon_clip import QKClipError, head_scales, muonclip, qk_clip
from optim.needs import Blockwise, Inactive, Needs
from optim.newton_schulz import COEFFICIENTS, coefficient_table, ns_flops, orthogonalize
from optim.normuon import NorMuonState, normuon, scale_by_normuon
from optim.registry import (
                            DEFAULT_OPTIMIZER,
                            OPTIMIZERS,
                            UnknownOptimizerError,
                            decay_mask,
                            get_optimizer,
                            hyperparameters,
                            needs,
                            needs_max_logits,
                            needs_prev_grads,
                            register,
)
from optim.schedules import make_schedule
from optim.scion import ScionError, ScionState, lmo_direction, scale_by_scion, scion, scion_labels
from optim.soap import SoapError, SoapState, scale_by_soap, soap, soap_labels
from optim.trees import ParameterTreeError, leaf_name, path_name, reject_complex, resolve_labels

__all__ = ["DEFAULT_OPTIMIZER", "Blockwise", "Inactive", "needs", "Needs",
           "block_plan", "switches_before", "factor_delta", "factor_grads", "init_factors", "adamuon", "AdaMuonState",
           "AlignmentError", "badam", "badam_adamw", "badam_labels", "BAdamError",
           "BAdamState", "block_index", "bread", "bread_adamw", "BreadError", "BreadState", "cautious_adamw",
           "cautious_lion", "cautious_mask", "cautious_mgup_mask",
           "cautious_muon", "cautious_policy", "coefficient_table", "COEFFICIENTS", "decay_mask", "dion",
           "dion_rank", "DionError", "DionState", "DistributedError", "get_optimizer", "head_scales",
           "hyperparameters", "kron", "kron_draws", "KronError", "KronState", "leaf_name", "lmo_direction",
           "make_schedule", "mars", "mars_correction", "mars_labels", "MarsError", "MarsState", "mgup_adamw",
           "mgup_lion", "mgup_mask", "mgup_muon", "mgup_policy", "muon", "muon_labels", "muon_mvr",
           "muon_with_adamw", "muonclip", "MuonState", "needs_max_logits", "needs_prev_grads", "normuon",
           "NorMuonState", "ns_flops", "OPTIMIZERS", "orthogonalize", "orthogonalize_distributed",
           "orthogonalize_tree", "orthogonalizers", "ParameterTreeError", "path_name",
           "precond_update_prob_schedule", "qk_clip", "QKClipError", "register", "reject_complex", "resolve_labels",
           "right_factor_spec", "scale_by_adamuon", "scale_by_dion", "scale_by_kron", "scale_by_muon",
           "scale_by_normuon", "scale_by_reference_adam", "scale_by_scion", "scale_by_soap", "scion", "scion_labels",
           "ScionError", "ScionState", "shape_scale", "soap", "soap_labels", "SoapError", "SoapState", "topk_mask",
           "UnknownOptimizerError", "with_alignment_mask", "with_global_norm_clip"]
