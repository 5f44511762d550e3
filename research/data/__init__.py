"""The data room: corpora (`corpus`), their tokenized forms (`tokenized`, `tokenizer`), batches (`batches`), the
second corpus (`docs_corpus`) and dataset statistics (`datastats`).

`load_corpus` is the one front door (bytes or a tokenizer's ids); the batch functions and the corpus types are
re-exported here, so `from research.data import load_corpus, get_batch, eval_batches` is all a trainer needs.
"""

from research.data.batches import ORDERS, eval_batches, get_batch
from research.data.corpus import SEPARATOR, Corpus, DataError, default_cache_dir, read_corpus
from research.data.tokenized import tokenize_corpus

__all__ = ["ORDERS", "SEPARATOR", "Corpus", "DataError", "default_cache_dir", "eval_batches", "get_batch",
           "load_corpus", "read_corpus", "tokenize_corpus"]


def load_corpus(path: str | None = None, *, cache_dir: str | None = None, val_fraction: float = 0.05,
                tokenizer: str | None = None) -> Corpus:
  """Loads the default stdlib corpus (path=None) or a user corpus, split into train and val.

  Args:
    path: None for the stdlib corpus; else a directory, a text file, a `.npy` or a `.bin`.
    cache_dir: where the stdlib corpus is cached; default `$OPTLAB_CACHE` or ~/.cache/optlab.
    tokenizer: a Hugging Face tokenizer.json (or a directory with one) to encode the text with instead of bytes;
      the tokens are cached under cache_dir (`research.data.tokenized`).
    val_fraction: share held out. Multi-file corpora split by document: a file is val iff
      int(sha256(relpath)) % 10_000 < val_fraction * 10_000, so the split does not move when
      files are added. Single arrays/files split by position: the last ceil(n*val_fraction)
      tokens are val.
  """
  corpus = read_corpus(path, cache_dir=cache_dir, val_fraction=val_fraction)
  return corpus if tokenizer is None else tokenize_corpus(corpus, tokenizer, cache_dir)
