"""Caches that verify what they serve (issue 48): a cache file overwritten at its own size (zeros: what a size check
cannot see) is rebuilt, with one warning line naming the folder, and the true contents and fingerprint are served;
the check is made once per process while the files are unchanged; a run resumed over a zeroed token cache trains on
the true data; a malformed peak_flops.json is dropped in one line, never used and never a crash."""

import hashlib
import json
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from runs import trace
from tiny_text import DOCS, byte_bpe, write_docs

from research.data import cache, docs_corpus, load_corpus
from research.train import TrainConfig, run
from research.train.hooks import throughput

RECORDS = [f"def g{i}(y):\n  return y - {i % 7}  # {'é' * (i % 3)}\n" * (2 + i % 5) for i in range(240)]


def _zero(path, start=0):
  """Overwrites `path` from byte `start` on with zeros, keeping its size (and inode): what a size check passes."""
  with open(path, "r+b") as f:
    f.seek(start)
    f.write(bytes(path.stat().st_size - start))


def _one_warning(capsys, folder):
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"warning: the cache {folder} does not match its meta.json ("), err
  assert err[0].endswith("; rebuilding it")
  return err[0]


def _snapshot(c):
  return c.fingerprint, np.array(c.train), np.array(c.val)


def _same(c, snapshot):
  fingerprint, train, val = snapshot
  np.testing.assert_array_equal(c.train, train)
  np.testing.assert_array_equal(c.val, val)
  assert c.fingerprint == fingerprint == hashlib.sha256(train.tobytes() + val.tobytes()).hexdigest()


@pytest.fixture()
def text_dir(tmp_path):
  return write_docs(tmp_path / "text")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "bpe.json"
  byte_bpe(path, DOCS.values())
  return str(path)


@pytest.fixture()
def jsonl(tmp_path):
  path = tmp_path / "records.jsonl"
  path.write_text("".join(json.dumps({"text": r}) + "\n" for r in RECORDS))
  return path


@pytest.mark.parametrize("name", ["train.bin", "val.bin"])
def test_the_stdlib_byte_corpus_cache_is_rebuilt_when_zeroed(tmp_path, capsys, name):
  built = load_corpus(cache_dir=str(tmp_path))
  (folder,) = [p.parent for p in tmp_path.glob("stdlib-*/meta.json")]
  want = _snapshot(built)
  _zero(folder / name)
  capsys.readouterr()
  again = load_corpus(cache_dir=str(tmp_path))
  _same(again, want)
  assert "the contents of train.bin + val.bin do not hash to the fingerprint" in _one_warning(capsys, folder)
  assert (folder / name).read_bytes() == (want[1] if name == "train.bin" else want[2]).tobytes()  # repaired on disk


def test_the_tokenized_cache_is_rebuilt_when_zeroed(tmp_path, text_dir, bpe, capsys):
  load = lambda: load_corpus(str(text_dir), val_fraction=0.3, tokenizer=bpe, cache_dir=str(tmp_path / "cache"))
  want = _snapshot(load())
  (folder,) = (tmp_path / "cache").glob("tokens-*")
  for name in ("val.bin", "meta.json"):  # the tokens, then the record of them
    _zero(folder / name)
    capsys.readouterr()
    _same(load(), want)
    _one_warning(capsys, folder)


def test_each_file_is_hashed_once_per_process_while_it_is_unchanged(tmp_path, text_dir, bpe, monkeypatch, capsys):
  """Files written in the last two seconds are hashed at every load (a write then may keep their timestamps);
  older ones once, until their identity (inode, size, mtime, ctime) changes."""
  hashed = []
  real = cache.file_sha256
  monkeypatch.setattr(cache, "file_sha256", lambda paths: hashed.append(paths) or real(paths))
  monkeypatch.setattr(cache, "_RACY_NS", 10 ** 15)  # every file "just written", however slow this machine is
  load = lambda: load_corpus(str(text_dir), val_fraction=0.3, tokenizer=bpe, cache_dir=str(tmp_path / "cache"))
  want = _snapshot(load())
  (folder,) = (tmp_path / "cache").glob("tokens-*")
  assert len(hashed) == 1  # read back once after its build
  load()
  assert len(hashed) == 2  # just written: checked again
  monkeypatch.setattr(cache, "_RACY_NS", -10 ** 12)  # as if it had been written long ago
  load()
  load()
  assert len(hashed) == 3  # checked once, then remembered
  time.sleep(0.05)  # past the clock tick of the last write
  _zero(folder / "train.bin")
  capsys.readouterr()
  _same(load(), want)
  _one_warning(capsys, folder)
  assert len(hashed) == 5  # the zeroed files, then the rebuilt ones read back


