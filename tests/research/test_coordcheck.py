"""The coordinate check (`python -m research.bench coordcheck`): a smoke run at two tiny widths writes its record with
finite numbers; its probe reads the model's own embedding table and forward (NumPy, and the scanned forward, as
oracles); its slope is the exponent of a known power law; bad flags are one line."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from models import Transformer
from research.bench import cli
from research.bench import coordcheck as cc

SMOKE = ["--widths", "32", "64", "--optimizers", "adamw", "muon-keller", "--steps", "1", "--seeds", "1",
         "--batch-size", "2", "--seq-len", "16"]


def finite_numbers(tree):
  if isinstance(tree, dict):
    return [x for v in tree.values() for x in finite_numbers(v)]
  if isinstance(tree, list):
    return [x for v in tree for x in finite_numbers(v)]
  return [tree] if isinstance(tree, float) else []


def test_smoke_run_writes_the_record_and_the_probe_reads_the_models_own_weights(tmp_path, monkeypatch):
  trained = []  # (config, probe, the weights after the last step) of each run in order, kept by the tracer's wrapper

  def keeping(c, tx, probe):
    run = tracer(c, tx, probe)

    def kept(seed, batches):
      rec, params = run(seed, batches)
      trained.append((c, probe, params))
      return rec, params
    return kept

  tracer = cc.make_tracer
  monkeypatch.setattr(cc, "make_tracer", keeping)
  cli.main(["coordcheck", *SMOKE, "--out", str(tmp_path)])
  names = {"coordcheck.md", "coordcheck.json", "coordcheck_adamw.png", "coordcheck_muon-keller.png"}
  assert names <= {p.name for p in tmp_path.iterdir()}
  record = json.loads((tmp_path / "coordcheck.json").read_text())
  numbers = finite_numbers(record["results"])
  assert len(numbers) > 500 and all(math.isfinite(x) for x in numbers)
  run = record["results"]["adamw"]["runs"]["32"][0]
  assert set(run["act"]) == {"embed", "logits", *(f"L{l}.{k}" for l in range(4) for k in ("attn", "mlp", "resid"))}
  assert set(run["rms"]) == {"embed", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
  assert len(run["rms"]["wq"][0]) == 4  # one number per layer
  text = (tmp_path / "coordcheck.md").read_text()
  assert "`python -m research.bench coordcheck --widths 32 64 --optimizers adamw muon-keller --steps 1" in text
  assert "| muon-keller | 0.03 |" in text

  # the recorded embedding and logits are the model's own, computed here independently: in NumPy from its embedding
  # table at init (a model built afresh) and after the step (the weights the run ended with), and by its scanned
  # forward (Transformer.__call__) for the logits
  c, (x, _), params = trained[0]  # the first run: adamw at width 32
  assert c.d_model == 32 and len(trained) == 4
  model0 = Transformer(c, rngs=nnx.Rngs(0))
  e0 = np.asarray(model0.embed_VD[...], np.float64)
  e1 = np.asarray(params["embed_VD"], np.float64)
  np.testing.assert_allclose(run["act"]["embed"], [np.abs(e0[x]).mean(), np.abs(e1[x]).mean()], rtol=1e-6)
  np.testing.assert_allclose(run["dact"]["embed"][1], np.abs(e1[x] - e0[x]).mean(), rtol=1e-4)
  np.testing.assert_allclose(run["rms"]["embed"][0][0], np.sqrt(np.mean((e1 - e0) ** 2)), rtol=1e-4)
  graphdef, _, buffers = nnx.split(model0, nnx.Param, ...)
  logits = np.asarray(nnx.merge(graphdef, params, buffers)(x), np.float64)
  np.testing.assert_allclose(run["act"]["logits"][1], np.abs(logits).mean(), rtol=1e-5)
  assert run["act"]["logits"][1] != run["act"]["logits"][0]  # the step moved the model


def test_slope_is_the_exponent_of_a_power_law():
  w = np.array([64, 128, 256, 512])
  assert cc.loglog_slope(w, 3.0 * w ** 0.5) == pytest.approx(0.5, abs=1e-12)
  assert cc.loglog_slope(w, 0.2 * w ** -1.0) == pytest.approx(-1.0, abs=1e-12)
  assert cc.loglog_slope(w, np.full(4, 7.0)) == pytest.approx(0.0, abs=1e-12)
  noisy = 2.0 * w * np.array([1.1, 0.9, 1.1, 0.9])  # least squares: log(1.1) and log(0.9) in turn bend it down
  x, y = np.log(w), np.log(noisy)
  fit = np.sum((x - x.mean()) * (y - y.mean())) / np.sum((x - x.mean()) ** 2)  # the least-squares slope by hand
  assert cc.loglog_slope(w, noisy) == pytest.approx(fit, abs=1e-12) and fit < 1
  assert math.isnan(cc.loglog_slope([64], [1.0])) and math.isnan(cc.loglog_slope(w, [1.0, 0.0, 1.0, 1.0]))


def test_update_sizes_of_a_known_update():
  params = {"embed_VD": np.ones((4, 2), np.float32), "blocks": {"wq_DQ": np.full((2, 3, 3), 2.0, np.float32),
                                                                "attn_norm": np.ones((2, 3), np.float32)}}
  updates = {"embed_VD": np.full((4, 2), 0.5, np.float32), "blocks": {"wq_DQ": np.stack([np.full((3, 3), 0.1),
                                                                                          np.zeros((3, 3))]),
                                                                       "attn_norm": np.ones((2, 3), np.float32)}}
  sizes = jax.tree.map(np.asarray, cc.update_sizes(updates, params))
  assert set(sizes) == {"embed", "wq"}  # norm scales are no matrices
  np.testing.assert_allclose(sizes["embed"], [[0.5], [0.5]], rtol=1e-6)  # RMS, ‖ΔW‖/‖W‖
  np.testing.assert_allclose(sizes["wq"], [[0.1, 0.0], [0.05, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("argv, says", [
    (["--lrs", "sgd=0.1"], "--lrs 'sgd=0.1': give CONTENDER=LR"),
    (["--lrs", "adamw=-1"], "--lrs 'adamw=-1': the learning rate must be finite and >= 0"),
    (["--optimizers", "muon"], "--optimizers 'muon' is not one of adamw, muon-keller"),
    (["--widths", "0"], "--widths must be >= 1, got 0"),
])
def test_bad_flags_are_one_line(capsys, argv, says, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(["coordcheck", *argv, "--out", str(tmp_path / "new")])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {says}"), err
  assert not (tmp_path / "new").exists()
