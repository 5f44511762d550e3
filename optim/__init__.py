"""Optimizers as optax GradientTransformations. Pure optax: imports no models/ or research/."""

from optim.schedules import make_schedule
from optim.registry import (OPTIMIZERS, UnknownOptimizerError, decay_mask, get_optimizer, hyperparameters,
                            register)

__all__ = ["OPTIMIZERS", "UnknownOptimizerError", "decay_mask", "get_optimizer", "hyperparameters", "make_schedule",
           "register"]
