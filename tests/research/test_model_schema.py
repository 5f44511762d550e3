"""The model's schema is declared once, on `TransformerConfig`'s and `MoEConfig`'s fields (models/schema.py): the train
CLI's model and --moe.* flags, the resume comparisons and --init-from's conflicts are derived from it, so a new model
field is one line in models/config.py (the subprocess test adds one in this file and trains with it)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import typing

import pytest

from models import MoEConfig, TransformerConfig, schema
from models.config import ATTENTION, COMPUTE_DTYPES, ROUTERS
from research.train.config import MoEFlags
from research.train.config.sections import ModelSection
from research.train.setup import init_from
from research.train.setup.resume import state_signature
from research.train.store import rundir


def choices(cls, field):
  return typing.get_args(typing.get_args(typing.get_type_hints(cls)[field])[0])


def test_the_flags_are_the_documented_fields_with_the_librarys_choices():
  model = [f.name for f in dataclasses.fields(ModelSection)]
  assert model == ["preset", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "qk_norm", "qkv_bias",
                   "tie_embeddings", "compute_dtype", "remat", "microbatches", "attention", "logit_stats"]
  assert model[1:] == list(schema.names(TransformerConfig, documented=True))
  assert {"vocab_size", "head_dim", "rope_theta", "param_dtype", "moe"}.isdisjoint(model)  # not user settings
  moe = [f.name for f in dataclasses.fields(MoEFlags)]
  assert moe == ["num_experts", "top_k", "d_expert", "num_shared", "d_shared", "shared_gate", "router",
                 "normalize_top_k", "capacity_factor", "lb_weight", "z_weight", "bias_rate", "ragged_a2a", "pad",
                 "pad_ratio", "pad_rounds", "pad_batches", "pad_schedule", "pad_scope"]
  assert choices(ModelSection, "attention") == ATTENTION and choices(MoEFlags, "router") == ROUTERS
  assert choices(ModelSection, "compute_dtype") == COMPUTE_DTYPES


def test_kinds_decide_what_init_from_refuses_and_what_a_resume_compares():
  assert init_from.SHAPE_FLAGS == ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "qk_norm", "qkv_bias",
                                   "tie_embeddings")
  assert set(init_from.FREE_FLAGS) == {"compute_dtype", "remat", "microbatches", "attention", "logit_stats"}
  base = dataclasses.asdict(TransformerConfig(moe=MoEConfig()))
  sig = schema.signature(TransformerConfig, base)
  assert "attention" not in sig and "top_k" not in sig["moe"] and sig["moe"]["bias_rate"] is False
  biased = {**base, "moe": {**base["moe"], "bias_rate": 1e-3}}
  assert schema.signature(TransformerConfig, biased)["moe"]["bias_rate"] is True  # a router bias is state
  shared = {**base, "moe": {**base["moe"], "num_shared": 1, "d_shared": 64}}
  assert schema.signature(TransformerConfig, shared) != sig  # another shared expert: another model
  routed = {**base, "attention": "xla", "moe": {**base["moe"], "top_k": 1}}
  assert schema.signature(TransformerConfig, routed) == sig
  assert schema.changed(TransformerConfig, base, routed) == {"attention": ["auto", "xla"], "moe.top_k": [2, 1]}
  old = {k: v for k, v in base.items() if k not in ("attention", "logit_stats")}  # saved before the fields existed
  assert schema.changed(TransformerConfig, old, base) == {} and schema.signature(TransformerConfig, old) == sig


def meta(model: dict, **train) -> dict:
  return {"model_config": model, "mesh": "data=1", "devices": [0], "corpus": {"fingerprint": "f"},
          "train": {"optimizer": "adamw", "opt": [], "amend": False, **train}}


def test_a_resume_records_a_routing_change_and_refuses_another_model():
  base = dataclasses.asdict(TransformerConfig(moe=MoEConfig()))
  routed = {**base, "moe": {**base["moe"], "top_k": 1}}
  assert rundir.changed_settings(meta(base), meta(routed)) == {"moe.top_k": [2, 1]}
  assert state_signature(meta(base)) == state_signature(meta(routed))
  assert state_signature(meta(base)) != state_signature(meta({**base, "moe": {**base["moe"], "pad": True}}))


def test_init_from_applies_how_the_model_is_computed_and_refuses_another_shape(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  json.dump({"model_config": dataclasses.asdict(TransformerConfig(d_model=64, n_heads=4, d_ff=128, moe=MoEConfig()))},
            open(src / "config.json", "w"))
  c = init_from.model_config(str(src), {"attention": "xla", "logit_stats": True, "moe": {"top_k": 1}})
  assert (c.attention, c.logit_stats, c.moe.top_k, c.moe.num_experts) == ("xla", True, 1, 8)  # once dropped silently
  with pytest.raises(init_from.InitError, match=r"^--moe.num-experts 4 conflicts with --init-from"):
    init_from.model_config(str(src), {"moe": {"num_experts": 4}})
  with pytest.raises(init_from.InitError, match=r"^--d-ff 96 conflicts with --init-from"):
    init_from.model_config(str(src), {"d_ff": 96})
  # a positive bias rate keeps a router bias: the checkpoint has none, so a rate is another state
  with pytest.raises(init_from.InitError, match=r"^--moe.bias-rate 0.001 conflicts with --init-from"):
    init_from.model_config(str(src), {"moe": {"bias_rate": 1e-3}})


# A model field declared by this test, on a TransformerConfig patched before research.train is imported: its flag,
# its record in config.json and its resume check come with no edit anywhere else.
NEW_FIELD = textwrap.dedent("""
  import dataclasses, json, os, sys
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import models, models.config as mc
  from models.schema import setting
  new = dataclasses.make_dataclass(
      "TransformerConfig", [("softcap", float, setting(0.0, "Tanh soft-capping of the logits (a new field)."))],
      bases=(mc.TransformerConfig,), frozen=True, namespace={"__module__": "models.config"})
  for name, c in mc.PRESETS.items():
    mc.PRESETS[name] = new(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
  mc.TransformerConfig = models.TransformerConfig = new
  from research.train import main
  out = sys.argv[1]
  run = ["--model", "tiny", "--batch-size", "8", "--seq-len", "16", "--mesh", "data=-1", "--no-progress",
         "--eval-every", "2", "--eval-batches", "1", "--log-every", "1", "--out", out]
  main(run + ["--steps", "2", "--ckpt-every", "2", "--softcap", "30"])
  print("recorded", json.load(open(os.path.join(out, "config.json")))["model_config"]["softcap"])
  try:
    main(run + ["--steps", "3", "--softcap", "20"])
  except SystemExit as e:
    print("exit", e.code)
""")


def test_a_model_field_declared_once_gets_its_flag_record_and_resume_check(tmp_path):
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  p = subprocess.run([sys.executable, "-c", NEW_FIELD, str(tmp_path / "run")], capture_output=True, text=True,
                     env=env, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  lines = p.stdout.splitlines()
  assert "recorded 30.0" in lines and lines[-1] == "exit 2", p.stdout[-2000:]
  assert "holds a checkpoint of a different model/optimizer (softcap: 30.0 -> 20.0)" in p.stderr, p.stderr[-2000:]