@pytest.mark.parametrize("name", ["train.bin", "val_docs.npy", "old"])
def test_the_shards_cache_is_rebuilt_when_zeroed(tmp_path, jsonl, capsys, name):
  """A token shard or a document-starts array zeroed at its size (the .npy header kept, so it still loads), also in a
  cache from before meta.json recorded the starts' sha256 ("old": its starts are held to their order): built again,
  never served as it is."""
  load = lambda: load_corpus(str(jsonl), val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
  built = load()
  want, docs = _snapshot(built), (np.array(built.train_docs), np.array(built.val_docs))
  (folder,) = (tmp_path / "cache").glob("shards-*")
  if name == "old":
    meta = json.loads((folder / "meta.json").read_text())
    del meta["sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))
  zeroed = "train_docs.npy" if name == "old" else name
  _zero(folder / zeroed, np.load(folder / zeroed, mmap_mode="r").offset if zeroed.endswith(".npy") else 0)
  capsys.readouterr()
  again = load()
  _same(again, want)
  np.testing.assert_array_equal(again.train_docs, docs[0])
  np.testing.assert_array_equal(again.val_docs, docs[1])
  line = _one_warning(capsys, folder)
  assert name.split(".")[0] in line or "train_docs.npy's document starts are out of order" in line
  assert "sha256" in json.loads((folder / "meta.json").read_text())


def test_an_intact_shards_cache_from_before_the_starts_sha256_is_served_as_it_is(tmp_path, jsonl, capsys):
  """Its token files hash to the fingerprint and its starts are in order: served as it is, no warning, nothing
  rewritten (a shared read-only $OPTLAB_CACHE keeps working: it needs no write)."""
  load = lambda: load_corpus(str(jsonl), val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
  want = _snapshot(load())
  (folder,) = (tmp_path / "cache").glob("shards-*")
  meta = json.loads((folder / "meta.json").read_text())
  del meta["sha256"]
  (folder / "meta.json").write_text(json.dumps(meta))
  capsys.readouterr()
  _same(load(), want)
  assert "warning" not in capsys.readouterr().err and "sha256" not in json.loads((folder / "meta.json").read_text())


def test_the_docs_corpus_is_rebuilt_when_a_file_is_zeroed_or_added(tmp_path, capsys):
  path = docs_corpus.build(str(tmp_path))
  files = {p.name: p.read_bytes() for p in sorted(tmp_path.glob("docs-*/*.md"))}
  _zero(tmp_path / path / "jax.md")
  capsys.readouterr()
  assert docs_corpus.build(str(tmp_path)) == path
  assert {p.name: p.read_bytes() for p in sorted(tmp_path.glob("docs-*/*.md"))} == files
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"warning: the corpus {path} is not the installed packages'"), err
  assert "jax.md differs" in err[0]
  (tmp_path / path / "stray.md").write_text("not a package description")
  docs_corpus.build(str(tmp_path))
  assert {p.name: p.read_bytes() for p in sorted(tmp_path.glob("docs-*/*.md"))} == files
  assert "1 not its own (stray.md)" in capsys.readouterr().err
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left aside


TINY = dict(model="tiny", steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=4,
            warmup_steps=2, eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12)


def test_a_run_resumed_over_a_zeroed_token_cache_trains_on_the_true_data(tmp_path, jsonl, monkeypatch):
  """The token shards zeroed between a stop and the resume (config.json and meta.json both record the true
  fingerprint): the resume, a new process as after any stop, rebuilds them (one warning line) and continues as the
  uninterrupted run did."""
  monkeypatch.setenv("OPTLAB_CACHE", str(tmp_path / "cache"))
  cfg = lambda out, **kw: TrainConfig(out=str(tmp_path / out), data=(str(jsonl),), **{**TINY, **kw})
  reference = run(cfg("reference"))  # also fills the compile cache the resuming process reads
  run(cfg("run", stop_at=4))
  (folder,) = (tmp_path / "cache").glob("shards-*")
  _zero(folder / "train.bin")
  args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
  p = subprocess.run([sys.executable, "-m", "research.train", *args, "--no-progress", f"--data={jsonl}",
                      f"--out={tmp_path / 'run'}"], capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  resumed = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert trace(resumed) == trace(reference)
  warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
  assert len(warnings) == 1 and warnings[0].startswith(f"warning: the cache {folder} does not match"), warnings


def _fake_chip(monkeypatch, rate):
  device = types.SimpleNamespace(device_kind="Some Future Chip", platform="gpu")
  monkeypatch.setattr(throughput.jax, "local_devices", lambda: [device])
  monkeypatch.setattr(throughput, "measure_matmul_flops", lambda n, dtype: rate)
  return f"{throughput._machine()}:bfloat16"


T = 1e12


@pytest.mark.parametrize("text, says", [
    ("{not json", "not a JSON object of matmul rates"),
    ("[1e30]", "not a JSON object of matmul rates"),
    ('{"KEY": "fast"}', "'fast', is not a finite positive number: dropped"),
    ('{"KEY": -5e14}', "-500000000000000.0, is not a finite positive number: dropped"),
    ('{"KEY": Infinity}', "inf, is not a finite positive number: dropped"),
    ('{"KEY": NaN}', "nan, is not a finite positive number: dropped"),
    ('{"KEY": true}', "True, is not a finite positive number: dropped"),
    ('{"KEY": 1e30}', "1e+30, is 1e+16x this run's best sample"),
])
def test_a_malformed_peak_cache_is_dropped_in_one_line(tmp_path, monkeypatch, capsys, text, says):
  monkeypatch.setenv("OPTLAB_CACHE", str(tmp_path))
  key = _fake_chip(monkeypatch, 100 * T)
  (tmp_path / "peak_flops.json").write_text(text.replace("KEY", key) if text.startswith("{\"") else text)
  peak = throughput.Peak(dtype="bfloat16", samples=1)
  assert peak.flops == 100 * T and "earlier runs" not in peak.source
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"warning: {tmp_path / 'peak_flops.json'}: ") and says in err[0], err
  assert json.loads((tmp_path / "peak_flops.json").read_text()) == {key: 100 * T}  # this run's sample replaces it


def test_an_earlier_best_is_kept_up_to_what_a_loaded_machine_explains(tmp_path, monkeypatch, capsys):
  """The rule: an earlier best up to PLAUSIBLE (4x) this run's own sample is the machine's (this run shares the cores);
  above it, dropped in one line and replaced by this run's sample. Other machines' entries are left as they are."""
  monkeypatch.setenv("OPTLAB_CACHE", str(tmp_path))
  key = _fake_chip(monkeypatch, 100 * T)
  table = {key: 390 * T, "other:machine:bfloat16": "not this run's to judge"}
  (tmp_path / "peak_flops.json").write_text(json.dumps(table))
  peak = throughput.Peak(dtype="bfloat16", samples=1)
  assert peak.flops == 390 * T and "earlier runs" in peak.source and capsys.readouterr().err == ""
  (tmp_path / "peak_flops.json").write_text(json.dumps({**table, key: 410 * T}))
  assert throughput.Peak(dtype="bfloat16", samples=1).flops == 100 * T
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is 4.1x this run's best sample (1e+14 FLOP/s), more than the 4x a loaded machine " \
                           "explains: dropped" in err[0], err
  assert json.loads((tmp_path / "peak_flops.json").read_text()) == {**table, key: 100 * T}


def test_a_file_replaced_under_the_same_path_is_read_from_its_new_map(tmp_path):
  """A rebuilt cache is a new file renamed into place: a reader of its new memory map must not read through the
  descriptor opened for the old one (research/data/batches.py kept one per path, so a process that had read the old
  file went on reading it)."""
  from research.data.batches import read_windows
  path = tmp_path / "train.bin"
  np.arange(64, dtype=np.uint16).tofile(path)
  old = np.memmap(path, dtype=np.uint16, mode="r")
  assert read_windows(old, np.array([3]), 4).tolist() == [[3, 4, 5, 6]]
  (np.arange(64, dtype=np.uint16) + 100).tofile(tmp_path / "new.bin")
  (tmp_path / "new.bin").replace(path)
  new = np.memmap(path, dtype=np.uint16, mode="r")
  assert read_windows(new, np.array([3]), 4).tolist() == [[103, 104, 105, 106]]
  assert read_windows(old, np.array([3]), 4).tolist() == [[3, 4, 5, 6]]  # the old map still reads what it maps
