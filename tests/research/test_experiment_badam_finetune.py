"""research/experiments/badam_finetune.py at smoke size: the protocol (pretrain once, fine-tune on the docs corpus
from it, lr grid then seeds), the held-out losses of the final checkpoints equal the runs' own, BAdam with the
reference defaults leaves the embedding and the final norm exactly as pretrained, and the state bytes are the
formula's."""

import pytest

from models import preset
from research.experiments import badam, badam_finetune


@pytest.fixture(scope="module")
def result(notebooks):
  """`badam_finetune.main(Config(smoke=True))`, as notebooks/badam_finetune.ipynb ran it."""
  return notebooks.run("badam_finetune").result


def test_protocol(result):
  smoke = badam_finetune.Config(**badam_finetune.SMOKE)
  names = result["settings"]["labels"]
  assert {(r["label"], r["lr"], r["seed"]) for r in result["tuning"]} == {
      (label, lr, smoke.seeds[0]) for label in names.values() for lr in smoke.lrs}
  assert sorted((r["label"], r["lr"], r["seed"]) for r in result["runs"]) == sorted(
      (names[k], result["best_lr"][k], s) for k in names for s in smoke.seeds)
  for r in result["tuning"] + result["runs"]:
    assert not r.get("diverged")
    # the final checkpoint, reloaded, gives the loss the train loop logged on the same held-out batches
    assert r["held_out"]["docs"] == pytest.approx(r["final_val_loss"], abs=1e-5)
  adamw = result["summary"]["adamw"]
  assert adamw["final_mean"] < result["start"]["docs"]  # it learned the new corpus
  assert result["settings"]["docs_corpus"]["val_bytes"] > 0


def test_badam_keeps_the_frozen_parameters(result):
  names = result["settings"]["labels"]
  for r in result["tuning"]:
    if r["label"] == names["badam"]:
      assert "embed_VD" not in r["changed"] and "final_norm" not in r["changed"]
      assert any(n.startswith("blocks/") for n in r["changed"])
    else:
      assert {"embed_VD", "final_norm"} <= set(r["changed"])


def test_state_bytes_and_outputs(result, tmp_path):
  b, e = result["state_bytes"], result["state_bytes_expected"]
  assert b == e and b["badam"] < b["adamw"]
  c = preset("tiny", n_layers=badam_finetune.SMOKE["n_layers"])
  assert b["badam"] == 8 * badam.layer_params(c) + 16
  lines = badam_finetune.tables(result)
  assert any(line.startswith("| BAdam") for line in lines)
  assert badam_finetune.findings(result)[0].startswith("Reading (learning)")
  assert len(badam_finetune.plot(result).axes) == 2
