"""Training data in the formats it comes in (research/data/documents.py, shards.py): the same records written as
Parquet, JSON Lines (plain, gzipped, `.json`), Arrow (IPC file and stream) and `datasets` directories give the token
stream and document starts of an independent reference (the split rule from its spec, `Tokenizer.encode` per
document), text files split as `read_corpus` splits a text directory, the cache is keyed, locked and never
half-valid, and bad input is a one-line DataError."""

import gzip
import hashlib
import json
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_text import byte_bpe
from tokenizers import Tokenizer, models, pre_tokenizers

from research.data import DataError, build_shards, documents, load_corpus, shards

DOCS = [f"def f{i}(x):\n    return x * {i}  # café {'é' * (i % 5)}\n" * (1 + i % 4) for i in range(300)]
DOCS[7] = ""  # an empty record: no tokens, no document, but it still counts as a row
PARTS = {"part0": DOCS[:100], "part1": DOCS[100:220], "part2": DOCS[220:]}
FRACTION = 0.25


def _held(key, fraction=FRACTION):  # the split rule as the module docstring states it
  return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 10_000 < fraction * 10_000


def _reference(entries, encode, eos, fraction=FRACTION):
  """{split: (tokens, starts)} from (key, document) pairs in stream order; empty documents are skipped."""
  out = {"train": ([], []), "val": ([], [])}
  for key, doc in entries:
    if doc:
      tokens, starts = out["val" if _held(key, fraction) else "train"]
      starts.append(len(tokens))
      tokens += encode(doc) + [eos]
  return out


def _rows(parts=PARTS):
  return [(f"{stem}:{i}", doc) for stem, docs in parts.items() for i, doc in enumerate(docs)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):  # a byte-level BPE trained on DOCS: (path, tokenizer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  return str(path), byte_bpe(path, DOCS)


def _encoder(tok):  # (encode, eos, dtype) as the reference sees them
  if tok is None:
    return (lambda d: list(d.encode())), 0, np.uint8
  return (lambda d: tok.encode(d, add_special_tokens=False).ids), tok.token_to_id("<|endoftext|>"), np.uint16


def _parquet(folder, stem, docs):
  pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), folder / f"{stem}.parquet",
                 row_group_size=37)


def _jsonl(folder, stem, docs, suffix=".jsonl", opener=open):
  with opener(folder / f"{stem}{suffix}", "wt", encoding="utf-8") as f:
    for i, doc in enumerate(docs):
      f.write(json.dumps({"id": i, "text": doc}) + "\n" + ("\n" if i == 3 else ""))  # a blank line is no record


def _arrow(folder, stem, docs, stream=False):
  table = pa.table({"id": list(range(len(docs))), "text": docs})
  new = pa.ipc.new_stream if stream else pa.ipc.new_file
  with new(str(folder / f"{stem}.arrow"), table.schema) as w:
    w.write_table(table, max_chunksize=37)


def _datasets(folder, stem, docs):
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs}).save_to_disk(str(folder / stem))


WRITERS = {
    "parquet": _parquet,
    "jsonl": _jsonl,
    "jsonl.gz": lambda d, s, docs: _jsonl(d, s, docs, ".jsonl.gz", gzip.open),
    "json": lambda d, s, docs: _jsonl(d, s, docs, ".json"),
    "arrow-file": _arrow,
    "arrow-stream": lambda d, s, docs: _arrow(d, s, docs, stream=True),
    "datasets": _datasets,
}


def _write(tmp_path, fmt, parts=PARTS):
  folder = tmp_path / fmt
  folder.mkdir()
  for stem, docs in parts.items():
    WRITERS[fmt](folder, stem, docs)
  return folder


def _check(c, want, dtype, eos):
  """`c` holds exactly the reference's tokens and starts; every start follows an eos."""
  assert c.train.dtype == dtype and c.eos == eos and isinstance(c.train, np.memmap)
  for split in ("train", "val"):
    tokens, starts = want[split]
    np.testing.assert_array_equal(getattr(c, split), np.asarray(tokens, dtype))
    docs = getattr(c, f"{split}_docs")
    assert docs.dtype == np.int64
    np.testing.assert_array_equal(docs, starts)
    assert docs[0] == 0 and (getattr(c, split)[docs[1:] - 1] == eos).all() and getattr(c, split)[-1] == eos
  want_fp = hashlib.sha256(np.asarray(c.train).tobytes() + np.asarray(c.val).tobytes()).hexdigest()
  assert c.fingerprint == want_fp


