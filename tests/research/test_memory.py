"""The memory pre-flight (research/train/setup/memory.py): every run prints its estimate from its own compiled step
before its state exists; a run over the limit is refused in one line naming the estimate and the fix, with nothing
written and nothing of an existing run touched; the estimate is XLA's per-device bytes of the step the run then
executes."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from refusals import bad

from research.bench.timing import trainer_optimizer, trainer_plan
from research.train import TrainConfig, run
from research.train.config import PeftFlags
from research.train.feed import make_loader
from research.train.hooks.source_weights import load_data
from research.train.setup import memory
from research.train.setup.blockwise import blockwise_parts
from research.train.setup.build import step_options
from research.train.setup.initial_state import abstract_initial_state
from research.train.steps.blockstep import make_block_steps
from research.train.steps.step import make_steps
from research.train.store.checkpoint import CHUNK_BYTES
from sharding import batch_sharding, devices_for, make_mesh

TINY = dict(model="tiny", steps=4, batch_size=8, seq_len=32, log_every=2, eval_every=4, ckpt_every=2,
            eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2")


def _estimate(mesh_spec: str, **kw) -> memory.Estimate:
  cfg = TrainConfig(**{**TINY, "mesh": mesh_spec, **kw})
  mesh = make_mesh(mesh_spec, devices=devices_for(mesh_spec))
  plan = trainer_plan(cfg, mesh=mesh)
  tx, _ = trainer_optimizer(cfg)
  graphdef, abstract, shardings, _ = abstract_initial_state(plan, tx, None, None, None, cfg.peft_options)
  batch_sh = batch_sharding(mesh, (cfg.training.batch_size, cfg.training.seq_len))
  step = make_steps(graphdef, tx, shardings, batch_sh, **step_options(plan))[0]
  return memory.estimate(step, abstract, (cfg.training.batch_size, cfg.training.seq_len), batch_sh, mesh)


def test_a_run_prints_its_estimate_and_compiles_its_step_once(tmp_path, capsys, caplog):
  """The line is on stdout before training; the step the run calls is the program the estimate compiled (JAX lowers
  train_step once in the whole run: the call hits the jit cache the estimate filled)."""
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    records = run(TrainConfig(out=str(tmp_path / "run"), **TINY))
  out = capsys.readouterr().out
  line = next(l for l in out.splitlines() if l.startswith("memory: "))
  assert "MiB per device" in line and "x 8 devices" in line and "host RAM has" in line, line
  assert records[-1]["step"] == 4
  lowered = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(train_step)")]
  assert len(lowered) == 1, lowered


def test_the_estimate_is_xlas_per_device_bytes_of_the_step():
  """argument bytes = the state's shard on one device + the batch's rows there (x and y, int32); sharding the
  parameters and AdamW's moments over fsdp=8 cuts the per-device state ~8x against data=8, which replicates it."""
  rep, split = _estimate("data=8"), _estimate("fsdp=8")
  for est, rows in ((rep, 1), (split, 1)):
    assert est.step.argument == est.state + 2 * rows * TINY["seq_len"] * 4
    assert est.step.alias > 0.9 * est.state  # the donated state is reused by the new one
    assert est.step.peak == est.step.argument + est.step.output - est.step.alias + est.step.temp
  assert 6 < rep.state / split.state <= 8  # small leaves (norms, the step counter) stay replicated
  assert rep.devices == split.devices == 8 and rep.where == "host RAM" and rep.limit > 2 ** 30
  assert rep.total == rep.host + 8 * rep.step.peak + rep.writer
  # the checkpoint writer (CPU): the whole state while it is under the bound, once however it is sharded
  assert rep.writer == split.writer == rep.state


