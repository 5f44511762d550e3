"""Export an optlab run as a Hugging Face model directory (config.json + model.safetensors).

  python -m research.export runs/default runs/default_hf
  python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('runs/default_hf')"

The architecture is the one that represents the run's model exactly (`models.hf.architecture_of`: Llama, Qwen2,
Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE). A run on the built-in corpus has a byte-level vocabulary (256 ids = UTF-8
bytes); no tokenizer.json is written for it.
"""

from __future__ import annotations

import dataclasses
import sys

import tyro

from models import to_hf
from research.pretrained import LOAD_ERRORS, load_run


@dataclasses.dataclass
class ExportConfig:
  """Write an optlab run's parameters (its newest checkpoint, or --step) in the Hugging Face format."""
  run_dir: tyro.conf.Positional[str]
  out_dir: tyro.conf.Positional[str]
  """Created; an existing non-empty directory is refused (nothing is overwritten)."""
  step: int | None = None
  """The checkpoint to export (default: the newest)."""
  architecture: str | None = None
  """Force an HF architecture (checked against the model); default: the one that represents it exactly."""


def main(argv=None):
  cfg = tyro.cli(ExportConfig, args=argv)
  try:
    model, _, step = load_run(cfg.run_dir, step=cfg.step)
    path = to_hf(model, cfg.out_dir, cfg.architecture)
  except LOAD_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(f"exported {cfg.run_dir} step {step} to {path}")


if __name__ == "__main__":
  main()
