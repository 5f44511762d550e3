"""An adapted model's LoRA or DoRA adapters alone, in Hugging Face PEFT's adapter format.

`to_hf_peft(model, path)` writes `adapter_config.json` and `adapter_model.safetensors` that
`peft.PeftModel.from_pretrained(base, path)` loads onto the base model in the Hugging Face format (`models.to_hf` of
the unadapted model, or the --init-from directory it came from). Tensor names follow PEFT's state dict:
`base_model.model.<module>.lora_A.weight` (r, in), `lora_B.weight` (out, r) and, for DoRA,
`<module>.lora_magnitude_vector` (out,); ours are (in, r), (r, out), (out,) per layer (models/peft.py).

Refused, with the reason: adapters whose class declares no PEFT form (`models.peft.Adapter.HF` None: Pre-Diag, SORA
and sparse adapters, which PEFT has no adapter type for: export merged weights),
adapters of different ranks or alphas in one model (PEFT's rank_pattern is not written), and adapters on MoE
experts (transformers stores the experts of a layer fused, where PEFT's LoRA does not attach).
"""

from __future__ import annotations

import jax
import numpy as np

from models import peft
from models.hf import HFError, architecture_of, tensor_map, write_dir
from models.transformer import Transformer


def to_hf_peft(model: Transformer, path: str, base_model_name_or_path: str | None = None) -> str:
  """Writes the adapters of `model` to directory `path` in PEFT's adapter format.

  The files are adapter_config.json and adapter_model.safetensors, with each layer's A and B transposed to PEFT's
  (r, in) and (out, r) (and DoRA's magnitude vector), under the Hugging Face module names of the model's architecture.

  Args:
    model: a model adapted by `models.peft.apply` with a method whose class declares PEFT's form (`Adapter.HF`).
    path: the directory to write.
    base_model_name_or_path: recorded in adapter_config.json (PEFT's field); default None.

  Returns:
    `path`.

  Raises:
    HFError: when the model has no adapters, or adapters PEFT's format cannot hold: a kind without PEFT's form, a mix
      of kinds, different ranks or scales, or adapters on MoE experts.
  """
  found = peft.adapters(model)
  if not found:
    raise HFError("the model has no adapters (models.peft.apply first)")
  kinds = {type(a) for _, a in found}
  if any(k.HF is None for k in kinds) or len(kinds) > 1:
    kind_names = sorted(k.__name__ for k in kinds)
    held = [c.__name__ for c in peft.ADAPTERS.values() if c.HF is not None]
    raise HFError(f"PEFT's adapter format holds {' or '.join(held)} adapters, this model has "
                  f"{', '.join(kind_names)}; export the merged weights instead")
  kind, = kinds
  ranks = {(a.a_IR.shape[-1], a.scale) for _, a in found}
  if len(ranks) > 1:
    raise HFError(f"adapters of different ranks/scales {sorted(ranks)}: not written (no rank_pattern support)")
  (rank, scale), = ranks
  names = tensor_map(model.c, architecture_of(model.c))
  tensors, modules = {}, set()
  for path_, a in found:
    template = names[tuple(path_.split("/"))][0]
    if "{e}" in template:
      raise HFError(f"{path_}: adapters on MoE experts have no PEFT adapter form in transformers (the experts are "
                    f"fused); export the merged weights instead")
    module = "base_model.model." + template.removesuffix(".weight")
    modules.add(template.removesuffix(".weight").rsplit(".", 1)[-1])
    a_LIR, b_LRO = (np.asarray(jax.device_get(x[...]), np.float32) for x in (a.a_IR, a.b_RO))
    for layer in range(a_LIR.shape[0]):
      m = module.format(l=layer)
      tensors[f"{m}.lora_A.weight"] = np.ascontiguousarray(a_LIR[layer].T)
      tensors[f"{m}.lora_B.weight"] = np.ascontiguousarray(b_LRO[layer].T)
      tensors.update({f"{m}.{suffix}": t for suffix, t in a.hf_tensors(layer).items()})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(scale * rank),
            "target_modules": sorted(modules), **(kind.HF or {}), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "base_model_name_or_path": base_model_name_or_path}
  return write_dir(path, {"adapter_model.safetensors": tensors, "adapter_config.json": config})
