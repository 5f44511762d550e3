"""Corpora encoded with a Hugging Face tokenizer: the tokens equal the tokenizer's own encoding of every document,
the cache is built once (uint16 or uint32 by vocab), a half-written cache is never used, and bad input is refused."""

import os

import numpy as np
import pytest
from tiny_text import DOCS, byte_bpe, write_docs
from tokenizers import Tokenizer, models, pre_tokenizers

from research.data import DataError, load_corpus


@pytest.fixture()
def corpus_dir(tmp_path):
  return write_docs(tmp_path / "text")


def _bpe(tmp_path, vocab_size=300):  # a byte-level BPE trained on DOCS
  path = tmp_path / f"bpe{vocab_size}.json"
  return str(path), byte_bpe(path, DOCS.values(), vocab_size)


def test_tokens_are_the_tokenizers_encoding_of_each_document(corpus_dir, tmp_path):
  path, tok = _bpe(tmp_path)
  c = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=path, cache_dir=str(tmp_path / "cache"))
  byte_corpus = load_corpus(str(corpus_dir), val_fraction=0.3)
  assert c.vocab_size == tok.get_vocab_size() and c.train.dtype == np.uint16 and isinstance(c.train, np.memmap)
  eot = tok.token_to_id("<|endoftext|>")
  for tokens, raw in ((c.train, byte_corpus.train), (c.val, byte_corpus.val)):
    docs = [d.decode() for d in bytes(raw).split(b"\0") if d]
    want = np.concatenate([tok.encode(d, add_special_tokens=False).ids + [eot] for d in docs])
    np.testing.assert_array_equal(tokens, want)
  again = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=path, cache_dir=str(tmp_path / "cache"))
  assert again.fingerprint == c.fingerprint != byte_corpus.fingerprint
  assert len(os.listdir(tmp_path / "cache")) == 1


def test_an_unwritable_cache_is_one_warning_and_the_same_tokens(corpus_dir, tmp_path):
  """A cache that is a file (or read-only): the tokens are encoded in memory, one warning says nothing is cached."""
  path, _ = _bpe(tmp_path)
  cached = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=path, cache_dir=str(tmp_path / "cache"))
  (tmp_path / "blocked").write_text("a file")
  with pytest.warns(UserWarning, match=r"the cache .*blocked cannot be written \(a file, not a directory\)") as w:
    c = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=path, cache_dir=str(tmp_path / "blocked"))
  assert len(w) == 1, [str(x.message) for x in w]
  assert c.fingerprint == cached.fingerprint and c.vocab_size == cached.vocab_size
  np.testing.assert_array_equal(c.train, cached.train)
  assert (tmp_path / "blocked").read_text() == "a file"


def test_cache_is_per_tokenizer_atomic_and_wide_vocabularies_use_uint32(corpus_dir, tmp_path):
  cache = tmp_path / "cache"
  a, _ = _bpe(tmp_path)
  words = sorted({w for text in DOCS.values() for w in text.split()})
  other = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
  other.pre_tokenizer = pre_tokenizers.Whitespace()
  b = str(tmp_path / "words.json")
  other.save(b)
  fa = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=a, cache_dir=str(cache)).fingerprint
  fb = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=b, cache_dir=str(cache)).fingerprint
  assert fa != fb and len(os.listdir(cache)) == 2
  folder = cache / sorted(os.listdir(cache))[0]
  os.remove(folder / "meta.json")  # as if the build died before its last write
  (folder / "train.bin").write_bytes(b"garbage")
  rebuilt = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=a, cache_dir=str(cache))
  assert rebuilt.fingerprint in (fa, fb) and (folder / "meta.json").exists()
  wide = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
  wide.pre_tokenizer = pre_tokenizers.Whitespace()
  wide.save(str(tmp_path / "wide.json"))
  c = load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=str(tmp_path / "wide.json"), cache_dir=str(cache))
  assert c.train.dtype == np.uint32 and c.vocab_size == 70_001


def test_bad_tokenizer_input_is_refused(corpus_dir, tmp_path):
  with pytest.raises(DataError, match="tokenizer not found"):
    load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=str(tmp_path / "none.json"))
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(DataError, match="not a Hugging Face tokenizer"):
    load_corpus(str(corpus_dir), val_fraction=0.3, tokenizer=str(tmp_path / "bad.json"))
  np.save(tmp_path / "toks.npy", np.arange(1000, dtype=np.int32) % 300)
  path, _ = _bpe(tmp_path)
  with pytest.raises(DataError, match="already tokens"):
    load_corpus(str(tmp_path / "toks.npy"), tokenizer=path)
