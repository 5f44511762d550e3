"""--peft in the train CLI: adapters train on a frozen --init-from base (bit for bit unchanged), sharded by the rules
table, checkpointed and resumed exactly; a PEFT run loads merged (export, sampling, --init-from) or adapted; a sparse
adapter is pruned by SNIP before the first step (and Muon trains it); bad combinations exit with one line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import from_hf, peft
from research import export
from research.train import TrainConfig, main, run
from research.train.store.pretrained import load_run

TINY = dict(model="tiny", steps=4, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=2,
            warmup_steps=0, eval_batches=1, progress=False, mesh="fsdp=4,tensor=2", lr=1e-2)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  out = tmp_path_factory.mktemp("base")
  run(TrainConfig(out=str(out), **{**TINY, "mesh": "data=2,fsdp=2,tensor=2"}))
  return str(out)


def test_adapters_train_on_a_frozen_base_and_resume_exactly(source, tmp_path):
  base = nnx.to_pure_dict(nnx.state(load_run(source)[0], nnx.Param))
  flags = dict(TINY, init_from=source, peft="dora")
  whole = run(TrainConfig(out=str(tmp_path / "whole"), **flags))
  run(TrainConfig(out=str(tmp_path / "cut"), **flags, stop_at=2))
  resumed = run(TrainConfig(out=str(tmp_path / "cut"), **flags))
  assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in whole]

  adapted = load_run(str(tmp_path / "whole"), merge=False)[0]
  # the base weights are the source's, stored in bfloat16 (fine-tuning's default)
  for path, a in peft.adapters(adapted):
    keys = path.split("/")
    assert a.w0[...].dtype == jnp.bfloat16, path
    np.testing.assert_array_equal(np.asarray(a.w0[...]), np.asarray(base[keys[0]][keys[1]].astype(jnp.bfloat16)),
                                  err_msg=path)
    assert float(jnp.abs(a.b_RO[...]).max()) > 0, path
  np.testing.assert_array_equal(np.asarray(adapted.embed_VD[...]), np.asarray(base["embed_VD"].astype(jnp.bfloat16)))
  meta = json.load(open(tmp_path / "whole" / "config.json"))["peft"]
  assert meta["trainable"] == peft.trainable_count(adapted) and meta["opt_state_bytes"] < meta[
      "full_ft_opt_state_bytes"] / 5

  merged = load_run(str(tmp_path / "whole"))[0]  # what export, sampling and --init-from get
  assert not peft.adapters(merged)
  np.testing.assert_allclose(np.asarray(merged(TOKENS)), np.asarray(adapted(TOKENS)), rtol=1e-5, atol=1e-5)
  export.main([str(tmp_path / "whole"), str(tmp_path / "hf")])
  np.testing.assert_allclose(np.asarray(from_hf(str(tmp_path / "hf"))[0](TOKENS)), np.asarray(merged(TOKENS)),
                             rtol=1e-5, atol=1e-5)


def test_sparse_adapter_is_pruned_before_training_and_muon_trains_it(tmp_path, capsys):
  """Muon on the adapters: each layer's A and B orthogonalized (their pruned entries stay out of the weight)."""
  flags = dict(TINY, steps=2, peft="sparse_adapter", optimizer="muon",
               peft_options=peft_flags(rank=2, sparsity=0.75))
  run(TrainConfig(out=str(tmp_path), **flags))
  assert "peft sparse_adapter: " in capsys.readouterr().err
  adapted = load_run(str(tmp_path), merge=False)[0]
  masks = [np.asarray(m[...]) for _, a in peft.adapters(adapted) for m in (a.mask_a, a.mask_b)]
  kept = sum(m.sum() for m in masks) / sum(m.size for m in masks)
  assert abs(kept - 0.25) < 1e-3  # a rank-8 adapter, 75% pruned: rank 2's budget
  meta = json.load(open(tmp_path / "config.json"))["peft"]
  assert meta["trainable"] == peft.trainable_count(adapted)
  for _, a in peft.adapters(adapted):  # B moved from zero; pruned entries never enter the weight
    b = np.asarray(a.factors()[1])
    assert np.abs(b).max() > 0
    np.testing.assert_array_equal(b[np.asarray(a.mask_b[...]) == 0], 0)


def peft_flags(**kw):
  from research.train.config import PeftFlags
  return PeftFlags(**kw)


@pytest.mark.parametrize("argv, message", [
    (["--peft", "lora", "--freeze", "embed"], "does not combine with --freeze"),
    (["--peft", "lora", "--peft.targets", "nothing"], "match no weight matrix"),
    (["--peft", "sora", "--qkv-bias", "True"], "the projection has a bias"),
])
def test_bad_peft_settings_exit_with_one_line(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main(argv + ["--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "16", "--out", str(tmp_path),
                 "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err[-1].startswith("error: ") and message in err[-1]


def test_adapter_export_of_a_run_that_has_none_is_refused(source, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    export.main([source, str(tmp_path / "out"), "--adapter"])
  assert e.value.code == 2 and "is not a --peft run" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()
