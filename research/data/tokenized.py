"""A text corpus re-encoded with a Hugging Face tokenizer, built once and cached on disk.

`tokenize_corpus(corpus, tokenizer_path)` takes the byte corpus of `research.data.corpus` (documents joined by the
separator byte), encodes every document with the tokenizer (`tokenizers`, batched, in the library's threads) and
joins them with the tokenizer's end-of-text token when it has one. The token arrays are stored as uint16 when the
vocabulary fits (≤ 65,536 ids), else uint32, in `<cache>/tokens-<key>/`, where the key hashes the byte corpus's
fingerprint and the tokenizer file: the same text and tokenizer hit the cache, anything else gets its own. Files
are written to temporary names and renamed, `meta.json` last, so a crash mid-build leaves no cache that looks
valid; later loads memory-map the arrays, once a process has checked them against meta.json (sizes, and the sha256 of
their contents against its fingerprint: `cache.checked_meta`); a cache that fails is encoded again, with one warning
line. The corpus fingerprint is the tokens' (as for any corpus).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from research.data.cache import checked_meta, default_cache_dir, warn_rebuild
from research.data.corpus import SEPARATOR, Corpus, DataError, corpus_fingerprint, write_cache

_VERSION = 1
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _encode(tokens_u8: np.ndarray, tok, eot: int | None, dtype) -> np.ndarray:
  docs = [d.decode("utf-8", errors="replace") for d in bytes(tokens_u8).split(bytes([SEPARATOR])) if d]
  parts = []
  for i in range(0, len(docs), 1024):
    for enc in tok.encode_batch(docs[i:i + 1024], add_special_tokens=False):
      parts.append(np.asarray(enc.ids + ([eot] if eot is not None else []), dtype))
  return np.concatenate(parts) if parts else np.zeros(0, dtype)


def open_tokenizer(path: str):
  """(tokenizers.Tokenizer, the tokenizer file's bytes, its path) for a tokenizer.json or a directory holding one; the
  bytes go into cache keys, so an edited tokenizer builds a new cache."""
  from tokenizers import Tokenizer
  file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
  try:
    with open(file, "rb") as f:
      raw = f.read()
    tok = Tokenizer.from_str(raw.decode("utf-8"))
  except OSError:
    raise DataError(f"tokenizer not found: {file}") from None
  except Exception as e:
    raise DataError(f"{file}: not a Hugging Face tokenizer ({str(e).splitlines()[0]})") from None
  return tok, raw, file


def end_of_text(tok) -> int | None:
  """The id of the first of END_OF_TEXT the tokenizer knows (the token that ends each document), else None."""
  return next((tok.token_to_id(t) for t in END_OF_TEXT if tok.token_to_id(t) is not None), None)


def token_dtype(vocab_size: int):
  """uint16 when every id fits (vocab ≤ 65,536), else uint32: half the disk and page cache for common vocabularies."""
  return np.uint16 if vocab_size <= 2 ** 16 else np.uint32


def tokenize_corpus(corpus: Corpus, tokenizer_path: str, cache_dir: str | None = None) -> Corpus:
  """`corpus` (bytes) encoded with the tokenizer at `tokenizer_path` (a tokenizer.json or a directory with one)."""
  if corpus.vocab_size != 256 or corpus.train.dtype != np.uint8:
    raise DataError(f"{corpus.source} is already tokens (vocab {corpus.vocab_size}); a tokenizer applies to text")
  tok, raw, file = open_tokenizer(tokenizer_path)
  vocab = tok.get_vocab_size(with_added_tokens=True)
  dtype = token_dtype(vocab)
  eot = end_of_text(tok)
  key = hashlib.sha256(json.dumps([_VERSION, corpus.fingerprint, hashlib.sha256(raw).hexdigest()]).encode())
  cache_root = os.path.expanduser(cache_dir or default_cache_dir())
  folder = os.path.join(cache_root, f"tokens-{key.hexdigest()[:24]}")
  source = f"{corpus.source} tokenized by {os.path.realpath(file)}"
  cached, problem = _read(folder, dtype)
  if cached is not None:
    return _corpus(cached, vocab, source, eot)
  if problem:
    warn_rebuild(folder, problem)
  train, val = (_encode(part, tok, eot, dtype) for part in (corpus.train, corpus.val))
  for name, part in (("train", train), ("val", val)):
    if len(part) == 0:
      raise DataError(f"the {name} split of {corpus.source} encodes to no tokens")
  meta = dict(fingerprint=corpus_fingerprint(train, val), train_tokens=len(train), val_tokens=len(val),
              dtype=np.dtype(dtype).name, vocab_size=vocab, end_of_text=eot, text=corpus.fingerprint,
              tokenizer=os.path.realpath(file))
  cached = write_cache(cache_root, folder, train, val, meta) and _read(folder, dtype)[0]  # serve the memmaps
  # (a cache that cannot be written: one warning, encoded again next time; the arrays in memory are served)
  return _corpus(cached or (train, val, meta["fingerprint"]), vocab, source, eot)


def _corpus(cached, vocab, source, eot) -> Corpus:
  train, val, fingerprint = cached
  return Corpus(train, val, vocab, fingerprint, source, eos=eot)


def _read(folder, dtype):
  """((train memmap, val memmap, fingerprint), None) when meta.json is there and the files are what it records
  (`checked_meta`), else (None, what failed; None when there is no meta.json)."""
  size = np.dtype(dtype).itemsize
  meta, problem = checked_meta(folder, lambda m: {"train.bin": m["train_tokens"] * size,
                                                  "val.bin": m["val_tokens"] * size})
  if meta is None:
    return None, problem
  if meta.get("dtype") != np.dtype(dtype).name:
    return None, f"meta.json records dtype {meta.get('dtype')}, the tokenizer's vocabulary needs {np.dtype(dtype).name}"
  return (*(np.memmap(os.path.join(folder, n), dtype=dtype, mode="r") for n in ("train.bin", "val.bin")),
          meta["fingerprint"]), None
