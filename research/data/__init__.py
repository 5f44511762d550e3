"""The data room: corpora (`corpus`), their tokenized forms (`tokenized`, `tokenizer`), data in the formats it comes in
(`documents`, read into cached token shards by `shards`), batches (`batches`), the second corpus (`docs_corpus`) and
dataset statistics (`datastats`).

`load_corpus` is the one front door (bytes or a tokenizer's ids): the stdlib corpus, a text file, a directory of text
files, a `.npy` or `.bin` token array, or Parquet, JSON Lines, Arrow and `datasets` data named by paths and globs. The
batch functions and the corpus types are re-exported here, so `from research.data import load_corpus, get_batch,
eval_batches` is all a trainer needs.
"""

import glob
import os
from collections.abc import Sequence
from typing import cast

from research.data import documents
from research.data.batches import ORDERS, eval_batches, get_batch
from research.data.cache import default_cache_dir
from research.data.corpus import SEPARATOR, Corpus, DataError, read_corpus
from research.data.shards import build_shards
from research.data.tokenized import tokenize_corpus

__all__ = ["ORDERS", "SEPARATOR", "Corpus", "DataError", "build_shards", "default_cache_dir", "eval_batches",
           "get_batch", "load_corpus", "read_corpus", "tokenize_corpus"]


def load_corpus(path: str | Sequence[str] | None = None, *, cache_dir: str | None = None, val_fraction: float = 0.05,
                tokenizer: str | None = None, field: str = "text") -> Corpus:
  """Loads the default stdlib corpus (path=None) or a user corpus, split into train and val.

  Args:
    path: None for the stdlib corpus; a path; or a sequence of paths. One text file, one directory of text files,
      a `.npy` or a `.bin` is read as before (`read_corpus`, then `tokenize_corpus` with a tokenizer). Anything else —
      Parquet, JSON Lines (.jsonl, .json, gzipped), Arrow, a `datasets.save_to_disk` directory, a directory holding
      such files, a glob, several paths — is tokenized once into cached shards (`research.data.shards`), whose
      corpus also records each document's start.
    cache_dir: where built corpora and tokens are cached; default `$OPTLAB_CACHE` or ~/.cache/optlab.
    val_fraction: share held out. Multi-file corpora split by document: a text file is val iff
      int(sha256(relpath)) % 10_000 < val_fraction * 10_000, so the split does not move when files are added; a
      record of a structured file by the same rule on "name:row" (`research.data.shards`). Single arrays/files
      split by position: the last ceil(n*val_fraction) tokens are val.
    tokenizer: a Hugging Face tokenizer.json (or a directory with one) to encode the text with instead of bytes.
    field: the column (Parquet, Arrow) or key (JSON Lines) that holds each document's text.
  """
  paths = [path] if path is None or isinstance(path, (str, os.PathLike)) else list(path)
  if not paths:
    raise DataError("no data paths given")
  if len(paths) == 1 and (paths[0] is None or _read_as_before(paths[0])):
    corpus = read_corpus(paths[0], cache_dir=cache_dir, val_fraction=val_fraction)
    return corpus if tokenizer is None else tokenize_corpus(corpus, tokenizer, cache_dir)
  return build_shards(cast(list[str], paths), field=field, tokenizer=tokenizer, cache_dir=cache_dir,
                      val_fraction=val_fraction)


def _read_as_before(path) -> bool:
  """True for what `read_corpus` reads (and a missing path that is no glob, which it refuses in one line): a text
  file, a .npy, a .bin, or a directory with no structured file (a `.json` among text files stays text there)."""
  path = os.path.expanduser(os.fspath(path))
  if not os.path.exists(path):
    return not glob.has_magic(path)
  if not os.path.isdir(path):
    return documents.data_format(path) == "text"
  try:
    inputs = documents.expand([path])
  except DataError:  # an empty directory: read_corpus says so
    return True
  return not any(documents.data_format(p) != "text" and not p.lower().endswith(".json") for p in inputs)
