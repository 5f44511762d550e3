"""Observers through the train CLI (research/train/observers/): the step contract's numbers reach metrics.jsonl at
each observer's cadence, a diagnostic registered here (one file, one registration) is logged with no edit under
research/train/, observers change no loss, a resumed run's EMA continues exactly, and the blockwise and --freeze-layers
steps offer the same contract. (Each diagnostic's one-device vs 8-device equality is tested on its library function,
tests/optim/test_diagnostics_*.py: a run here cannot leave the process's 8 devices.)"""

import jax
import numpy as np
import optax
import pytest
from runs import trace

from research.train import TrainConfig, run
from research.train.config import RunError
from research.train.observers import Observer, register

SMALL = dict(model="tiny", n_layers=2, steps=4, batch_size=8, seq_len=32, log_every=4, eval_every=4, ckpt_every=2,
             warmup_steps=1, eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1.0,
             optimizer="muon", lr=1e-2, tracker=("none",))
OBSERVED = dict(watch=("params,grads", "updates", "momentum"), watch_every=2, histograms=True, spectra_every=2,
                sharpness_every=2, sharpness_iters=1, sharpness_rows=4, lanczos=3, gns_every=1, gns_groups=2,
                observe=("test_update_dot:1",))

OBSERVED_PREFIXES = ("watch", "spectra", "sharpness", "gns", "test_update_dot")

# A diagnostic written here, as a researcher would: one function on the step contract, one registration line.
register(Observer("test_update_dot", frozenset({"grads", "updates"}), "one dot product",
                  lambda result, held, section: {"dot": optax.tree.vdot(result.grads, result.updates)}))


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**SMALL, **kw})


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
  return run(cfg(tmp_path_factory.mktemp("observed"), **OBSERVED))


def by_step(records):
  return {r["step"]: r for r in records}


@pytest.mark.xdist_group("observed_run")  # one worker builds the module's observed run once
def test_observers_log_at_their_cadence_and_change_no_loss(observed, tmp_path):
  plain = run(cfg(tmp_path))
  assert [r["step"] for r in plain] == [4]
  assert [r["step"] for r in observed] == [1, 2, 3, 4]  # every observed step is logged
  assert trace([r for r in observed if r["step"] == 4]) == trace(plain)  # observers read the step, change nothing
  recs = by_step(observed)
  assert recs[1]["test_update_dot/dot"] == 0  # the warmup's first step has lr 0
  for step in (1, 2, 3, 4):
    assert step == 1 or recs[step]["test_update_dot/dot"] < 0  # a descent direction
    assert np.isfinite(recs[step]["gns/b_simple_ema"])
  assert not any(k.startswith(("watch/", "spectra/", "sharpness/")) for k in recs[1])
  two = recs[2]
  assert len(two["watch/updates/rms/blocks/wq_DQ"]) == 2  # one per layer
  assert np.shape(two["watch/params/hist/blocks/w_up_DF"]) == (32,)
  assert sum(two["watch/params/hist/blocks/w_up_DF"]) == 2 * 64 * 128  # every entry counted once
  assert np.isscalar(two["watch/params/rms/embed_VD"])
  assert len(two["watch/momentum/rms/blocks/wq_DQ"]) == 2  # Muon's momentum, found in its state
  # Muon's update (moonlight scale 0.2 sqrt(max(m, n))) of a hidden matrix has RMS 0.2 * lr * (the mean singular value
  # of Newton-Schulz's output, which the quintic keeps within [0.7, 1.2]); weight decay adds lr * 0.1 * |W| ~ 2e-3 lr
  rms = np.asarray(two["watch/updates/rms/blocks/w_up_DF"]) / two["lr"]
  assert np.all((0.13 < rms) & (rms < 0.25)), rms
  assert np.shape(two["spectra/updates/sv_quantiles/blocks/wq_DQ"]) == (2, 5)
  assert "spectra/updates/spectral_norm/embed_VD" not in two  # matrices only: not the embedding
  # the eigenvalue of largest magnitude: early in training it can be a negative curvature
  assert np.isfinite(two["sharpness/lambda_max"]) and len(two["sharpness/interpolation"]) == 5
  assert len(two["sharpness/ritz"]) == 3 and two["sharpness/ritz"][0] >= two["sharpness/ritz"][1]
  assert 0 <= two["sharpness/overlap"] <= 1


@pytest.mark.xdist_group("observed_run")
def test_resumed_run_continues_the_observers_exactly(observed, tmp_path):
  first = run(cfg(tmp_path, stop_at=2, **OBSERVED))
  assert [r["step"] for r in first] == [1, 2]
  resumed = run(cfg(tmp_path, **OBSERVED))
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  for s in (3, 4):  # the EMA replayed from the first session's records, every number as the straight run's
    want = {k: v for k, v in by_step(observed)[s].items() if k.split("/")[0] in OBSERVED_PREFIXES + ("loss",)}
    assert {k: by_step(resumed)[s][k] for k in want} == want
  assert "gns/b_simple_ema" in by_step(resumed)[4]


@pytest.mark.parametrize("kind", [dict(optimizer="badam", opt=("switch_every=2",)), dict(freeze_layers=1)])
def test_blockwise_and_frozen_layer_steps_offer_the_contract(kind, tmp_path):
  recs = by_step(run(cfg(tmp_path, **{**dict(optimizer="adamw"), **kind}, watch=("updates",), watch_every=2,
                         sharpness_every=4, sharpness_iters=1, gns_every=4, gns_groups=2)))
  assert np.all(np.isfinite(recs[2]["watch/updates/rms/" + next(k.split("/", 3)[3] for k in recs[2]
                                                                if k.startswith("watch/updates/rms/"))]))
  assert np.isfinite(recs[4]["sharpness/lambda_max"]) and not np.isnan(recs[4]["gns/b_simple"])


def test_observer_flags_refused_in_one_line(tmp_path):
  with pytest.raises(RunError, match="no observer named 'nosuch'"):
    run(cfg(tmp_path / "a", observe=("nosuch:2",)))
  with pytest.raises(RunError, match="EVERY a whole number"):
    run(cfg(tmp_path / "b", observe=("test_update_dot:0",)))
  with pytest.raises(RunError, match="--watch gradz"):
    run(cfg(tmp_path / "c", watch=("gradz",)))
  with pytest.raises(RunError, match="--gns-groups 3 must divide --batch-size 8"):
    run(cfg(tmp_path / "d", gns_every=2, gns_groups=3))
  with pytest.raises(RunError, match="does not combine with --sync"):
    run(cfg(tmp_path / "e", watch=("updates",), sync="local:2"))


def test_the_default_sharpness_rows_split_over_the_batch_axes():
  """--sharpness-rows unset: 4 rows, rounded up to a multiple of the mesh's batch split (on --mesh data=8 four rows
  could not be split: a one-line error before this rounding), at most the batch."""
  from research.train.observers.sharpness import default_rows
  assert default_rows(16) == 4 and default_rows(2) == 2  # no mesh
  explicit = jax.sharding.AxisType.Explicit
  with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=(explicit,))):
    assert default_rows(16) == 8 and default_rows(8) == 8
  with jax.set_mesh(jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(explicit,) * 3)):
    assert default_rows(16) == 4