def test_the_checkpoint_writer_is_bounded_on_the_cpu():
  """Three 0.7 GB arrays: at most WRITER_GB = 1 GB in flight, what the trainer's checkpointer is given (orbax's
  save_concurrent_gb); an array over it raises the bound to its size rounded up (orbax refuses a larger array: the
  3B model's 1.4 GB MLP stack failed its save at 1 GB). The estimate counts the writer's chunks in flight."""
  mesh = make_mesh("data=1", devices=jax.devices()[:1])
  state = {f"w{i}": jax.ShapeDtypeStruct((28, 3072, 4096), jnp.bfloat16) for i in range(3)}
  one = 28 * 3072 * 4096 * 2
  assert memory.writer_bound(state, mesh) == (memory.WRITER_GB, memory.WRITER_BYTES) and memory.WRITER_GB == 1
  assert memory.WRITER_BYTES == 8 * CHUNK_BYTES < one  # the writer's chunks in flight, however large the state
  small = {"w": jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16)}
  assert memory.writer_bound(small, mesh)[1] == 8 * 2 ** 20  # the whole state, when it is under the bound
  big = {**state, "mlp": jax.ShapeDtypeStruct((28, 3072, 8192), jnp.bfloat16)}
  assert memory.writer_bound(big, mesh) == (2, memory.WRITER_BYTES)


def test_a_run_over_the_limit_is_refused_before_it_writes_anything(tmp_path, capsys):
  """`small`'s shape with AdamW replicated on 8 devices: ~55 MiB of state each, the state dominates the step."""
  msg = bad(tmp_path, capsys, "--memory-limit", "0.2", "--steps", "2", "--batch-size", "8", "--seq-len", "32",
            "--mesh", "data=8", "--d-model", "256", "--n-layers", "4", "--d-ff", "768")
  assert "the run needs an estimated" in msg and "--memory-limit 0.2 GiB" in msg and "x 8 devices" in msg, msg
  assert "--optimizer badam" in msg and "--peft lora" in msg, msg


def test_activations_that_do_not_fit_are_refused_naming_the_fix_for_them(tmp_path, capsys):
  """--seq-len 100000 asks the attention for terabytes: refused before a byte is allocated, remat named."""
  msg = bad(tmp_path, capsys, "--seq-len", "100000", "--steps", "2", "--batch-size", "8")
  assert "the run needs an estimated" in msg and "host RAM" in msg and "--batch-size or --seq-len" in msg, msg
  assert "an attention that keeps no T·T scores (--attention flash" in msg  # xla runs: 100000 spans no whole tiles
  assert "TiB" not in msg and " GiB (train state" in msg


def test_a_refused_resume_leaves_the_run_as_it_was(tmp_path, capsys):
  out = tmp_path / "run"
  run(TrainConfig(out=str(out), stop_at=2, **TINY))
  files = {p: (out / p).read_bytes() for p in ("metrics.jsonl", "config.json")}
  ckpts = sorted(os.listdir(out / "ckpt"))
  flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in TINY.items() if k not in ("model", "progress")), [])
  msg = bad(tmp_path, capsys, *flags, "--memory-limit", "0.01", out=str(out))
  assert "the run needs an estimated" in msg
  assert {p: (out / p).read_bytes() for p in files} == files and sorted(os.listdir(out / "ckpt")) == ckpts
  assert run(TrainConfig(out=str(out), **TINY))[-1]["step"] == 4  # and it resumes as before
  assert json.load(open(out / "config.json"))["train"]["runtime"]["memory_limit"] is None


def test_memory_limit_zero_checks_nothing_and_the_flag_is_not_a_training_setting(tmp_path, capsys):
  out = tmp_path / "run"
  run(TrainConfig(out=str(out), stop_at=2, memory_limit=0, **TINY))
  assert "memory: the step needs" in capsys.readouterr().out
  assert run(TrainConfig(out=str(out), memory_limit=100, **TINY))[-1]["step"] == 4  # no --amend needed


@pytest.mark.parametrize("limit", ["-1", "nan"])
def test_a_bad_memory_limit_is_one_line(tmp_path, capsys, limit):
  assert "--memory-limit" in bad(tmp_path, capsys, "--memory-limit", limit)


