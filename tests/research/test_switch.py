"""Online mesh switching (--switch-at) and checkpoints across meshes: a run that switches layout in-process
continues exactly like one that stopped and resumed from its checkpoint on the new mesh."""

import jax
import numpy as np
import pytest
import refusals
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from runs import trace

import models
import research.train.store.integrity
import sharding
from optim import get_optimizer
from research.train import TrainConfig, run
from research.train.store.checkpoint import Checkpointer

# test_train's tiny run (its compiled programs are shared through the session's cache), evaluated at the end only
TINY = dict(model="tiny", steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=8, ckpt_every=4,
            warmup_steps=2, eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12)


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


OLD, NEW = "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"


def test_switching_equals_resuming_on_the_new_mesh(tmp_path, capfd):
  # A: one run on OLD that switches to NEW after step 4
  a = run(cfg(tmp_path / "a", mesh=OLD, switch_at=(f"4:{NEW}",)))
  err = capfd.readouterr().err
  assert f"step 4: switched to mesh {NEW} in" in err
  # the steps for the new layout were compiled before training began, not at the switch
  assert err.index(f"compiled the steps for mesh {NEW} in") < err.index("step 4: switched")
  # B: stops at 4 on OLD, resumes with --mesh NEW (the mesh is not part of the checkpoint's signature) up to 6,
  # then A's own command resumes it: the step-6 checkpoint, written on NEW, lands on the mesh A had reached
  run(cfg(tmp_path / "b", mesh=OLD, stop_at=4))
  run(cfg(tmp_path / "b", mesh=NEW, stop_at=6))
  b = run(cfg(tmp_path / "b", mesh=OLD, switch_at=(f"4:{NEW}",)))
  err = capfd.readouterr().err
  assert f"resuming {tmp_path / 'b'} from step 4" in err and f"resuming {tmp_path / 'b'} from step 6" in err
  assert "switched" not in err
  assert [r["step"] for r in a] == list(range(1, 9))
  assert trace(b) == trace(a)


def bad(tmp_path, capsys, *args):  # refused before the run directory, let alone training, began
  return refusals.bad(tmp_path, capsys, *args, *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()
                                                 if k != "progress"])


@pytest.mark.parametrize("args, message", [
    (["--switch-at", "fsdp=8"], r"--switch-at 'fsdp=8' is not STEP:MESH"),
    (["--switch-at", "x:fsdp=8"], r"is not STEP:MESH"),
    (["--switch-at", "0:fsdp=8"], r"STEP must lie in \[1, --steps=8\)"),
    (["--switch-at", "8:fsdp=8"], r"STEP must lie in \[1, --steps=8\)"),
    (["--switch-at", "3:fsdp=8", "--switch-at", "3:data=8"], "names step 3 twice"),
    (["--switch-at", "3:model=8"], "unknown mesh axis 'model'"),
    (["--switch-at", "3:data=16"], "needs 16 devices but 8 are available"),
    (["--switch-at", "3:data=3"], r"'3:data=3': the batch: .*size 8.*does not divide by mesh axes \('data',\)"),
    (["--switch-at", "3:tensor=3"], r"to tensor=3: .*'mlp', size 128.*does not divide by mesh axes \('tensor',\)"),
])
def test_bad_switch_is_one_clear_line_before_training(tmp_path, capsys, args, message):
  import re
  assert re.search(message, bad(tmp_path, capsys, *args))


CASES = {  # model, mesh saved on (8 devices), meshes restored onto, the expected spec of one moment there
    "dense": (models.preset("tiny"), "data=2,fsdp=2,tensor=2", ["fsdp=2,tensor=2", "data=2,tensor=4"],
              ("w_gate_DF", [P(None, "fsdp", "tensor"), P(None, None, "tensor")])),
    "moe": (models.preset("tiny", moe=models.MoEConfig(num_experts=4, top_k=2, bias_rate=1e-3)), "expert=4,data=2",
            ["expert=2,fsdp=2"], ("w_up_EDF", [P(None, "expert", "fsdp")])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_restores_bit_exact_onto_another_mesh_and_device_count(tmp_path, case):
  """Saved from 8 devices, restored onto 4 (another shape) and (dense) onto 8 in another shape: same params,
  moments, step and (MoE) router-bias buffers, each with the layout of the new mesh."""
  mcfg, src, dsts, (leaf, want_specs) = CASES[case]
  model_fn = lambda: models.Transformer(mcfg, rngs=nnx.Rngs(0))
  tx = get_optimizer("adamw", 1e-3)
  _, abstract, names = sharding.logical_names(model_fn)
  opt = jax.eval_shape(tx.init, abstract)
  abstract = {"step": jax.ShapeDtypeStruct((), np.int32), "params": abstract, "opt_state": opt}
  buffers = nnx.to_pure_dict(nnx.state(nnx.eval_shape(model_fn), nnx.Not(nnx.Param)))
  assert bool(buffers) == (case == "moe")
  if buffers:
    abstract["buffers"] = buffers
  rng = np.random.default_rng(0)
  host = jax.tree.map(lambda x: np.asarray(rng.integers(1, 99, x.shape) if x.dtype == np.int32 else
                                           rng.standard_normal(x.shape), x.dtype), abstract)
  state = jax.device_put(host, sharding.state_shardings(abstract, names, sharding.make_mesh(src)))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(5, state, {"note": f"from {src}"}, force=True)
  ckpt.close()

  for spec, n, want in zip(dsts, (4, 8), want_specs):
    new_mesh = sharding.make_mesh(spec, devices=jax.devices()[:n])
    target = sharding.state_shardings(abstract, names, new_mesh)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    restored = ckpt.restore(5, abstract, target)
    meta = ckpt.read_meta(5)  # with the checksums of the state, verified by restore on this other mesh too
    assert meta.pop("checksums").keys() == research.train.store.integrity.fingerprints(host).keys()
    assert meta == {"note": f"from {src}"}
    ckpt.close()
    assert jax.tree.structure(restored) == jax.tree.structure(host)
    for h, x, s in zip(jax.tree.leaves(host), jax.tree.leaves(restored), jax.tree.leaves(target)):
      assert x.sharding == s and x.dtype == h.dtype and np.array_equal(np.asarray(x), h)
    blocks = restored["opt_state"][0].mu["blocks"]
    moment = blocks["moe"][leaf] if case == "moe" else blocks[leaf]  # a moment, split like its param
    assert moment.sharding == NamedSharding(new_mesh, want), moment.sharding
