"""research/experiments/quantization.py at smoke size (as notebooks/quantization.ipynb ran it): every method ran at
every budget and seed; CALM, the MSE choice and the oracle chose per layer what their own scores say; sizes are
ordered as the widths say; every mixed layout fits its budget and the exact search is never worse than greedy on its
own objective."""

import numpy as np
import pytest

from research.experiments import quantization


@pytest.fixture(scope="module")
def result(notebooks):
  return notebooks.run("quantization").result


def test_protocol(result):
  smoke = quantization.Config(**quantization.SMOKE)
  assert set(result["models"]) == set(smoke.models)
  rec = result["models"]["tiny"]
  assert set(rec["seeds"]) == {str(s) for s in smoke.seeds}
  for seed in rec["seeds"].values():
    assert set(seed["budgets"]) == set(smoke.budgets)
    for b in seed["budgets"].values():
      assert set(b["uniform"]) == set(quantization.ALGORITHMS)
      assert all(np.isfinite(v["val"]) and np.isfinite(v["calib"]) for v in b["uniform"].values())
    assert set(seed["mixed"]) == {str(b) for b in smoke.mixed_bits}


def test_each_choice_is_the_best_of_its_own_scores(result):
  for seed in result["models"]["tiny"]["seeds"].values():
    for b in seed["budgets"].values():
      assert b["cka"]["chosen"] == [max(s, key=s.get) for s in b["cka"]["scores"]]
      assert b["mse"]["chosen"] == [min(s, key=s.get) for s in b["mse"]["scores"]]
      assert b["oracle"]["chosen"] == [min(d, key=d.get) for d in b["oracle"]["one_layer_delta"]]
      assert all(0.0 < v <= 1.0 + 1e-6 for s in b["cka"]["scores"] for v in s.values())
      for by in ("cka", "mse", "oracle"):  # one algorithm in every layer is that uniform plan, with its numbers
        if len(set(b[by]["chosen"])) == 1:
          assert {k: b[by][k] for k in ("val", "calib", "bytes")} == b["uniform"][b[by]["chosen"][0]]


def test_sizes_follow_the_widths(result):
  rec = result["models"]["tiny"]
  for seed in rec["seeds"].values():
    w3 = {a: v["bytes"] for a, v in seed["budgets"]["w3g64"]["uniform"].items()}
    w8 = {a: v["bytes"] for a, v in seed["budgets"]["w8a8"]["uniform"].items()}
    assert max(w3.values()) < min(w8.values()) < rec["float32_bytes"]


def test_mixed_layouts_fit_their_budget_and_exact_is_optimal(result):
  for seed in result["models"]["tiny"]["seeds"].values():
    for bits, layouts in seed["mixed"].items():
      for name, v in layouts.items():
        assert v["layout_bytes"] <= v["budget_bytes"], name
        assert set(v["bits"]) <= {2, 3, 4, 8, 16}
      exact, greedy = layouts["first_order exact"], layouts["first_order greedy"]
      assert exact["predicted_first_order"] <= greedy["predicted_first_order"] + 1e-12
      assert layouts["hessian exact"]["predicted_hessian"] <= exact["predicted_hessian"] + 1e-12
      assert set(layouts[f"uniform {bits}"]["bits"]) == {int(bits)}


def test_speed_is_measured(result):
  speed = result["models"]["tiny"]["speed"]
  assert speed["float32_s"] > 0 and speed["w3g64 rtn"] > 0 and speed["w8a8 smoothquant"] > 0


def test_a_plan_met_again_is_not_quantized_or_measured_again(monkeypatch):
  made = []
  monkeypatch.setattr(quantization, "quantized", lambda fp, plan, x: made.append(plan) or len(made))
  judged = quantization.Judged("fp", "x", lambda model: {"val": float(model)})
  spec = lambda bits: quantization.quant.Spec("rtn", bits, 64)  # noqa: E731
  first = judged({"a": [spec(3), spec(4)], "b": [spec(3), spec(3)]})
  again = judged({"b": [spec(3)] * 2, "a": [spec(3), spec(4)]})  # equal specs, other objects and order
  other = judged({"a": [spec(3), spec(3)], "b": [spec(3), spec(3)]})
  assert first == again == {"val": 1.0} and other == {"val": 2.0} and len(made) == 2
  first["val"] = -1.0  # callers extend what they get; the memo keeps its own
  assert judged({"a": [spec(3), spec(4)], "b": [spec(3), spec(3)]}) == {"val": 1.0}