@pytest.mark.parametrize("fmt", WRITERS)
@pytest.mark.parametrize("tokenized", [False, True], ids=["bytes", "bpe"])
def test_every_format_gives_the_reference_tokens(fmt, tokenized, bpe, tmp_path, monkeypatch):
  monkeypatch.setattr(documents, "BATCH", 16)  # batches that straddle row groups, record batches and files
  folder = _write(tmp_path, fmt)
  # A directory of .json files stays a text directory (read_corpus), so those are named by a glob.
  path = str(folder / "*.json") if fmt == "json" else str(folder)
  tok = bpe[1] if tokenized else None
  c = load_corpus(path, val_fraction=FRACTION, tokenizer=bpe[0] if tokenized else None,
                  cache_dir=str(tmp_path / "cache"))
  encode, eos, dtype = _encoder(tok)
  want = _reference(_rows(), encode, eos)
  _check(c, want, dtype, eos)
  assert c.vocab_size == (300 if tokenized else 256)
  n_val = len(c.val_docs) / (len(c.train_docs) + len(c.val_docs))
  assert 0.15 < n_val < 0.35 and len(c.train_docs) + len(c.val_docs) == len(DOCS) - 1
  again = load_corpus(path, val_fraction=FRACTION, tokenizer=bpe[0] if tokenized else None,
                      cache_dir=str(tmp_path / "other"))  # built afresh elsewhere: deterministic
  assert again.fingerprint == c.fingerprint


@pytest.mark.parametrize("tokenized", [False, True], ids=["bytes", "bpe"])
def test_text_files_split_as_a_text_directory(tokenized, bpe, tmp_path):
  folder = tmp_path / "txt"
  folder.mkdir()
  names = [f"doc{i:03d}.txt" for i in range(len(DOCS))]
  for name, doc in zip(names, DOCS):
    (folder / name).write_text(doc, encoding="utf-8")
  tokenizer = bpe[0] if tokenized else None
  c = load_corpus([str(folder / "*.txt")], val_fraction=FRACTION, tokenizer=tokenizer, cache_dir=str(tmp_path / "c"))
  encode, eos, dtype = _encoder(bpe[1] if tokenized else None)
  _check(c, _reference(list(zip(names, DOCS)), encode, eos), dtype, eos)
  (folder / names[7]).unlink()  # read_corpus keeps an empty file as a lone separator; the shards skip it
  before = load_corpus(str(folder), val_fraction=FRACTION, tokenizer=tokenizer, cache_dir=str(tmp_path / "c"))
  assert before.train_docs is None and before.eos == eos  # the single-directory path, as before
  np.testing.assert_array_equal(c.train, before.train)
  np.testing.assert_array_equal(c.val, before.val)
  assert c.fingerprint == before.fingerprint


def test_wide_vocabularies_use_uint32(tmp_path):
  words = [f"w{i}" for i in range(70_000)]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)} | {"[UNK]": 70_000, "<|endoftext|>": 70_001},
                                   unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "wide.json"))
  docs = [" ".join(f"w{(i * 7919 + j * 104_729) % 70_000}" for j in range(5 + i % 7)) for i in range(120)]
  _parquet(tmp_path, "wide", docs)
  c = build_shards(str(tmp_path / "wide.parquet"), tokenizer=str(tmp_path / "wide.json"), val_fraction=FRACTION,
                   cache_dir=str(tmp_path / "cache"))
  want = _reference([(f"wide:{i}", d) for i, d in enumerate(docs)], lambda d: tok.encode(d).ids, 70_001)
  _check(c, want, np.uint32, 70_001)
  assert c.vocab_size == 70_002 and int(c.train.max()) > 2 ** 16


def _counting(monkeypatch, fail_at=None, delay=0.0):
  """Wraps shards._encode: counts its calls, raises on call `fail_at`, sleeps `delay` per call."""
  calls, real = [], shards._encode

  def encode(*args):
    calls.append(1)
    if fail_at is not None and len(calls) >= fail_at:
      raise RuntimeError("encoder broke")
    time.sleep(delay)
    return real(*args)

  monkeypatch.setattr(shards, "_encode", encode)
  return calls


