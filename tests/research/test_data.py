"""Tests for research/data/ (corpus.py, batches.py): the corpus build, its cache, the split rule and the samplers.

Expected values are recomputed here from the written spec (file walk, sha256 split rule,
window arithmetic), not taken from the module.
"""

import hashlib
import json
import math
import pathlib
import shutil
import sysconfig
import time

import numpy as np
import pytest

from research.data import DataError, corpus, eval_batches, get_batch, load_corpus


def _stdlib_files():
  """(root, sorted relpaths) of the stdlib *.py files outside site-/dist-packages."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  rels = []
  for p in root.rglob("*.py"):
    rel = p.relative_to(root)
    if p.is_file() and not {"site-packages", "dist-packages"} & set(rel.parts[:-1]):
      rels.append(rel.as_posix())
  return root, sorted(rels)


def _goes_to_val(rel, fraction):
  return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10_000 < fraction * 10_000


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
  """Builds the default corpus once into a private cache, then loads it again from the cache."""
  cache = tmp_path_factory.mktemp("cache")
  t0 = time.perf_counter()
  built = load_corpus(cache_dir=str(cache))
  t1 = time.perf_counter()
  hit = load_corpus(cache_dir=str(cache))
  t2 = time.perf_counter()
  (folder,) = [p.parent for p in cache.glob("*/meta.json")]
  print(f"stdlib corpus: build {t1 - t0:.2f}s, cache hit {t2 - t1:.3f}s, "
        f"train {len(built.train)} B, val {len(built.val)} B")
  return dict(cache=cache, folder=folder, built=built, hit=hit)


def test_default_corpus_shape_and_fingerprint(stdlib):
  c = stdlib["built"]
  assert c.train.dtype == np.uint8 and c.val.dtype == np.uint8
  assert c.train.ndim == 1 and c.val.ndim == 1
  assert 0.02 < len(c.val) / (len(c.train) + len(c.val)) < 0.10
  assert c.vocab_size == 256
  assert len(c.fingerprint) == 64 and int(c.fingerprint, 16) >= 0
  expected = hashlib.sha256(np.asarray(c.train).tobytes() + np.asarray(c.val).tobytes())
  assert c.fingerprint == expected.hexdigest()
  assert c.source == f"stdlib:{sysconfig.get_paths()['stdlib']}"


def test_default_corpus_second_load_is_cache_hit(stdlib, monkeypatch):
  built, hit = stdlib["built"], stdlib["hit"]
  assert isinstance(hit.train, np.memmap) and isinstance(hit.val, np.memmap)
  np.testing.assert_array_equal(built.train, hit.train)
  np.testing.assert_array_equal(built.val, hit.val)
  assert built.fingerprint == hit.fingerprint
  meta = json.loads((stdlib["folder"] / "meta.json").read_text())
  assert meta["fingerprint"] == hit.fingerprint
  assert (meta["train_bytes"], meta["val_bytes"]) == (len(hit.train), len(hit.val))

  def no_reads(*args):
    raise AssertionError("a cache hit must not re-read the stdlib")

  monkeypatch.setattr(corpus, "_read", no_reads)
  again = load_corpus(cache_dir=str(stdlib["cache"]))
  assert again.fingerprint == hit.fingerprint


def test_default_corpus_contents_match_an_independent_walk(stdlib):
  root, rels = _stdlib_files()
  sizes = {r: (root / r).stat().st_size for r in rels}
  val_rels = [r for r in rels if _goes_to_val(r, 0.05)]
  c = stdlib["built"]
  meta = json.loads((stdlib["folder"] / "meta.json").read_text())
  assert meta["n_files"] == len(rels)
  # Each file contributes its bytes plus one separator; site-packages would add far more.
  assert len(c.val) == sum(sizes[r] for r in val_rels) + len(val_rels)
  assert len(c.train) + len(c.val) == sum(sizes.values()) + len(rels)
  first_train = next(r for r in rels if r not in set(val_rels))
  head = (root / first_train).read_bytes() + b"\0"
  assert np.asarray(c.train[:len(head)]).tobytes() == head
  assert np.asarray(c.val[:sizes[val_rels[0]]]).tobytes() == (root / val_rels[0]).read_bytes()
  all_py = sum(1 for p in root.rglob("*.py") if p.is_file())
  if all_py > len(rels):  # the exclusion mattered on this interpreter
    assert meta["n_files"] < all_py


def test_cache_without_meta_is_rebuilt_not_trusted(stdlib, tmp_path):
  folder = tmp_path / stdlib["folder"].name
  shutil.copytree(stdlib["folder"], folder)
  (folder / "meta.json").unlink()
  (folder / "train.bin").write_bytes(b"half-written")  # what a killed build leaves behind
  c = load_corpus(cache_dir=str(tmp_path))
  assert (folder / "meta.json").exists()
  assert (folder / "train.bin").stat().st_size == len(stdlib["built"].train)
  np.testing.assert_array_equal(c.train, stdlib["built"].train)
  assert c.fingerprint == stdlib["built"].fingerprint


def test_cache_with_wrong_sizes_is_rebuilt(stdlib, tmp_path):
  folder = tmp_path / stdlib["folder"].name
  shutil.copytree(stdlib["folder"], folder)
  (folder / "val.bin").write_bytes(b"x" * 10)
  c = load_corpus(cache_dir=str(tmp_path))
  np.testing.assert_array_equal(c.val, stdlib["built"].val)


def test_directory_split_by_path_hash(tmp_path):
  files = {f"doc{i:02d}.txt": f"document {i}\n".encode() * (i + 1) for i in range(40)}
  files["sub/nested.txt"] = b"nested file"
  for rel, content in files.items():
    (tmp_path / rel).parent.mkdir(exist_ok=True)
    (tmp_path / rel).write_bytes(content)
  (tmp_path / ".hidden").write_bytes(b"SECRET")
  (tmp_path / ".git").mkdir()
  (tmp_path / ".git" / "config").write_bytes(b"SECRET")

  order = sorted(files)
  val_rels = [r for r in order if _goes_to_val(r, 0.25)]
  train_rels = [r for r in order if r not in val_rels]
  assert val_rels and train_rels  # the fixture exercises both sides
  c = load_corpus(str(tmp_path), val_fraction=0.25)
  assert c.val.tobytes() == b"".join(files[r] + b"\0" for r in val_rels)
  assert c.train.tobytes() == b"".join(files[r] + b"\0" for r in train_rels)
  assert c.vocab_size == 256 and c.source == str(tmp_path.resolve())


def test_a_directory_reads_its_text_files_and_says_what_it_skipped(tmp_path, capsys):
  """A source tree with an image and bytecode: only the UTF-8 text is read (not __pycache__, not the PNG, not a file
  with NUL bytes), and one stderr line says what was skipped; a directory without text is refused in one line."""
  texts = {f"mod{i}.py": f"def f{i}():\n  return {i} * 'é'\n" * 40 for i in range(40)}
  for name, text in texts.items():
    (tmp_path / name).write_text(text, encoding="utf-8")
  (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
  (tmp_path / "table.dat").write_bytes(b"abc\x00def" * 100)
  (tmp_path / "__pycache__").mkdir()
  (tmp_path / "__pycache__" / "mod0.cpython-311.pyc").write_bytes(b"\xa7\r\r\n" + bytes(300))
  c = load_corpus(str(tmp_path))
  got = bytes(np.concatenate([c.train, c.val])).split(b"\0")[:-1]
  assert sorted(got) == sorted(t.encode() for t in texts.values())  # exactly the text files, each whole
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"data: {tmp_path}: read 40 text files, skipped 2 that are not text ")
  assert ".png" in err[0] and ".dat" in err[0] and ".pyc" not in err[0]  # cache folders are not even walked
  binary = tmp_path / "bin"
  binary.mkdir()
  (binary / "a.png").write_bytes(bytes(range(256)))
  (binary / "b.npz").write_bytes(b"PK\x03\x04" + bytes(100))
  with pytest.raises(DataError, match="has no text files") as e:
    load_corpus(str(binary))
  assert "\n" not in str(e.value)


def test_single_file_directory_splits_by_position(tmp_path):
  (tmp_path / "only.txt").write_bytes(b"a" * 99)
  c = load_corpus(str(tmp_path), val_fraction=0.1)
  assert len(c.val) == 10 and len(c.train) == 90  # 99 bytes + separator, last ceil(10.0)
  assert c.val.tobytes() == b"a" * 9 + b"\0"


def test_text_file_round_trips(tmp_path):
  text = "".join(f"line {i}: héllo wörld\n" for i in range(300)).encode()
  path = tmp_path / "corpus.txt"
  path.write_bytes(text)
  c = load_corpus(str(path), val_fraction=0.05)
  assert c.train.dtype == np.uint8
  assert len(c.val) == math.ceil(len(text) * 0.05)
  assert c.train.tobytes() + c.val.tobytes() == text
  assert c.fingerprint == hashlib.sha256(text).hexdigest()


def test_npy_round_trips_with_vocab_from_max(tmp_path):
  tokens = (np.arange(2000) * 7 % 300).astype(np.int32)
  np.save(tmp_path / "t.npy", tokens)
  c = load_corpus(str(tmp_path / "t.npy"), val_fraction=0.1)
  assert c.train.dtype == np.int32 and c.vocab_size == 300
  assert len(c.val) == 200
  np.testing.assert_array_equal(np.concatenate([c.train, c.val]), tokens)
  np.save(tmp_path / "small.npy", np.arange(100, dtype=np.uint8))
  assert load_corpus(str(tmp_path / "small.npy")).vocab_size == 256


def test_bin_uint16_round_trips(tmp_path):
  tokens = (np.arange(5000) * 31 % 50257).astype(np.uint16)
  tokens[123] = 50256
  tokens.tofile(tmp_path / "t.bin")
  c = load_corpus(str(tmp_path / "t.bin"), val_fraction=0.05)
  assert c.train.dtype == np.uint16 and c.vocab_size == 50257
  assert len(c.val) == 250
  np.testing.assert_array_equal(np.concatenate([c.train, c.val]), tokens)


@pytest.mark.parametrize("case", ["missing", "empty_file", "empty_dir", "npy_2d", "npy_float",
                                  "odd_bin", "empty_bin", "bad_fraction"])
def test_bad_inputs_raise_data_error(tmp_path, case):
  path, kwargs = tmp_path / "x", {}
  if case == "missing":
    fact = f"data path does not exist: {path}"
  elif case == "empty_file":
    path.write_bytes(b"")
    fact = str(path)
  elif case == "empty_dir":
    path.mkdir()
    (path / ".hidden").write_bytes(b"not counted")
    fact = str(path)
  elif case in ("npy_2d", "npy_float"):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((4, 4), np.int32) if case == "npy_2d" else np.zeros(8, np.float32))
    fact = "(4, 4)" if case == "npy_2d" else "float32"
  elif case == "odd_bin":
    path = tmp_path / "x.bin"
    path.write_bytes(b"\x01\x00\x02")
    fact = "3 bytes"
  elif case == "empty_bin":
    path = tmp_path / "x.bin"
    path.write_bytes(b"")
    fact = str(path)
  else:
    path.write_bytes(b"abc")
    kwargs, fact = dict(val_fraction=1.5), "1.5"
  with pytest.raises(DataError) as err:
    load_corpus(str(path), **kwargs)
  assert fact in str(err.value) and "\n" not in str(err.value)
  if case.startswith("empty"):
    assert "empty" in str(err.value)


def test_split_that_comes_out_empty_raises(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"x")
  (tmp_path / "b.txt").write_bytes(b"y")
  assert not any(_goes_to_val(r, 0.0001) for r in ("a.txt", "b.txt"))
  with pytest.raises(DataError, match="val split"):
    load_corpus(str(tmp_path), val_fraction=0.0001)


def test_get_batch_windows_come_from_the_data():
  tokens = np.arange(1000, dtype=np.int32)  # token value == position, so windows are readable
  x, y = get_batch(tokens, seed=3, step=7, batch_size=64, seq_len=16)
  assert x.shape == y.shape == (64, 16) and x.dtype == y.dtype == np.int32
  starts = x[:, 0]
  np.testing.assert_array_equal(x, starts[:, None] + np.arange(16))
  np.testing.assert_array_equal(y, x + 1)
  assert starts.min() >= 0 and starts.max() <= 1000 - 16 - 1
  expected = np.random.default_rng([3, 7]).integers(0, 1000 - 17, size=64, endpoint=True)
  np.testing.assert_array_equal(starts, expected)  # the documented (seed, step) contract


def test_get_batch_is_pure_in_seed_and_step():
  tokens = np.frombuffer(b"the quick brown fox jumps over the lazy dog " * 50, np.uint8)
  a = get_batch(tokens, 0, 5, 8, 32)
  b = get_batch(tokens, 0, 5, 8, 32)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.array_equal(a[0], get_batch(tokens, 0, 6, 8, 32)[0])
  assert not np.array_equal(a[0], get_batch(tokens, 1, 5, 8, 32)[0])
  np.testing.assert_array_equal(a[1][:, :-1], a[0][:, 1:])


def test_get_batch_offsets_reach_both_ends():
  tokens = np.arange(10, dtype=np.uint16)
  x, y = get_batch(tokens, 0, 0, 300, 7)  # valid starts are exactly {0, 1, 2}
  assert set(x[:, 0].tolist()) == {0, 1, 2}
  x, y = get_batch(tokens[:8], 0, 0, 4, 7)  # exactly one window
  np.testing.assert_array_equal(x, np.broadcast_to(np.arange(7), (4, 7)))
  np.testing.assert_array_equal(y, np.broadcast_to(np.arange(1, 8), (4, 7)))


def test_sequential_sampling_reads_the_data_as_a_stream():
  """Row i of step t is window t·B + i of the stream that starts at the seed's offset, wrapping at the end."""
  tokens = np.arange(1000, dtype=np.int32)
  span = 1000 - 16 - 1
  offset = np.random.default_rng([3]).integers(0, span, endpoint=True)
  for step in (0, 1, 40):
    x, y = get_batch(tokens, 3, step, 8, 16, order="sequential")
    expect = (offset + (step * 8 + np.arange(8)) * 16) % (span + 1)
    np.testing.assert_array_equal(x[:, 0], expect)
    np.testing.assert_array_equal(x, x[:, :1] + np.arange(16))
    np.testing.assert_array_equal(y, x + 1)
  a, b = get_batch(tokens, 3, 0, 8, 16, "sequential")[0], get_batch(tokens, 3, 1, 8, 16, "sequential")[0]
  assert b[0, 0] == (a[-1, 0] + 16) % (span + 1)  # the next step goes on where this one ended
  with pytest.raises(DataError, match="sampling order"):
    get_batch(tokens, 3, 0, 8, 16, "shuffled")