def test_layouts_below_float32_are_counted_as_distinct_models():
  """Two seeds choosing the same RTN widths are one model measured twice: the claim counts it once."""
  def layout(val, bits):
    return {"val": val, "calib": 1.0, "predicted_first_order": val - 2.0, "bytes": 10, "bits": bits}
  seeds = {str(s): {"fp_calib": 1.0, "budgets": {}, "mixed": {"4": {"first_order exact": layout(1.9, [4, 8]),
                                                                     "uniform 4": layout(2.1, [4, 4])}}}
           for s in (0, 1)}
  seeds["1"]["mixed"]["4"]["first_order exact"] = layout(1.95, [2, 8])
  claim = quantization.summarize({"m": {"fp_val": 2.0, "seeds": seeds}})["m"]["claim"]
  assert (claim["layouts"], claim["held_out_below_fp"]) == (4, 2)
  assert (claim["distinct_models"], claim["distinct_below_fp"]) == (3, 2)
  assert claim["most_below_fp"] == pytest.approx(-0.1)
  assert "2 of 3 distinct models, the lowest -1.0e-01" in quantization._distinct(claim)
  # seed 1 quantized another pretraining (another machine's bits), 0.05 lower in float32: ΔL against its own
  seeds["0"]["model_id"] = "one"
  seeds["1"].update(model_id="other", fp_val=1.95)
  s = quantization.summarize({"m": {"fp_val": 2.0, "seeds": seeds}})["m"]
  assert s["models"] == 2 and s["mixed"]["4"]["uniform 4"]["delta_val"] == pytest.approx([0.1, 0.15])
  assert s["mixed"]["4"]["first_order exact"]["delta_val"] == pytest.approx([-0.1, 0.0])
  assert (s["claim"]["distinct_models"], s["claim"]["distinct_below_fp"]) == (4, 1)


def test_a_half_done_seed_of_another_pretraining_starts_over():
  unfinished = {"0": {"model_id": "a", "budgets": {"w3g64": 1}}, "1": {"budgets": {"w3g64": 2}}}  # 1: no id saved
  fresh = lambda: {"model_id": "a", "budgets": {}}  # noqa: E731
  assert quantization.seed_record(unfinished, 0, "a", fresh) == ({"model_id": "a", "budgets": {"w3g64": 1}}, None)
  assert quantization.seed_record(unfinished, 1, "a", fresh) == ({"model_id": "a", "budgets": {}}, "None")
  out, dropped = quantization.seed_record(unfinished, 0, "b", lambda: {"model_id": "b", "budgets": {}})
  assert (out, dropped) == ({"model_id": "b", "budgets": {}}, "a") and unfinished["0"] is out
  assert quantization.seed_record(unfinished, 2, "b", fresh)[1] is None and set(unfinished) == {"0", "1", "2"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """A random tiny Llama saved by transformers (no tokenizer: the study reads bytes, so its vocabulary is 256)."""
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128)
  path = tmp_path_factory.mktemp("llama")
  transformers.LlamaForCausalLM(config).save_pretrained(path)
  return str(path)


def test_an_imported_hugging_face_llama_runs_through_the_study(llama):
  result = quantization.main(quantization.Config(smoke=True, models=(llama,)))
  rec = result["models"][llama]
  assert result["settings"]["pretrain_steps"] == quantization.SMOKE["pretrain_steps"]  # smoke sizes, our model
  assert rec["params"] == 2 * (4 * 64 * 64 - 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 2 * 256 * 64 + 64
  for seed in rec["seeds"].values():
    for b in seed["budgets"].values():
      assert all(np.isfinite(v["val"]) for v in b["uniform"].values())
      assert b["cka"]["chosen"] == [max(s, key=s.get) for s in b["cka"]["scores"]] and len(b["cka"]["chosen"]) == 2
    for layouts in seed["mixed"].values():
      assert all(v["layout_bytes"] <= v["budget_bytes"] for v in layouts.values())


def test_a_model_that_is_neither_a_preset_nor_a_directory_is_one_line():
  with pytest.raises(SystemExit, match=r"^error: --models nope: neither a preset .* nor a model directory"):
    quantization.main(quantization.Config(smoke=True, models=("nope",)))


def test_write_reports_tables_readings_a_resumed_run_and_the_plot(result, tmp_path):
  """What the full run writes, from the smoke result: the tables, one reading per model and budget naming the best
  uniform algorithm, the time said to be this invocation's (and that it resumed, when it did), and the plot."""
  cfg = quantization.Config(out=str(tmp_path))
  quantization.write(cfg, {**result, "resumed": True}, cmd="python -m research.experiments.quantization")
  md = (tmp_path / "results.md").read_text()
  assert "### `tiny`" in md and "| uniform gptq |" in md
  best = min(quantization.ALGORITHMS, key=lambda a: np.mean(result["summary"]["tiny"]["budgets"]["w3g64"]
                                                                [f"uniform {a}"]["delta_val"]))
  assert f"Reading (tiny, w3g64): best uniform algorithm {best} " in md
  assert "Time of this invocation (it resumed what earlier invocations had finished" in md
  assert (tmp_path / "quantization.png").read_bytes()[:4] == b"\x89PNG"
  quantization.write(cfg, {**result, "resumed": False}, cmd="python -m research.experiments.quantization")
  assert "Time of this invocation: " in (tmp_path / "results.md").read_text()
