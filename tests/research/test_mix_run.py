"""--data NAME=PATH ... --mix (research/train/hooks/source_weights.py): a fixed mixture reads each source at its weight,
the dynamic rule moves the weights from the router's loads, every record logs the weights and each source's held-out
loss, a stopped and resumed run logs what the uninterrupted one does, and bad specs are refused in one line."""

import json

import numpy as np
import pytest
from refusals import bad

from research.train import TrainConfig, run
from research.train.feed import make_loader
from research.train.hooks.source_weights import load_data

TINY = dict(model="moe_tiny", steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=3, ckpt_every=2,
            warmup_steps=2, eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12,
            tracker=("none",))
LETTERS = set(b"abcdefghijklmnopqrstuvwxyz ") | {0}  # source a's bytes and the document separator


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Three text corpora over disjoint bytes (a: letters, b: digits and punctuation, c: capitals), so a row's source
  shows."""
  root = tmp_path_factory.mktemp("mix")
  rng = np.random.default_rng(0)
  paths = {}
  for name, alphabet in (("a", b"abcdefghijklmnopqrstuvwxyz "), ("b", b"0123456789+-*/=()"), ("c", b"ABCDEFGHIJ")):
    path = root / f"{name}.txt"
    path.write_bytes(bytes(rng.choice(list(alphabet), 40_000)))
    paths[name] = str(path)
  return paths


def cfg(out, sources, **kw):
  return TrainConfig(out=str(out), data=tuple(f"{n}={p}" for n, p in sources.items()), **{**TINY, **kw})


def test_a_fixed_mixture_reads_each_source_at_its_weight(sources, tmp_path):
  only = cfg(tmp_path, sources, mix="fixed:1,0,0")
  only_a = make_loader(load_data(only.data, only.data_options), only.training, only.data, only.data_options)
  x, _ = only_a.batch(3)
  assert set(np.unique(x).tolist()) <= LETTERS
  c = cfg(tmp_path, sources, mix="fixed:3,0.5,0.5", batch_size=64)
  loader = make_loader(load_data(c.data, c.data_options), c.training, c.data, c.data_options)
  rows = np.concatenate([loader.batch(t)[0] for t in range(20)])
  from_a = np.isin(rows, list(LETTERS)).all(1)
  assert abs(from_a.mean() - 0.75) < 4 * np.sqrt(0.75 * 0.25 / len(rows))


def test_dynamic_weights_move_are_logged_and_a_resumed_run_is_exact(sources, tmp_path):
  whole = run(cfg(tmp_path / "whole", sources, mix="dynamic:every=2,batches=1"))
  first = run(cfg(tmp_path / "two", sources, mix="dynamic:every=2,batches=1", stop_at=4))
  assert [r["step"] for r in first] == [1, 2, 3, 4]
  again = run(cfg(tmp_path / "two", sources, mix="dynamic:every=2,batches=1"))
  keys = ("step", "loss", "mix/a", "mix/b", "mix/c", "val_loss", "val_loss/a", "val_loss/b", "val_loss/c")
  assert [[r.get(k) for k in keys] for r in again] == [[r.get(k) for k in keys] for r in whole]
  for r in whole:
    assert r["mix/a"] + r["mix/b"] + r["mix/c"] == pytest.approx(1.0)
  assert whole[0]["mix/a"] == whole[1]["mix/a"] == pytest.approx(1 / 3)  # uniform until the first update (step 2)
  assert whole[2]["mix/a"] != pytest.approx(1 / 3)  # the router's loads differ between the sources
  evals = [r for r in whole if "val_loss" in r]
  for r in evals:
    assert r["val_loss"] == pytest.approx((r["val_loss/a"] + r["val_loss/b"] + r["val_loss/c"]) / 3, rel=1e-6)
  meta = json.loads((tmp_path / "whole" / "config.json").read_text())
  assert set(meta["corpus"]["sources"]) == {"a", "b", "c"} and meta["corpus"]["mix"]["rule"] == "dynamic"


def test_bad_mixtures_are_refused_in_one_line(sources, tmp_path, capsys):
  a, b, c = sources["a"], sources["b"], sources["c"]
  assert "--mix mixes named --data sources" in bad(tmp_path, capsys, "--data", a, "--mix", "uniform")
  assert "name every source" in bad(tmp_path, capsys, "--data", f"a={a}", b)
  assert "given twice" in bad(tmp_path, capsys, "--data", f"a={a}", f"a={b}")
  assert "the rule must be one of" in bad(tmp_path, capsys, "--data", f"a={a}", f"b={b}", "--mix", "mixed")
  assert "give 2 non-negative weights" in bad(tmp_path, capsys, "--data", f"a={a}", f"b={b}", "--mix", "fixed:1")
  assert "needs an MoE model" in bad(tmp_path, capsys, "--data", f"a={a}", f"b={b}", f"c={c}", "--mix", "dynamic")
  assert "at least 3 sources" in bad(tmp_path, capsys, "--data", f"a={a}", f"b={b}", "--mix", "dynamic")
  assert "--data c=" in bad(tmp_path, capsys, "--data", f"a={a}", f"c={tmp_path}/missing.txt")
