"""Checkpoint integrity: the state checksums (research/train/store/integrity.py) are independent of sharding and catch
every single-bit error; a checkpoint whose bytes changed on disk after it was written (a flipped bit that still decodes,
a truncated shard, a data file swapped with another step's) is refused on resume in one line, moved aside byte for
byte, and the run goes on from the newest intact step with the losses of an uninterrupted run."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from runs import files, trace

from research.train import TrainConfig, run
from research.train.store.integrity import fingerprints, mismatches

TINY = dict(model="tiny", n_layers=1, steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=2,
            warmup_steps=1, eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12)


def test_checksums_do_not_depend_on_the_sharding():
  x = jax.random.normal(jax.random.key(0), (64, 48))
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i32": jnp.arange(35), "bool": jnp.array([True, False]),
          "scalar": jnp.float32(3.0)}
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  sharded = {**tree, "f32": jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
             "bf16": jax.device_put(tree["bf16"], NamedSharding(mesh, P(None, ("a", "b"))))}
  assert fingerprints(tree) == fingerprints(sharded)
  assert len(set(fingerprints(tree).values())) == len(tree)


def test_large_arrays_are_hashed_in_pieces_to_the_same_checksums(monkeypatch):
  """An array over CHUNK elements whose first axis is whole is hashed a few rows at a time (bounded temporaries: the
  3B model's checksums took 12.8 GiB in one program): the same words as in one piece, for every dtype width, a first
  axis with and without a divisor that fits, and a sharded first axis (hashed in one piece)."""
  from research.train.store import integrity
  x = jax.random.normal(jax.random.key(1), (12, 10, 7))
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i8": jnp.arange(13 * 12, dtype=jnp.int8).reshape(13, 12),
          "split_rest": jax.device_put(x, NamedSharding(mesh, P(None, "a"))),
          "split_first": jax.device_put(x, NamedSharding(mesh, P("b")))}
  whole = fingerprints(tree)
  monkeypatch.setattr(integrity, "CHUNK", 150)
  assert [integrity._rows_per_chunk(tree[k]) for k in tree] == [2, 2, 1, 2, None]
  assert fingerprints(tree) == whole


@pytest.mark.parametrize("dtype, words", [(np.float32, np.uint32), (jnp.bfloat16, np.uint16)])
def test_every_single_bit_flip_changes_both_words(dtype, words):
  x = np.asarray(jax.random.normal(jax.random.key(1), (6, 5)).astype(dtype))
  base = fingerprints({"x": x})["x"]
  bits = 8 * np.dtype(words).itemsize
  seen = set()
  for i in range(x.size):
    for b in range(bits):
      w = x.view(words).copy().reshape(-1)
      w[i] ^= words(1 << b)
      got = fingerprints({"x": w.view(x.dtype).reshape(x.shape)})["x"]
      assert got[:8] != base[:8] and got[8:] != base[8:], (i, b)
      seen.add(got)
  assert len(seen) == x.size * bits  # no two flips collide either


def test_changes_that_cancel_in_a_weighted_sum_are_caught():
  """Two flipped sign bits add 2^31 twice (0 mod 2^32) to any sum of w_i times odd weights; swapping two elements
  keeps every order-free sum of the values alone."""
  x = np.asarray(jax.random.normal(jax.random.key(2), (8, 8)), np.float32)
  base = fingerprints({"x": x})["x"]
  swapped = x.copy()
  swapped[0, :2] = swapped[0, 1::-1]
  assert fingerprints({"x": swapped})["x"] != base
  two_signs = x.copy()
  two_signs[0, 0], two_signs[5, 3] = -two_signs[0, 0], -two_signs[5, 3]
  assert fingerprints({"x": two_signs})["x"] != base


def test_mismatches_names_changed_and_missing_arrays():
  assert mismatches({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9"}) == ["b", "c"]


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


def largest_data_file(step_dir):
  """The largest file of array data in a step: an OCDBT data file (`d/...`) or a zarr chunk (`0.0`), not metadata."""
  meta = lambda p: p.startswith((".", "_")) or "metadata" in p or "manifest" in p or p.endswith((".txt", ".json"))
  paths = [os.path.join(d, p) for d, _, ps in os.walk(step_dir / "state") for p in ps if not meta(p)]
  return max(paths, key=os.path.getsize)


def flip_a_bit(step_dir, _):
  path = largest_data_file(step_dir)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x04  # a mantissa bit of some parameter or moment: still a valid float
  open(path, "wb").write(bytes(data))


def truncate_a_shard(step_dir, _):
  path = largest_data_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)


def swap_with_an_older_step(step_dir, older_dir):
  """Step 4's array files (and the index naming them) in place of step 6's: every file decodes."""
  shutil.rmtree(step_dir / "state")
  shutil.copytree(older_dir / "state", step_dir / "state")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return run(cfg(tmp_path_factory.mktemp("ref")))


@pytest.mark.parametrize("damage, says", [(flip_a_bit, "changed since it was saved: the checksum of "),
                                          (truncate_a_shard, ""),
                                          (swap_with_an_older_step, "changed since it was saved")])
def test_changed_bytes_are_detected_reported_and_kept(reference, tmp_path, capfd, damage, says):
  out, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
  run(cfg(out, stop_at=6))
  damage(ckpt / "6", ckpt / "4")
  damaged = files(ckpt / "6")
  capfd.readouterr()
  records = run(cfg(out))
  err = capfd.readouterr().err.strip().splitlines()
  warnings = [line for line in err if line.startswith("warning")]
  assert len(warnings) == 1 and warnings[0].startswith(f"warning: checkpoint {ckpt}/6 "), err
  assert says in warnings[0] and "<bound method" not in warnings[0] and " object at 0x" not in warnings[0]
  assert f"moved to {ckpt}.corrupt/6, resuming from step 4" in warnings[0]
  assert trace(records) == trace(reference)
  assert files(ckpt.parent / "ckpt.corrupt" / "6") == damaged  # byte for byte, nothing deleted


def test_checksums_are_saved_with_every_step(tmp_path):
  run(cfg(tmp_path, stop_at=2))
  meta = json.load(open(tmp_path / "ckpt" / "2" / "meta" / "metadata"))
  assert len(meta["checksums"]) > 10 and all(len(v) == 16 for v in meta["checksums"].values())
  assert any(k.startswith("params/") for k in meta["checksums"]) and any(k.startswith("opt_state/") for k in
                                                                          meta["checksums"])
