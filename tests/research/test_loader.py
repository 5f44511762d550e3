"""The grain loader (research/data/loader.py) and the trainer's feed of it (research/train/feed.py): the window
orders, this process's rows, prefetching threads, and the iterator state a checkpoint keeps; exact resume on data in
each format. (Two processes reading only their own rows, and their restart: tests/research/test_multiprocess.py.)"""

import json

import numpy as np
import pytest

from research.data import get_batch, load_corpus
from research.data.loader import Loader
from research.data.records import IGNORE
from research.train import RunError, TrainConfig, run
from research.train.config import DataFlags
from research.train.feed import Feed
from research.train.store.checkpoint import Checkpointer
from sharding import make_mesh

TOKENS = np.arange(1003, dtype=np.uint16) * 7 % 1009  # distinct values: a window is known by its first token


def rows_of(loader, steps):
  return np.concatenate([loader.batch(t)[0] for t in range(steps)])


def test_shuffle_reads_every_window_once_per_epoch_each_epoch_in_its_own_order():
  loader = Loader(TOKENS, batch_size=5, seq_len=10, seed=3, sampling="shuffle", workers=0)
  W = loader.count  # (1003 - 11) // 10 + 1 = 100 windows of 11 tokens at a stride of 10
  assert W == 100
  x = rows_of(loader, 3 * W // 5)  # three epochs
  position = np.zeros(1009, np.int64)
  position[TOKENS] = np.arange(len(TOKENS))
  starts = position[x[:, 0]]
  for e in range(3):
    epoch = starts[e * W:(e + 1) * W]
    assert len(set((epoch % 10).tolist())) == 1  # one grid per epoch: windows at offset + 10 i
    assert sorted((epoch // 10).tolist()) == list(range(W))  # every window of the grid, once
  assert not np.array_equal(starts[:W] // 10, starts[W:2 * W] // 10)  # epochs in different orders
  y = loader.batch(7)[1]
  np.testing.assert_array_equal(y[:, :-1], loader.batch(7)[0][:, 1:])  # y is x shifted by one
  same = Loader(TOKENS, batch_size=5, seq_len=10, seed=3, workers=0)
  other = Loader(TOKENS, batch_size=5, seq_len=10, seed=4, workers=0)
  assert np.array_equal(rows_of(same, 20), x[:100]) and not np.array_equal(rows_of(other, 20), x[:100])


@pytest.mark.parametrize("sampling", ["random", "sequential"])
def test_random_and_sequential_are_get_batch(sampling):
  loader = Loader(TOKENS, batch_size=4, seq_len=16, seed=5, sampling=sampling, workers=0)
  for t in (0, 1, 9, 1000):
    for got, want in zip(loader.batch(t), get_batch(TOKENS, 5, t, 4, 16, sampling)):
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sampling", ["shuffle", "random"])
def test_threads_rows_and_iterator_state(sampling):
  """The prefetching iterator yields the batches `batch(t)` reads directly; a process's rows are those rows of the
  whole batch; an iterator restored from a saved state goes on with the same batches."""
  whole = Loader(TOKENS, batch_size=8, seq_len=12, seed=1, sampling=sampling, workers=0)
  mine = Loader(TOKENS, batch_size=8, seq_len=12, seed=1, sampling=sampling, rows=[4, 5, 6, 7], workers=3)
  it = mine.iterator(start=2)
  got = [next(it) for _ in range(10)]
  state = it.get_state()
  assert state == {"next_index": 12}
  for t, (x, y) in enumerate(got, start=2):
    np.testing.assert_array_equal(x, whole.batch(t)[0][4:])
    np.testing.assert_array_equal(y, whole.batch(t)[1][4:])
  again = mine.iterator(state=state)
  np.testing.assert_array_equal(next(again)[0], whole.batch(12)[0][4:])


def documents(seed=0, n=40, eos=0):
  """Token stream of n documents of 1..30 tokens in [1, 50), each followed by eos; and their starts."""
  rng = np.random.default_rng(seed)
  docs = [rng.integers(1, 50, size=rng.integers(1, 30)).tolist() + [eos] for _ in range(n)]
  return docs, np.array(sum(docs, []), np.uint16), np.cumsum([0] + [len(d) for d in docs[:-1]])


def test_pad_puts_each_document_in_its_own_rows_and_masks_the_padding():
  """Every target token of every document is a target exactly once per epoch, in its document's rows only; padding
  is eos in x and IGNORE in y (a float64-free check: the rows are compared with the documents themselves)."""
  docs, tokens, starts = documents()
  loader = Loader(tokens, batch_size=4, seq_len=8, seed=2, layout="pad", docs=starts, eos=0, workers=0)
  pieces = sum(max((len(d) - 2) // 8 + 1, 0) for d in docs)
  assert loader.count == pieces
  steps = -(-pieces // 4)
  xs, ys = (np.concatenate(a)[:pieces] for a in zip(*[loader.batch(t) for t in range(steps)]))
  seen = []
  for x, y in zip(xs, ys):
    n = int((y != IGNORE).sum())
    assert (y[n:] == IGNORE).all() and (x[n:] == 0).all() and n >= 1
    seen.append(tuple(x[:n].tolist()) + (int(y[n - 1]),))  # the piece: its inputs and its last target
  expect = [tuple(d[j * 8:j * 8 + 9]) for d in docs for j in range(max((len(d) - 2) // 8 + 1, 0))]
  assert sorted(seen) == sorted(expect)


def test_pack_joins_the_documents_of_each_epoch_in_its_own_order():
  docs, tokens, starts = documents(1)
  loader = Loader(tokens, batch_size=2, seq_len=8, seed=3, layout="pack", docs=starts, eos=0, workers=0,
                  sampling="sequential")
  R = loader.count
  assert R == (len(tokens) - 1) // 8
  xs, ys = (np.concatenate(a) for a in zip(*[loader.batch(t) for t in range(-(-2 * R // 2))]))
  stream = np.concatenate([xs[:R].reshape(-1), ys[R - 1, -1:]])  # in order: the rows tile the joined documents
  np.testing.assert_array_equal(stream, tokens[:R * 8 + 1])
  shuffled = Loader(tokens, batch_size=2, seq_len=8, seed=3, layout="pack", docs=starts, eos=0, workers=0)
  rows = np.concatenate([shuffled.batch(t)[0] for t in range(R // 2)])
  assert sorted(map(tuple, rows.tolist())) != sorted(map(tuple, xs[:R // 2 * 2].tolist()))  # another order of docs
  assert not (rows == IGNORE).any()


@pytest.mark.parametrize("layout", ["windows", "pack", "pad"])
def test_a_memmap_read_by_pread_gives_what_indexing_gives(tmp_path, layout):
  """Memory-mapped tokens (a slice of the map, as a corpus's val split is) are read with pread, not through the map
  (research/data/batches.py read_windows): the same rows as the array in memory, up to the file's last token."""
  docs, tokens, starts = documents(4, n=60)
  path = tmp_path / "t.bin"
  np.concatenate([np.full(5, 7, np.uint16), tokens]).tofile(path)
  mm = np.memmap(path, dtype=np.uint16, mode="r", offset=2)[4:]  # the map starts at a 2-byte header
  np.testing.assert_array_equal(np.asarray(mm), tokens)
  kw = dict(batch_size=4, seq_len=16, seed=0, workers=0, layout=layout, docs=starts, eos=0)
  a, b = Loader(mm, **kw), Loader(tokens, **kw)
  for t in range(a.count // 4 + 2):  # every record, the last ones (ending at the file's end) included
    for got, want in zip(a.batch(t), b.batch(t)):
      np.testing.assert_array_equal(got, want)


# test_train's tiny run (its compiled programs are shared through the session's compilation cache)
TINY = dict(model="tiny", steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=4,
            warmup_steps=2, eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2", tracker=("none",))


def trace(records):
  return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in records]


def test_checkpoints_keep_the_loader_state_and_a_mismatch_is_refused(tmp_path):
  out = tmp_path / "run"
  run(TrainConfig(out=str(out), stop_at=4, **TINY))
  meta = Checkpointer(str(out / "ckpt"), keep=3, every=4).read_meta(4)
  assert meta["loader"] == {"next_index": 4}
  cfg = TrainConfig(out=str(out), **TINY)
  corpus, mesh = load_corpus(), make_mesh(cfg.mesh.spec)
  with pytest.raises(RunError, match="holds the loader state of another step"):
    Feed(corpus, cfg.training, cfg.data, cfg.data_options, mesh, 4, {"next_index": 3})
  x, _ = Feed(corpus, cfg.training, cfg.data, cfg.data_options, mesh, 4, meta["loader"]).next()
  np.testing.assert_array_equal(np.asarray(x), Loader(corpus.train, batch_size=8, seq_len=32, seed=0).batch(4)[0])


def write_docs(tmp_path):
  """A few hundred small documents as Parquet and as JSON Lines."""
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "def f(x):", "return", "\n", "    ", "=", "+", "1", "2"]
  docs = [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(300)]
  pq.write_table(pa.table({"text": docs, "id": list(range(300))}), tmp_path / "docs.parquet")
  with open(tmp_path / "docs.jsonl", "w") as f:
    f.writelines(json.dumps({"body": d}) + "\n" for d in docs)
  return docs


@pytest.mark.parametrize("fmt, layout", [("parquet", "pack"), ("jsonl", "pad")])
def test_exact_resume_on_each_data_format(tmp_path, fmt, layout, monkeypatch):
  """Stopped after step 4 and resumed, a run on Parquet / JSON Lines documents, packed or padded, logs what the
  uninterrupted run logs, bit for bit. (Windows over a Parquet corpus: test_formats.py; over the default corpus:
  test_train.py.)"""
  monkeypatch.setenv("OPTLAB_CACHE", str(tmp_path / "cache"))
  write_docs(tmp_path)
  data = dict(data=(str(tmp_path / f"docs.{fmt}"),))
  opts = {"data_options": DataFlags(field="text" if fmt == "parquet" else "body", layout=layout)}
  whole = run(TrainConfig(out=str(tmp_path / "whole"), **TINY, **data, **opts))
  run(TrainConfig(out=str(tmp_path / "cut"), stop_at=4, **TINY, **data, **opts))
  resumed = run(TrainConfig(out=str(tmp_path / "cut"), **TINY, **data, **opts))
  assert trace(resumed) == trace(whole) and len(whole) == 8
  assert json.load(open(tmp_path / "whole" / "config.json"))["corpus"]["source"]


def test_reader_threads_and_the_old_data_flag_are_no_change_of_settings():
  """--data.workers changes no batch, so a resume may change it without --amend; a config saved when --data was one
  string (before several paths) compares equal to the same path now; another layout is a change."""
  from research.train.store.rundir import changed_settings
  now = {"train": {"data": ["d.txt"], "data_options": {"field": "text", "layout": "windows", "workers": 0}},
         "model_config": {}}
  saved = {"train": {"data": "d.txt", "data_options": {"field": "text", "layout": "windows", "workers": 2}},
           "model_config": {}}
  assert changed_settings(saved, now) == {}
  now["train"]["data_options"]["layout"] = "pad"
  assert list(changed_settings(saved, now)) == ["data_options"]


@pytest.mark.parametrize("fmt", ["txt", "parquet", "jsonl", "arrow", "npy", "bin"])
def test_every_format_resumes_its_batches_from_the_saved_state(tmp_path, fmt, monkeypatch):
  """Whatever the format, a corpus loaded again (from its cache, as a resumed run loads it) feeds, from a saved
  iterator state, the batches the uninterrupted iterator goes on with."""
  pa = pytest.importorskip("pyarrow")
  pytest.importorskip("pyarrow.parquet")  # every format starts from write_docs's Parquet file
  monkeypatch.setenv("OPTLAB_CACHE", str(tmp_path / "cache"))
  docs = write_docs(tmp_path)
  if fmt == "txt":
    (tmp_path / "t").mkdir()
    for i, d in enumerate(docs):
      (tmp_path / "t" / f"{i}.txt").write_text(d)
  elif fmt == "arrow":
    with pa.ipc.new_file(str(tmp_path / "docs.arrow"), pa.schema([("text", pa.string())])) as w:
      w.write_table(pa.table({"text": docs}))
  elif fmt in ("npy", "bin"):
    tokens = load_corpus(str(tmp_path / "docs.parquet")).train
    np.save(tmp_path / "docs.npy", np.asarray(tokens, np.int32)) if fmt == "npy" else \
        np.asarray(tokens, np.uint16).tofile(tmp_path / "docs.bin")
  path = {"txt": tmp_path / "t", "jsonl": tmp_path / "docs.jsonl"}.get(fmt, tmp_path / f"docs.{fmt}")
  field = "body" if fmt == "jsonl" else "text"
  layout = "windows" if fmt in ("npy", "bin") else "pad"
  feed = lambda: Loader((c := load_corpus(str(path), field=field)).train, batch_size=4, seq_len=16, seed=1,  # noqa
                        layout=layout, docs=c.train_docs, eos=c.eos, workers=2)
  whole = feed().iterator()
  expect = [next(whole) for _ in range(12)][5:]
  resumed = feed().iterator(state={"next_index": 5})
  for want in expect:
    for got, w in zip(next(resumed), want):
      np.testing.assert_array_equal(got, w)
