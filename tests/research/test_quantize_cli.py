"""`python -m research.quantize`: a trained run quantized and evaluated on held-out data, its output directory a model
that loads, evaluates to the loss it reported (on one device or a mesh) and samples; a plan written, edited and
applied as given; one-line errors that leave everything already written as it was."""

import json
import os

import numpy as np
import pytest

from models import quant, quant_store
from research import quantize, sample
from research.data import eval_batches, load_corpus
from research.train import TrainConfig, run
from sharding.mesh import make_mesh

TINY = dict(model="tiny", steps=6, batch_size=8, seq_len=32, log_every=3, eval_every=6, ckpt_every=6,
            warmup_steps=1, eval_batches=1, progress=False, mesh="data=-1")
SMOKE = ["--calib", "4", "--calib-len", "32", "--eval-batches", "2", "--batch-size", "4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  out = tmp_path_factory.mktemp("run")
  run(TrainConfig(out=str(out), **TINY))
  return str(out)


def test_a_run_quantizes_evaluates_and_samples(trained, tmp_path, capsys):
  out = str(tmp_path / "q")
  quantize.main([trained, out, "--method", "awq", "--bits", "4", "--group", "32", *SMOKE])
  printed = capsys.readouterr().out
  assert "held-out loss: full precision" in printed and "size on disk" in printed
  report = json.load(open(os.path.join(out, "eval.json")))
  assert report["stored_bytes"] == quant_store.stored_bytes(out) < report["float32_bytes"]
  assert np.isfinite(report["quant_loss"]) and report["quant_loss"] != report["full_loss"]
  model, config, plan = quant_store.load(out)
  assert all(s.algorithm == "awq" and s.bits == 4 for specs in plan.values() for s in specs)
  val = eval_batches(load_corpus().val, 4, 32, 2)
  assert quantize.eval_loss(model, val) == pytest.approx(report["quant_loss"], abs=1e-6)
  assert quantize.eval_loss(model, val, make_mesh("fsdp=4,tensor=2")) == pytest.approx(report["quant_loss"], abs=1e-5)
  sample.main([out, "--max-new-tokens", "5", "--temperature", "0"])
  assert capsys.readouterr().out.startswith("def ")


def test_a_written_plan_is_edited_and_applied_as_given(trained, tmp_path):
  plan_file = str(tmp_path / "plan.json")
  quantize.main([trained, plan_file, "--method", "rtn", "--bits", "4", "--write-plan"])
  data = json.load(open(plan_file))
  data["layers"]["blocks/w_down_FD"] = [{"algorithm": "gptq", "bits": 8}, {"algorithm": "rtn", "bits": 16}]
  json.dump(data, open(plan_file, "w"))
  out = str(tmp_path / "q")
  quantize.main([trained, out, "--plan", plan_file, *SMOKE])
  _, _, plan = quant_store.load(out)
  assert [(s.algorithm, s.bits) for s in plan["blocks/w_down_FD"]] == [("gptq", 8), ("rtn", 16)]
  assert all(s.bits == 4 for s in plan["blocks/wq_DQ"])


def test_calm_chooses_per_layer_by_cka_and_reports_the_scores(trained, tmp_path, capsys):
  out = str(tmp_path / "calm")
  quantize.main([trained, out, "--method", "calm", "--candidates", "rtn,gptq,awq", "--bits", "3", *SMOKE])
  assert "cka choice per layer:" in capsys.readouterr().out
  report = json.load(open(os.path.join(out, "eval.json")))
  scores = report["selection"]
  assert scores["by"] == "cka" and len(scores["per_layer"]) == 2
  assert scores["chosen"] == [max(s, key=s.get) for s in scores["per_layer"]]
  _, _, plan = quant_store.load(out)
  assert all([s.algorithm for s in specs] == scores["chosen"] and {s.bits for s in specs} == {3}
             for specs in plan.values())


@pytest.mark.parametrize("sensitivity", ["first_order", "first_plus_hessian"])
def test_a_mixed_precision_layout_fits_the_budget_and_is_applied(trained, tmp_path, capsys, sensitivity):
  out = str(tmp_path / "mp")
  quantize.main([trained, out, "--method", "mixed", "--bits", "4", "--sensitivity", sensitivity,
                 "--hessian-samples", "4", *SMOKE])
  assert f"{sensitivity} layout (exact)" in capsys.readouterr().out
  report = json.load(open(os.path.join(out, "eval.json")))
  chosen = report["selection"]
  assert chosen["layout_bytes"] <= chosen["budget_bytes"]
  _, _, plan = quant_store.load(out)
  assert {f"{p}[{i}]": s.bits for p, specs in plan.items() for i, s in enumerate(specs)} == chosen["bits"]
  assert all(s.algorithm == "rtn" for specs in plan.values() for s in specs)


def test_bad_input_is_one_line_and_nothing_is_overwritten(trained, tmp_path, capsys):
  out = tmp_path / "q"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  bad_plan = tmp_path / "bad.json"
  bad_plan.write_text(json.dumps({"format": quant.PLAN_FORMAT, "layers": {"blocks/wq_DQ": [{"bits": 4}]}}))
  for argv in ([trained, str(out)],
               [trained, str(tmp_path / "a"), "--method", "nope"],
               [trained, str(tmp_path / "b"), "--bits", "5"],
               [trained, str(tmp_path / "c"), "--group", "48"],
               [trained, str(tmp_path / "d"), "--plan", str(bad_plan)],
               [trained, str(tmp_path / "e"), "--plan", str(tmp_path / "missing.json")],
               [str(tmp_path / "nowhere"), str(tmp_path / "f")],
               [trained, str(tmp_path / "g"), "--method", "calm", "--select-by", "ppl"],
               [trained, str(tmp_path / "h"), "--method", "mixed", "--sensitivity", "curvature"]):
    with pytest.raises(SystemExit) as e:
      quantize.main([*argv, *SMOKE])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
  assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
  assert not any(os.path.exists(tmp_path / n) for n in "abcdefgh")


def test_the_runs_data_edited_since_is_named_in_one_line(tmp_path, capsys):
  """config.json records the corpus fingerprint; quantize measures on the run's --data as it is now and says so."""
  data = tmp_path / "d.txt"
  data.write_text("def f(x):\n    return x + 1\n" * 400)
  out = tmp_path / "run"
  run(TrainConfig(out=str(out), data=(str(data),), **{**TINY, "steps": 2, "eval_every": 2, "ckpt_every": 2}))
  with open(data, "a") as f:
    f.write("class Edited:\n    pass\n" * 50)
  capsys.readouterr()
  quantize.main([str(out), str(tmp_path / "q"), "--method", "rtn", *SMOKE])
  warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
  assert len(warned) == 1 and warned[0].startswith(f"warning: the data {out} was trained on has changed since"), warned
