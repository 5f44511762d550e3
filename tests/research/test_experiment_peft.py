"""research/experiments/peft.py at smoke size (as notebooks/peft.ipynb ran it): every contender ran its grid and its
seeds, the final checkpoints reload (adapters merged) to the losses the runs logged, the trainable budgets are the
ones the experiment states, adapters keep a fraction of full fine-tuning's optimizer state, and the entropy of a
rank-r LoRA update respects its bound H ≤ ln r."""

import math

import numpy as np
import pytest

from research.experiments import peft


@pytest.fixture(scope="module")
def result(notebooks):
  return notebooks.run("peft").result


def test_protocol(result):
  smoke = peft.Config(**peft.SMOKE)
  assert {(r["contender"], r["lr"]) for r in result["tuning"]} == {
      (n, lr) for n in smoke.contenders for lr in peft.lrs(smoke, n)}
  assert {(r["contender"], r["seed"]) for r in result["runs"]} == {
      (n, s) for n in smoke.contenders for s in smoke.seeds}
  for r in result["tuning"] + result["runs"]:
    assert not r.get("diverged")
    assert r["held_out"]["docs"] == pytest.approx(r["final_val_loss"], abs=1e-5), r["contender"]
  assert result["summary"]["adamw"]["docs"][0] < result["start"]["docs"]  # it learned the new corpus


def test_budgets_and_state(result):
  s, smoke = result["summary"], peft.Config(**peft.SMOKE)
  c_lora = s["lora"]["trainable"]
  # LoRA rank r on q,k,v,o (64 -> 64, 64 -> 32 twice, 64 -> 64) and gate, up (64 -> 128), down (128 -> 64), one layer
  r = smoke.rank
  assert c_lora == r * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
  assert abs(s["sparse_adapter"]["trainable"] - c_lora) <= 0.02 * c_lora  # Large-Sparse keeps rank r's budget
  assert s["dora"]["trainable"] == s["prediag"]["trainable"] == c_lora + 64 * 3 + 32 * 2 + 128 * 2
  for name in ("lora", "dora", "prediag", "sora", "sparse_adapter"):
    assert s[name]["state_bytes"] < s["adamw"]["state_bytes"] / 4, name


def test_costs_side_by_side(result):
  """Each contender's step measured as the trainer builds it: the adapters train a fraction of the weights with a
  bfloat16 base, so fewer FLOPs and bytes per parameter than full AdamW (12 B/param: float32 weights and moments)."""
  c = result["costs"]
  assert set(c) == set(peft.Config(**peft.SMOKE).contenders)
  assert c["adamw"]["flops_vs_adamw"] == 1 and abs(c["adamw"]["state_bytes_per_param"] - 12) < 0.01
  for name in ("lora", "dora", "prediag", "sora", "sparse_adapter"):
    assert c[name]["flops_vs_adamw"] < 0.9 and c[name]["state_bytes_per_param"] < 6, name
  assert all(x["peak_bytes"] > 0 for x in c.values())
  timed = peft.Config(**peft.SMOKE).timed  # the smoke times two steps, not every contender's
  assert {n for n in c if c[n]["step_s"] is not None} == set(timed) and all(c[n]["step_s"] > 0 for n in timed)


def test_entropy(result):
  s, smoke = result["summary"], peft.Config(**peft.SMOKE)
  assert s["lora"]["H"] <= math.log(smoke.rank) + 1e-6  # ΔW = s·AB has rank ≤ r
  assert s["adamw"]["H"] > s["lora"]["H"]
  h, n = peft.entropy(np.eye(4))
  assert h == pytest.approx(math.log(4)) and n == pytest.approx(1.0)
  assert peft.entropy(np.outer([1.0, 2, 3], [1.0, 0, 1]))[0] == pytest.approx(0.0, abs=1e-6)


def test_outputs(result):
  assert any(line.startswith("| LoRA") for line in peft.tables(result))
  assert peft.findings(result)[0].startswith("Reading (learning)")
  assert len(peft.plot(result).axes) == 2