def test_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, monkeypatch):
  folder, cache = _write(tmp_path, "parquet"), str(tmp_path / "cache")
  first = load_corpus(str(folder), val_fraction=FRACTION, cache_dir=cache)
  _counting(monkeypatch, fail_at=1)  # any encoding now fails: a hit must not encode
  hit = load_corpus(str(folder), val_fraction=FRACTION, cache_dir=cache)
  assert hit.fingerprint == first.fingerprint and isinstance(hit.val_docs, np.memmap)
  np.testing.assert_array_equal(hit.train_docs, first.train_docs)
  path = folder / "part1.parquet"
  st = os.stat(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # same bytes, newer mtime
  with pytest.raises(RuntimeError, match="encoder broke"):
    load_corpus(str(folder), val_fraction=FRACTION, cache_dir=cache)
  with pytest.raises(RuntimeError, match="encoder broke"):  # another val_fraction, another cache
    load_corpus(str(folder), val_fraction=0.3, cache_dir=cache)
  monkeypatch.undo()
  _parquet(folder, "part1", PARTS["part1"] + ["one more document"])  # a changed size and content
  grown = load_corpus(str(folder), val_fraction=FRACTION, cache_dir=cache)
  _check(grown, _reference(_rows(PARTS | {"part1": PARTS["part1"] + ["one more document"]}), *_encoder(None)[:2]),
         np.uint8, 0)
  assert grown.fingerprint != first.fingerprint


def test_globs_and_several_paths_combine(tmp_path):
  a, b = _write(tmp_path, "parquet", {"part0": PARTS["part0"], "part1": PARTS["part1"]}), tmp_path / "more"
  b.mkdir()
  _jsonl(b, "extra", PARTS["part2"])
  c = load_corpus([str(a / "*.parquet"), str(b / "extra.jsonl"), str(a / "part0.parquet")], val_fraction=FRACTION,
                  cache_dir=str(tmp_path / "cache"))  # part0 named twice: read once
  keys = [(f"{k}:{i}", d) for k, docs in (("part0", PARTS["part0"]), ("part1", PARTS["part1"]),
                                          ("extra", PARTS["part2"])) for i, d in enumerate(docs)]
  _check(c, _reference(keys, *_encoder(None)[:2]), np.uint8, 0)
  assert documents.expand([str(a / "part*.parquet"), str(a)]) == [str(a / "part0.parquet"), str(a / "part1.parquet")]
  reordered = load_corpus([str(b / "extra.jsonl"), str(a)], val_fraction=FRACTION, cache_dir=str(tmp_path / "cache"))
  assert reordered.fingerprint != c.fingerprint and len(reordered.train) == len(c.train)  # argument order = order


def test_an_interrupted_build_leaves_no_valid_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(documents, "BATCH", 16)
  folder, cache = _write(tmp_path, "jsonl"), tmp_path / "cache"
  _counting(monkeypatch, fail_at=5)
  with pytest.raises(RuntimeError, match="encoder broke"):
    load_corpus(str(folder), val_fraction=FRACTION, cache_dir=str(cache))
  (built,) = cache.iterdir()
  assert sorted(os.listdir(built)) == ["lock"]  # no meta.json, no shards, no temporary files
  monkeypatch.undo()
  monkeypatch.setattr(documents, "BATCH", 16)
  calls = _counting(monkeypatch)
  c = load_corpus(str(folder), val_fraction=FRACTION, cache_dir=str(cache))
  assert len(calls) == 20  # ceil(100/16) + ceil(120/16) + ceil(80/16) batches: rebuilt from scratch
  _check(c, _reference(_rows(), *_encoder(None)[:2]), np.uint8, 0)
  with open(built / "val.bin", "r+b") as f:
    f.truncate(10)  # a damaged shard under a valid meta.json is not served
  assert load_corpus(str(folder), val_fraction=FRACTION, cache_dir=str(cache)).fingerprint == c.fingerprint
  assert len(calls) == 40


def test_two_builders_of_one_cache_build_it_once(tmp_path, monkeypatch):
  monkeypatch.setattr(documents, "BATCH", 16)
  folder, cache = _write(tmp_path, "jsonl"), str(tmp_path / "cache")
  calls = _counting(monkeypatch, delay=0.02)
  start, results = threading.Barrier(2), []

  def build():
    start.wait()
    results.append(build_shards([str(folder)], val_fraction=FRACTION, cache_dir=cache).fingerprint)

  threads = [threading.Thread(target=build) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(results) == 2 and results[0] == results[1]
  assert len(calls) == 20  # one build's batches: the second builder waited on the lock, then read the cache


def _bad_parquet(tmp_path):
  _parquet(tmp_path, "cut", DOCS)
  data = (tmp_path / "cut.parquet").read_bytes()
  (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
  return [str(tmp_path / "cut.parquet")]


def _bad_arrow(tmp_path):
  _arrow(tmp_path, "cut", DOCS, stream=True)
  data = (tmp_path / "cut.arrow").read_bytes()
  (tmp_path / "cut.arrow").write_bytes(data[:len(data) // 2])
  return [str(tmp_path / "cut.arrow")]


def _bad_gzip(tmp_path):
  _jsonl(tmp_path, "cut", DOCS, ".jsonl.gz", gzip.open)
  data = (tmp_path / "cut.jsonl.gz").read_bytes()
  (tmp_path / "cut.jsonl.gz").write_bytes(data[:len(data) // 2])
  return [str(tmp_path / "cut.jsonl.gz")]


def _write_file(name, text):
  def make(tmp_path):
    (tmp_path / name).write_text(text)
    return [str(tmp_path / name)]
  return make


def _table(name, table):
  def make(tmp_path):
    pq.write_table(table, tmp_path / name)
    return [str(tmp_path / name)]
  return make


def _dataset_dict(tmp_path):
  datasets = pytest.importorskip("datasets")
  ds = datasets.Dataset.from_dict({"text": DOCS[:20]})
  datasets.DatasetDict({"validation": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
  return [str(tmp_path / "dd")]


BAD = {
    "missing column": (_table("t.parquet", pa.table({"body": ["a"], "id": [1]})),
                       r"t\.parquet: no column 'text' \(columns: body, id\); name the text column with --data\.field"),
    "missing key": (_write_file("t.jsonl", '{"body": "a", "id": 1}\n'),
                    r"t\.jsonl:1: no key 'text' \(keys: body, id\); name the text key with --data\.field"),
    "non-string column": (_table("t.parquet", pa.table({"text": [1, 2]})), r"column 'text' holds int64, not text"),
    "non-string key": (_write_file("t.jsonl", '{"text": "a"}\n{"text": [1]}\n'), r"t\.jsonl:2: 'text' holds a list"),
    "no glob match": (lambda p: [str(p / "nothing" / "*.parquet")], r"no file matches .*nothing/\*\.parquet"),
    "missing path": (lambda p: [str(p / "a.txt"), str(p / "gone.parquet")], r"data path does not exist: .*gone"),
    "corrupt parquet": (_write_file("t.parquet", "PAR1 this is not parquet PAR1"), r"not a readable Parquet file"),
    "truncated parquet": (_bad_parquet, r"cut\.parquet: not a readable Parquet file"),
    "truncated arrow": (_bad_arrow, r"cut\.arrow: not a readable Arrow file"),
    "truncated gzip": (_bad_gzip, r"cut\.jsonl\.gz: cannot read it as JSON Lines"),
    "json document": (_write_file("t.json", '[\n {"text": "a"}\n]\n'), r"t\.json:1: not a JSON line .*one object per"),
    "empty dataset": (_table("t.parquet", pa.table({"text": pa.array([], pa.string())})), r"no documents in"),
    "one document": (_write_file("t.jsonl", '{"text": "alone"}\n'), r"split of .* is empty \(1 documents"),
    "token array among texts": (lambda p: (np.save(p / "t.npy", np.arange(9)), [str(p / "*")])[1],
                                r"t\.npy is a token array; pass it as the only data path"),
    "no train split": (_dataset_dict, r"DatasetDict without a 'train' split \(splits: validation, test\)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_one_line_data_error(case, tmp_path):
  (tmp_path / "a.txt").write_text("some text")
  make, pattern = BAD[case]
  with pytest.raises(DataError, match=pattern) as e:
    load_corpus(make(tmp_path), cache_dir=str(tmp_path / "cache"))
  assert "\n" not in str(e.value)


def test_a_dataset_dict_gives_its_train_split(tmp_path):
  datasets = pytest.importorskip("datasets")
  train = datasets.Dataset.from_dict({"text": DOCS})
  datasets.DatasetDict({"train": train, "test": train.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
  c = load_corpus(str(tmp_path / "dd"), val_fraction=FRACTION, cache_dir=str(tmp_path / "cache"))
  _check(c, _reference([(f"dd:{i}", d) for i, d in enumerate(DOCS)], *_encoder(None)[:2]), np.uint8, 0)
