"""PAD-Net's mode partition from the train CLI (--moe.pad --moe.pad-ratio): a new run partitions at step 0 to the
code's kept count, records it, saves the masks with every checkpoint; an interrupted run resumed from its checkpoint
restores them (never partitioning again) and gives the straight run's losses and masks; bad values are refused in
one line before anything starts."""

import contextlib
import io
import json
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx
from refusals import bad
from runs import trace

from models import Transformer, TransformerConfig, padnet
from research.train import TrainConfig, run
from research.train.config import MoEFlags
from research.train.setup import padnet as setup_padnet
from research.train.store.checkpoint import Checkpointer

PAD = MoEFlags(num_experts=4, d_expert=16, pad=True, pad_ratio=0.32, pad_rounds=2, pad_batches=2)
TINY = dict(model="moe_tiny", moe=PAD, steps=4, batch_size=8, seq_len=16, log_every=1, eval_every=2, ckpt_every=2,
            warmup_steps=1, eval_batches=1, progress=False, mesh="data=2,expert=2,tensor=2")


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


def saved_masks(out, step=None) -> list[np.ndarray]:
  """The PAD-Net masks a run's checkpoint (default: its newest) holds, read from the checkpoint's buffers."""
  config = TransformerConfig(**json.load(open(os.path.join(out, "config.json")))["model_config"])
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Not(nnx.Param))
  buffers = nnx.to_pure_dict(abstract)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  ckpt = Checkpointer(os.path.join(out, "ckpt"))
  try:
    step = ckpt.all_steps()[-1] if step is None else step
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param))
    sh = lambda t: jax.tree.map(lambda _: one, t)  # noqa: E731
    _, got = ckpt.restore_params(step, params, sh(params), buffers, sh(buffers))
  finally:
    ckpt.close()
  return [np.asarray(got["blocks"]["moe"][name]) for name in padnet.MASKS.values()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  out = tmp_path_factory.mktemp("pad")
  before, setup_padnet.PROGRESS_AFTER_S = setup_padnet.PROGRESS_AFTER_S, 0  # the step-0 bar at once, as a slow one
  try:
    with contextlib.redirect_stderr(io.StringIO()) as err:
      records = run(cfg(out))
  finally:
    setup_padnet.PROGRESS_AFTER_S = before
  return out, records, err.getvalue()


def test_a_new_run_partitions_at_step_0_to_the_codes_count_and_records_it(straight):
  out, records, err = straight
  assert len(records) == 4 and all(np.isfinite(r["loss"]) for r in records)
  masks = saved_masks(out, 2)
  n = sum(m.size for m in masks)
  kept = n - int((1.0 - 0.32) * n)  # Shwai-He/PAD-Net `_global_mask`: int((1 - d)·n) entries made static
  assert sum(int(m.sum()) for m in masks) == kept and 0 < kept < n and kept != round(0.32 * n)
  parts = re.split(r"[\r\n]", err)  # the progress bar redraws its line
  assert any(x.startswith("PAD-Net partition (batches scored)") and "/4 " in x for x in parts)  # 2 rounds x 2
  lines = [x for x in parts if x.startswith("PAD-Net:")]  # one line says what it did
  assert len(lines) == 1 and "2 rounds" in lines[0] and "ratio 0.32" in lines[0] and f"{kept:,} of {n:,}" in lines[0]
  meta = json.load(open(out / "config.json"))
  assert meta["train"]["moe"]["pad_ratio"] == 0.32 and meta["train"]["moe"]["pad_rounds"] == 2
  assert meta["model_config"]["moe"]["pad"] is True and "pad_ratio" not in meta["model_config"]["moe"]
  report = meta["pad_net"]
  assert (report["dynamic"], report["entries"], report["rounds"], report["batches"]) == (kept, n, 2, 2)
  assert report["schedule"] == "exponential" and report["scope"] == "global" and len(report["shares"]) == 2
  for s in (2, 4):  # every checkpoint holds the masks
    assert all(np.array_equal(a, b) for a, b in zip(saved_masks(out, s), masks))


def test_resume_restores_the_masks_and_continues_exactly(straight, tmp_path, capsys):
  out, ref, _ = straight
  first = run(cfg(tmp_path, stop_at=2))
  assert [r["step"] for r in first] == [1, 2]
  capsys.readouterr()
  # another ratio on resume changes nothing: a resumed run restores its masks and never partitions again
  resumed = run(cfg(tmp_path, moe=MoEFlags(**{**PAD.__dict__, "pad_ratio": 0.9})))
  assert "PAD-Net" not in capsys.readouterr().err
  assert trace(resumed) == trace(ref)
  assert all(np.array_equal(a, b) for a, b in zip(saved_masks(tmp_path), saved_masks(out)))
  assert json.load(open(tmp_path / "config.json"))["pad_net"] == json.load(open(out / "config.json"))["pad_net"]


def test_no_ratio_or_a_ratio_of_one_leaves_every_entry_dynamic(tmp_path, capsys):
  run(cfg(tmp_path, steps=1, ckpt_every=1, moe=MoEFlags(**{**PAD.__dict__, "pad_ratio": 1.0})))
  assert all(m.all() for m in saved_masks(tmp_path))
  assert "pad_net" not in json.load(open(tmp_path / "config.json"))
  assert "PAD-Net" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--moe.pad", "True", "--moe.pad-ratio", "0"], "--moe.pad-ratio must lie in (0, 1], got 0.0"),
    (["--moe.pad", "True", "--moe.pad-ratio", "1.5"], "--moe.pad-ratio must lie in (0, 1], got 1.5"),
    (["--moe.pad", "True", "--moe.pad-ratio", "0.5", "--moe.pad-rounds", "0"], "--moe.pad-rounds must be positive"),
    (["--moe.pad", "True", "--moe.pad-ratio", "0.5", "--moe.pad-batches", "0"], "--moe.pad-batches must be positive"),
    (["--moe.pad-ratio", "0.5"], "--moe.pad-ratio needs --moe.pad"),
    (["--moe.pad", "False", "--moe.pad-ratio", "0.5"], "--moe.pad-ratio needs --moe.pad"),
    (["--moe.pad", "True", "--moe.pad-rounds", "3"], "--moe.pad-rounds needs --moe.pad-ratio"),
    (["--moe.pad", "--moe.pad-ratio", "0.5", "--moe.pad-batches", "1000000"],  # the switch, bare
     "--moe.pad-batches 1000000: PAD-Net's partition scores at most as many batches at step 0 as the run trains on "
     "(--steps 200), or 4"),
])
def test_bad_partition_flags_are_refused_in_one_line(tmp_path, capsys, flags, message):
  assert message in bad(tmp_path, capsys, "--moe.num-experts", "4", *flags)


