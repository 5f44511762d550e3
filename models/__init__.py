"""Flax NNX language models that name logical axes only."""

from models import exfusion, padnet, peft, quant, quant_mixed, quant_select, quant_store, schema
from models.config import PRESETS, ConfigError, MoEConfig, TransformerConfig, count_params, flops_per_token, preset
from models.generate import generate
from models.hf import HFError, from_hf, to_hf
from models.moe import MoE, RouterBias, aux_loss, update_router_bias
from models.peft_hf import to_hf_peft
from models.surgery import SurgeryError, insert_block, to_moe, to_padnet, upcycle
from models.transformer import IGNORE_TARGET, Transformer, cross_entropy

__all__ = ["IGNORE_TARGET", "ConfigError", "MoE", "MoEConfig", "PRESETS", "RouterBias", "Transformer",
           "TransformerConfig", "aux_loss", "count_params", "cross_entropy", "flops_per_token", "preset",
           "update_router_bias"]
__all__ += ["SurgeryError", "insert_block", "to_moe", "to_padnet", "upcycle"]
__all__ += ["HFError", "from_hf", "generate", "to_hf"]
__all__ += ["peft", "to_hf_peft"]
__all__ += ["quant", "quant_mixed", "quant_select", "quant_store"]
__all__ += ["exfusion", "padnet", "schema"]