def test_get_batch_on_the_cached_memmap(stdlib):
  val = stdlib["hit"].val
  x, y = get_batch(val, 1, 2, 4, 128)
  starts = np.random.default_rng([1, 2]).integers(0, len(val) - 129, size=4, endpoint=True)
  for row, s in enumerate(starts):
    np.testing.assert_array_equal(x[row], val[s:s + 128])
    np.testing.assert_array_equal(y[row], val[s + 1:s + 129])


def test_eval_batches_are_fixed_and_evenly_spaced():
  tokens = np.arange(5000, dtype=np.int32)
  batches = eval_batches(tokens, batch_size=4, seq_len=32, num_batches=3)
  again = eval_batches(tokens, batch_size=4, seq_len=32, num_batches=3)
  assert len(batches) == 3
  for (x, y), (x2, y2) in zip(batches, again):
    assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(y, x + 1)
  starts = np.concatenate([x[:, 0] for x, _ in batches])
  np.testing.assert_array_equal(starts, np.linspace(0, 5000 - 33, 12).astype(int))
  assert starts[0] == 0 and starts[-1] == 5000 - 33


@pytest.mark.parametrize("fn", ["get_batch", "eval_batches"])
def test_sequence_longer_than_data_raises(fn):
  tokens = np.zeros(50, np.uint8)
  with pytest.raises(DataError, match=r"sequence length 64 .*\(50 tokens\)"):
    if fn == "get_batch":
      get_batch(tokens, 0, 0, 2, 64)
    else:
      eval_batches(tokens, 2, 64, 1)
  with pytest.raises(DataError, match="sequence length 50"):  # a window needs seq_len + 1
    get_batch(tokens, 0, 0, 2, 50)
