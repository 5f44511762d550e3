"""Export an optlab run as a Hugging Face model directory (config.json + model.safetensors).

  python -m research.export runs/default runs/default_hf
  python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('runs/default_hf')"

The architecture is the one that represents the run's model exactly (`models.hf.architecture_of`: Llama, Qwen2,
Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE). A run trained with --tokenizer gets that tokenizer.json copied beside the
weights, so the directory is a complete Hugging Face model: the file config.json recorded (absolute), refused in one
line if it has gone or its sha256 is not the recorded one (`--tokenizer` names the one to copy instead); a run on bytes
(the built-in corpus, 256 ids = UTF-8 bytes) has no tokenizer.json.

The weights are written in `--dtype`, by default the dtype of the Hugging Face checkpoint the run was fine-tuned from
(a bfloat16 model fine-tuned with float32 trained weights goes back out in bfloat16), else the run's own (float32).

A --peft run is exported with its adapters merged into the weights, or with --adapter as the adapters alone in
Hugging Face PEFT's format (LoRA and DoRA; `models.to_hf_peft`), for `peft.PeftModel.from_pretrained(base, OUT)`:

  python -m research.export runs/lora runs/lora_adapter --adapter
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Annotated, Literal

import jax
import tyro
from flax import nnx

from models import HFError, peft, to_hf, to_hf_peft
from models.hf import ARCHITECTURES
from research import entry, flags
from research.data.tokenizer import HFTokenizer, TokenizerError, check_fits
from research.train.config.paths import tokenizer_file
from research.train.store.pretrained import LOAD_ERRORS, init_source, load_run, run_tokenizer, source_dtype

ARCHITECTURE = flags.Rule(choices=tuple(ARCHITECTURES))  # --architecture: those models.hf writes


@dataclasses.dataclass
class ExportConfig:
  """Write an optlab run's parameters (its newest checkpoint, or --step) in the Hugging Face format."""
  run_dir: tyro.conf.Positional[Annotated[str, flags.EXISTING]]
  out_dir: tyro.conf.Positional[Annotated[str, flags.OUT_DIR]]
  """Created; an existing non-empty directory is refused (nothing is overwritten)."""
  step: int | None = None
  """The checkpoint to export (default: the newest)."""
  architecture: Annotated[str | None, ARCHITECTURE] = None
  """Force an HF architecture (checked against the model); default: the one that represents it exactly."""
  adapter: bool = False
  """A --peft run's LoRA/DoRA adapters alone, in PEFT's adapter format (default: the merged model)."""
  dtype: Literal["float32", "bfloat16"] | None = None
  """The weights' dtype in the files (default: the --init-from Hugging Face checkpoint's, else the run's)."""
  tokenizer: Annotated[str | None, flags.EXISTING] = None
  """The tokenizer.json (or a directory with one) to write beside the weights (default: the run's own, checked)."""


def in_dtype(model, dtype: str):
  """`model` with its parameters cast to `dtype` and its config saying so (what research.export writes)."""
  if str(model.c.param_dtype) == dtype:
    return model
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), params), rest)
  model.c = dataclasses.replace(model.c, param_dtype=dtype)
  return model


def main(argv=None):
  cfg = tyro.cli(ExportConfig, args=argv)
  with entry.one_line_errors(*LOAD_ERRORS, TokenizerError):
    flags.check_config(cfg)
    model, _, step = load_run(cfg.run_dir, step=cfg.step, merge=not cfg.adapter)
    if cfg.adapter and not peft.adapters(model):
      raise HFError(f"--adapter: {cfg.run_dir} is not a --peft run")
    if cfg.adapter:
      path = to_hf_peft(model, cfg.out_dir, init_source(cfg.run_dir))
    else:
      tokenizer = tokenizer_file(cfg.tokenizer) if cfg.tokenizer else run_tokenizer(cfg.run_dir)  # checked first
      if tokenizer is not None:
        check_fits(HFTokenizer(tokenizer), model.c.vocab_size)
      path = to_hf(in_dtype(model, cfg.dtype or source_dtype(cfg.run_dir) or str(model.c.param_dtype)), cfg.out_dir,
                   cfg.architecture)
      if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(path, "tokenizer.json"))
  print(f"exported {cfg.run_dir} step {step} to {path}")


if __name__ == "__main__":
  entry.command(main)
