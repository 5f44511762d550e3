"""Sample text from an optlab run or a Hugging Face model directory (`models.generate`, KV cache).

  python -m research.sample runs/default --prompt "def main(" --max-new-tokens 200
  python -m research.sample path/to/hf_model --prompt "Once upon a time" --temperature 0   # greedy
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import tyro

from models import generate
from research import entry, flags
from research.data.tokenizer import TokenizerError
from research.train.store.pretrained import LOAD_ERRORS, load_model


@dataclasses.dataclass
class SampleConfig:
  """Continue a prompt with a trained model (an optlab run directory or a Hugging Face model directory)."""
  path: tyro.conf.Positional[Annotated[str, flags.EXISTING]]
  """An optlab run directory (its newest checkpoint) or a Hugging Face model directory."""
  prompt: Annotated[str, flags.FREE] = "def "
  """The text to continue."""
  max_new_tokens: int = 128
  """Tokens to generate (no stop token: always this many)."""
  temperature: float = 0.8
  """Softmax temperature; 0 = greedy."""
  top_k: int | None = 50
  """Sample among the k most likely tokens (None: all)."""
  seed: int = 0
  """Sampling seed: the same seed gives the same text."""
  tokenizer: Annotated[str | None, flags.EXISTING] = None
  """A tokenizer.json (or a directory with one); default: the one a run was trained with (the file its config.json
  records, refused if it has changed since), the HF directory's own, else UTF-8 bytes."""
  samples: int = 1
  """Continuations to draw (one batch)."""


def main(argv=None):
  cfg = tyro.cli(SampleConfig, args=argv)
  with entry.one_line_errors(*LOAD_ERRORS, TokenizerError):
    flags.check_config(cfg)
    model, config, tok = load_model(cfg.path, tokenizer=cfg.tokenizer)
    ids = tok.encode(cfg.prompt)
    if not ids:
      raise ValueError("the prompt encodes to no tokens")
    top_k = None if cfg.top_k is None else min(cfg.top_k, config.vocab_size)
    out = generate(model, [ids] * cfg.samples, cfg.max_new_tokens, temperature=cfg.temperature, top_k=top_k,
                   seed=cfg.seed)
  for row in out.tolist():
    print(cfg.prompt + tok.decode(row[len(ids):]))
    if cfg.samples > 1:
      print("-" * 40)


if __name__ == "__main__":
  entry.command(main)
