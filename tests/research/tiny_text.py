"""What the data tests share: a small directory of UTF-8 text files (`DOCS`, `write_docs`) and a byte-level BPE
tokenizer trained locally on any texts (`byte_bpe`), so nothing is downloaded."""

import os

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

DOCS = {f"doc{i}.txt": f"def f{i}(x):\n    return x * {i} + 1  # café {i}\n" * (3 + i) for i in range(12)}


def write_docs(folder):
  """`folder` (created) holding `DOCS`, one file each; returns it."""
  folder.mkdir()
  for name, text in DOCS.items():
    (folder / name).write_text(text)
  return folder


def byte_bpe(path, texts, vocab_size=300) -> Tokenizer:
  """A byte-level BPE trained on `texts` with [UNK] and <|endoftext|>, saved as `path` (its folder created)."""
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "<|endoftext|>"]))
  os.makedirs(os.path.dirname(str(path)), exist_ok=True)
  tok.save(str(path))
  return tok
