"""PEFT methods are registered classes that declare what they need (`models.peft.register`, `Adapter`'s class
attributes): a method declared in this file (one that calibrates on the first batch and has no PEFT export form) trains
through `research.train`, loads back, and is refused by the adapter export in one line, with no edit under research/
or models/; and no method's name appears in the trainer or the library outside models/peft.py."""

import os

import jax
import numpy as np
import pytest
from names import names_in

from models import peft
from research import export
from research.train import TrainConfig, run
from research.train.store.pretrained import load_run

CALLS = []  # the losses each calibration saw


class Calibrated(peft.LoRA):
  """A LoRA that records the loss of the first training batch before the first step, and that PEFT cannot hold."""
  HF = None
  CALIBRATES = True

  @classmethod
  def calibrate(cls, model, loss_fn, *, seed=0, **options):
    jax.debug.callback(lambda v: CALLS.append(float(v)), loss_fn(model))  # not run by a shapes-only trace
    return model


@pytest.fixture
def method():
  CALLS.clear()
  peft.register("calibrated_lora")(Calibrated)
  yield "calibrated_lora"
  peft.ADAPTERS.pop("calibrated_lora")


def test_a_method_declared_in_a_test_file_trains_loads_and_is_refused_by_the_export(method, tmp_path, capsys):
  out = str(tmp_path / "run")
  records = run(TrainConfig(model="tiny", peft=method, steps=3, batch_size=8, seq_len=32, log_every=1, eval_every=3,
                            eval_batches=1, ckpt_every=3, warmup_steps=0, progress=False, mesh="fsdp=4,tensor=2",
                            lr=1e-2, out=out))
  assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)
  assert len(CALLS) == 1 and abs(CALLS[0] - records[0]["loss"]) < 1e-4  # calibrated on the first batch, once
  model = load_run(out, merge=False)[0]
  assert {type(a) for _, a in peft.adapters(model)} == {Calibrated}
  with pytest.raises(SystemExit) as e:
    export.main([out, str(tmp_path / "adapter"), "--adapter"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err[-1] == ("error: PEFT's adapter format holds LoRA or DoRA adapters, this model has "
                                           "Calibrated; export the merged weights instead")
  assert not (tmp_path / "adapter").exists()


def test_no_method_name_in_the_trainer_or_the_library_outside_its_module():
  names = sorted(peft.ADAPTERS)
  assert names_in(os.path.join("research", "train"), names) == []
  assert names_in("models", names, skip="models/peft.py") == []


def test_the_name_check_can_fail(tmp_path):
  (tmp_path / "x.py").write_text('if method == "sparse_adapter":  # sparse_adapter\n  kind.sparse_adapter = 1\n')
  found = names_in(str(tmp_path), ["sparse_adapter"])
  assert [f.rsplit(":", 2)[1:] for f in found] == [["1", " sparse_adapter"]] * 2  # not kind.sparse_adapter's
