"""Fine-tuning from a checkpoint: --init-from an optlab run or a Hugging Face directory starts from exactly its
parameters with a fresh optimizer, takes its model config (a conflicting flag is refused), resumes as any run does;
--freeze keeps the matching parameters fixed with no optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from research.train import RunError, TrainConfig, main, run
from research.train.store.pretrained import load_run

TINY = dict(model="tiny", steps=4, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=2,
            warmup_steps=0, eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2")


def params_of(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  out = tmp_path_factory.mktemp("source")
  run(TrainConfig(out=str(out), **TINY))
  return str(out)


def test_lr_zero_keeps_exactly_the_source_parameters(source, tmp_path):
  """From a run and from its HF export: with lr 0 (and so no decay) the parameters stay the source's, bit for bit."""
  want = params_of(load_run(source)[0])
  models.to_hf(load_run(source)[0], str(tmp_path / "hf"))
  for init, out in ((source, tmp_path / "a"), (f"hf:{tmp_path / 'hf'}", tmp_path / "b")):
    run(TrainConfig(out=str(out), **{**TINY, "steps": 2, "model": "small"}, init_from=init, lr=0.0,
                    schedule="constant"))
    got = params_of(load_run(str(out))[0])
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_bfloat16_checkpoint_trains_float32_weights_and_exports_bfloat16(source, tmp_path):
  """The dtype policy: from a bfloat16 Hugging Face file the trained parameters are float32 (widened exactly), the
  frozen ones bfloat16; research.export writes the source's dtype back unless --dtype says otherwise."""
  import json

  from research import export
  bf16 = export.in_dtype(load_run(source)[0], "bfloat16")
  models.to_hf(bf16, str(tmp_path / "hf"))
  run(TrainConfig(out=str(tmp_path / "ft"), **{**TINY, "steps": 2}, init_from=f"hf:{tmp_path / 'hf'}", lr=0.0,
                  schedule="constant", freeze="embed"))
  assert json.load(open(tmp_path / "ft" / "config.json"))["model_config"]["param_dtype"] == "float32"
  got, want = params_of(load_run(str(tmp_path / "ft"))[0]), params_of(bf16)
  assert got["blocks"]["wq_DQ"].dtype == np.float32  # trained: float32, equal to the bfloat16 values (lr 0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(np.float32)), got, want)
  export.main([str(tmp_path / "ft"), str(tmp_path / "out")])
  assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
  jax.tree.map(np.testing.assert_array_equal, params_of(models.from_hf(str(tmp_path / "out"))[0]), want)
  export.main([str(tmp_path / "ft"), str(tmp_path / "out32"), "--dtype", "float32"])
  assert json.load(open(tmp_path / "out32" / "config.json"))["torch_dtype"] == "float32"


def test_fine_tuning_resumes_as_any_run(source, tmp_path):
  whole = run(TrainConfig(out=str(tmp_path / "whole"), **TINY, init_from=source))
  run(TrainConfig(out=str(tmp_path / "cut"), **TINY, init_from=source, stop_at=2))
  resumed = run(TrainConfig(out=str(tmp_path / "cut"), **TINY, init_from=source))
  assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in whole]
  fresh = run(TrainConfig(out=str(tmp_path / "fresh"), **TINY))
  assert whole[0]["loss"] < fresh[0]["loss"]  # it starts from the trained source, not from scratch


def test_a_conflicting_model_flag_is_refused(source, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    main(["--init-from", source, "--d-model", "128", "--out", str(tmp_path), "--no-progress"])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err == f"error: --d-model 128 conflicts with --init-from {source} (d_model=64); " \
                                      "leave it out"


def test_freeze_keeps_parameters_fixed_and_drops_their_state(source, tmp_path, capsys):
  before = params_of(load_run(source)[0])
  run(TrainConfig(out=str(tmp_path), **TINY, init_from=source, freeze="embed|norm"))
  err = capsys.readouterr().err
  assert "froze " in err and "stored as bfloat16" in err and "MiB smaller" in err
  after = params_of(load_run(str(tmp_path))[0])
  bf16 = lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32)  # noqa: E731  (fine-tuning's default)
  np.testing.assert_array_equal(after["embed_VD"], bf16(before["embed_VD"]))
  np.testing.assert_array_equal(after["final_norm"], bf16(before["final_norm"]))
  np.testing.assert_array_equal(after["blocks"]["attn_norm"], bf16(before["blocks"]["attn_norm"]))
  assert not np.array_equal(after["blocks"]["wq_DQ"], before["blocks"]["wq_DQ"])
  with pytest.raises(SystemExit):  # a different --freeze changes the optimizer state: refused, checkpoint kept
    main(["--init-from", source, "--freeze", "embed", "--out", str(tmp_path), "--no-progress"] +
         [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k not in ("progress", "model")])
  assert "freeze: 'embed|norm' -> 'embed'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
  out = tmp_path_factory.mktemp("moe_source")
  run(TrainConfig(out=str(out), **{**TINY, "model": "moe_tiny", "steps": 2, "mesh": "data=2,expert=2,tensor=2"}))
  return str(out)


@pytest.mark.parametrize("optimizer", ["muon", "badam"])
def test_fine_tunes_an_moe_on_an_expert_mesh_with_freeze(moe_source, tmp_path, optimizer):
  """Label-routed (Muon) and block-state (BAdam) optimizers under --freeze, from an MoE run on an expert mesh (all 13
  registered optimizers pass this; two run here to keep the suite short). The exact two-gradient modes refuse
  --freeze in one line."""
  before = params_of(load_run(moe_source)[0])
  moe = {**TINY, "steps": 2, "mesh": "data=2,expert=2,tensor=2"}
  recs = run(TrainConfig(out=str(tmp_path / "ft"), **moe, init_from=moe_source, optimizer=optimizer,
                         freeze="embed|norm", frozen_dtype="float32"))  # kept exactly as they were
  assert np.isfinite(recs[-1]["loss"])
  after = params_of(load_run(str(tmp_path / "ft"))[0])
  np.testing.assert_array_equal(after["embed_VD"], before["embed_VD"])
  assert not np.array_equal(after["blocks"]["moe"]["w_up_EDF"], before["blocks"]["moe"]["w_up_EDF"])
  with pytest.raises(RunError,
                     match="--freeze does not combine with --optimizer muon_mvr's update argument prev_grads"):
    run(TrainConfig(out=str(tmp_path / "mvr2"), **moe, init_from=moe_source, optimizer="muon_mvr",
                    opt=("mode=mvr2",), freeze="embed"))
