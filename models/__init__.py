"""Flax NNX language models that name logical axes only."""

from models.config import PRESETS, ConfigError, TransformerConfig, count_params, flops_per_token, preset
from models.transformer import Transformer, cross_entropy

__all__ = ["ConfigError", "PRESETS", "Transformer", "TransformerConfig", "count_params", "cross_entropy", "flops_per_token",
           "preset"]
