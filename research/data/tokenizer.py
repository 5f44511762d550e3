"""Text <-> token ids: the byte-level vocabulary of the built-in corpus (256 ids, one per UTF-8 byte), or a Hugging
Face `tokenizer.json` through the `tokenizers` library."""

from __future__ import annotations

import os


class TokenizerError(ValueError):
  """A tokenizer that cannot be loaded or does not fit the model."""


class ByteTokenizer:
  """Ids are the UTF-8 bytes of the text (what `research.data` trains on when no tokenizer is given)."""
  vocab_size = 256
  name = "bytes"

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A `tokenizers.Tokenizer` from a tokenizer.json (or a directory holding one)."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise TokenizerError(f"{file}: not found (pass a tokenizer.json or a directory with one)")
    try:
      self.tok = Tokenizer.from_file(file)
    except Exception as e:
      raise TokenizerError(f"{file}: not a Hugging Face tokenizer ({str(e).splitlines()[0]})") from None
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
    self.name = file

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text).ids

  def decode(self, ids) -> str:
    return self.tok.decode([int(i) for i in ids])


def load_tokenizer(path: str | None):
  """ByteTokenizer for None, else the HF tokenizer at `path`."""
  return ByteTokenizer() if path is None else HFTokenizer(path)


def check_fits(tokenizer, vocab_size: int):
  if tokenizer.vocab_size > vocab_size:
    raise TokenizerError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {vocab_size}")