def test_a_partitioned_run_loads_with_its_masks(tmp_path):
  """`load_run` (research.export, sample, --init-from) restores the model's buffers with its parameters: the masks a
  PAD-Net run partitioned (a model with buffers failed to merge before)."""
  from research.train.store.pretrained import load_run
  out = tmp_path / "run"
  with contextlib.redirect_stderr(io.StringIO()):
    run(cfg(out, steps=2, ckpt_every=2))
  model, _, step = load_run(str(out))
  masks = [np.asarray(getattr(model.blocks.moe, name)[...]) for name in padnet.MASKS.values()]
  assert step == 2 and masks and not all(m.all() for m in masks)  # partitioned: not all dynamic
  assert [m.tolist() for m in masks] == [m.tolist() for m in saved_masks(out)]


def test_a_run_initialised_from_a_partitioned_run_starts_from_its_masks(tmp_path):
  """--init-from an optlab PAD-Net run takes its masks with its parameters (they were reset to all dynamic)."""
  src, out = tmp_path / "src", tmp_path / "ft"
  with contextlib.redirect_stderr(io.StringIO()):
    run(cfg(src, steps=2, ckpt_every=2))
    run(cfg(out, steps=1, ckpt_every=1, init_from=str(src), moe=MoEFlags(pad=True), model=None))
  assert [m.tolist() for m in saved_masks(out)] == [m.tolist() for m in saved_masks(src)]