def test_the_fix_follows_what_dominates():
  step = memory.StepBytes(argument=10, output=10, alias=10, temp=1)
  fix = lambda est, cfg: memory.fix(est, trainer_plan(cfg).trains, trainer_plan(cfg).model, cfg.training.seq_len)
  cfg = TrainConfig(**TINY)
  assert "--optimizer badam" in fix(memory.Estimate(step, 10, 1, 0, 1, "x"), cfg)
  assert memory.size(3 * 2**30) == "3.00 GiB" and memory.size(5 * 2**20) == "5.0 MiB"
  assert "--mesh fsdp=N" in fix(memory.Estimate(step, 10, 1, 0, 1, "x"), TrainConfig(**TINY, peft="lora"))
  hot = memory.StepBytes(argument=10, output=10, alias=10, temp=21)
  assert "--remat" in fix(memory.Estimate(hot, 10, 1, 0, 1, "x"), cfg)
  remat = fix(memory.Estimate(hot, 10, 1, 0, 1, "x"), TrainConfig(**TINY, remat=True))
  assert "--batch-size" in remat and "--remat" not in remat  # not a fix it already has
  assert np.isclose(memory.Estimate(hot, 10, 4, 5, None, "x").total, 5 + 4 * 31)


@pytest.mark.parametrize("kw", [dict(peft="lora", peft_options=PeftFlags(base_dtype="bfloat16")),
                                dict(optimizer="badam", frozen_dtype="bfloat16"),
                                dict(optimizer="bread", opt=('mode="sgd"',), frozen_dtype="bfloat16"),
                                dict(optimizer="bread", frozen_dtype="bfloat16")])
def test_a_bfloat16_store_gets_no_float32_copy_in_the_step(kw):
  """XLA:CPU computes bfloat16 matmuls in float32; with while-loop invariant code motion on, the cast of the scanned
  layer stack was hoisted out of the layer loop, a float32 copy of every layer as a temporary (before
  step.compiler_options: temporaries ≥ the stack's float32 bytes; at the 3B shape 12 GiB of LoRA's 12.4). Now the
  step's temporaries are a fraction of that copy (activations at 1 x 16 tokens are tiny). BAdam's masked layer scans
  stacked every layer's weights as residuals until the stack became their constant (models/blockwise.py)."""
  cfg = TrainConfig(**{**TINY, "model": "small", "mesh": "data=1", "n_layers": 16, "batch_size": 1, "seq_len": 16,
                       "remat": True, **kw})
  mesh = make_mesh("data=1", devices=devices_for("data=1"))  # one device, as the 3B runs (8 split differently)
  plan = trainer_plan(cfg, mesh=mesh)
  corpus = load_data(cfg.data, cfg.data_options)
  loader = make_loader(corpus, cfg.training, cfg.data, cfg.data_options)
  batch_sh = batch_sharding(mesh, (cfg.training.batch_size, cfg.training.seq_len))
  tx, schedule = trainer_optimizer(cfg)
  parts = blockwise_parts(plan, schedule, cfg.optim.grad_clip)
  graphdef, abstract, shardings, _ = abstract_initial_state(plan, tx, None, parts, loader, cfg.peft_options)
  step = (make_block_steps(graphdef, parts, shardings, batch_sh) if parts else
          make_steps(graphdef, tx, shardings, batch_sh, **step_options(plan)))[0]
  est = memory.estimate(step, abstract, (cfg.training.batch_size, cfg.training.seq_len), batch_sh, mesh)
  stacked = [x for x in jax.tree.leaves(abstract) if x.dtype == jnp.bfloat16 and x.ndim >= 3]
  copy = sum(int(np.prod(x.shape)) * 4 for x in stacked)  # the stack's float32 bytes
  assert copy > 4 * 2 ** 20, copy
  assert est.step.temp < 0.4 * copy, (est.step.temp, copy)
