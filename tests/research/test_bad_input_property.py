"""Every bad input, tried at random (hypothesis): the library entry points either accept a value or raise their
own typed error (never another exception), and the train CLI ends every invalid flag in exit status 2 with one
`error:` line, no traceback and no run directory left behind. Invalid values are drawn on purpose (non-finite and
out-of-range numbers, wrong types, malformed specs, paths that do not exist), plus arbitrary text."""

import itertools
import math
import os

import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import ConfigError, TransformerConfig
from optim import OPTIMIZERS, UnknownOptimizerError, get_optimizer, hyperparameters
from research.train import main
from sharding import MeshError, make_mesh

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
AXES = ("data", "stage", "fsdp", "expert", "context", "tensor", "model", "")
junk_number = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -1e-9, 0.0, 1e30]) | st.floats()
junk_int = st.integers(-10**6, 10**6)
junk_text = st.text(st.characters(codec="ascii", exclude_characters="\x00"), max_size=24)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(AXES), st.sampled_from(["=", ":", ""]),
                          st.sampled_from(["-1", "0", "-2", "3", "8", "2", "x", "", "1.5"])), max_size=4) | junk_text)
def test_make_mesh_accepts_a_spec_or_raises_mesh_error(spec):
  if isinstance(spec, list):
    spec = ",".join(f"{a}{sep}{v}" for a, sep, v in spec)
  try:
    make_mesh(spec)
  except MeshError as e:
    assert str(e) and "\n" not in str(e)


@SETTINGS
@given(st.fixed_dictionaries({}, optional={
    "vocab_size": junk_int, "d_model": junk_int, "n_layers": junk_int, "n_heads": st.integers(-4, 16),
    "n_kv_heads": st.none() | st.integers(-4, 16), "head_dim": st.none() | st.integers(-8, 64),
    "d_ff": junk_int, "microbatches": st.none() | junk_int, "norm_eps": junk_number, "rope_theta": junk_number,
    "compute_dtype": st.sampled_from(["float32", "bfloat16", "float64", "int8", "fp8", ""]),
    "param_dtype": st.sampled_from(["float32", "bfloat16", "float16x", ""])}))
def test_transformer_config_accepts_or_raises_config_error(fields):
  try:
    TransformerConfig(**fields)
  except ConfigError as e:
    assert str(e) and "\n" not in str(e)


def junk_values(default):
  wrong_type = st.sampled_from(["abc", "", None, [1, 2], {"a": 1}, True, 3, 2.5])
  return wrong_type | junk_number | junk_int if default is not None else wrong_type


@SETTINGS
@given(st.data())
def test_optimizer_factories_accept_or_raise_their_error(data):
  name = data.draw(st.sampled_from(sorted(OPTIMIZERS)) | junk_text)
  defaults = hyperparameters(name) if name in OPTIMIZERS else {}
  keys = data.draw(st.lists(st.sampled_from(sorted(defaults) + ["beta1", "lr", "x"]), max_size=3, unique=True))
  hparams = {k: data.draw(junk_values(defaults.get(k))) for k in keys}
  lr = data.draw(junk_number)
  try:
    tx = get_optimizer(name, lr, **hparams)
  except ValueError as e:  # UnknownOptimizerError, or a factory's own (AlignmentError, BAdamError)
    assert isinstance(e, UnknownOptimizerError) or type(e).__module__.startswith("optim."), type(e)
    assert str(e) and "\n" not in str(e)
  else:
    assert isinstance(tx, optax.GradientTransformation)


FLAGS = st.one_of(
    st.tuples(st.sampled_from(["--lr", "--weight-decay", "--b1", "--b2", "--min-lr-ratio", "--grad-clip",
                               "--spike-factor", "--peak-flops", "--peer-timeout"]),
              st.sampled_from(["nan", "inf", "-inf", "-1", "-0.5", "1e400", "abc", ""])),
    st.tuples(st.sampled_from(["--steps", "--batch-size", "--seq-len", "--log-every", "--eval-every",
                               "--eval-batches", "--ckpt-every", "--keep", "--devices", "--spike-window",
                               "--stop-at"]),
              st.sampled_from(["0", "-1", "-100", "1.5", "abc", ""])),
    # 0 is valid for these two (no warmup; never stop on bad steps)
    st.tuples(st.sampled_from(["--warmup-steps", "--max-bad-steps"]),
              st.sampled_from(["-1", "-100", "1.5", "abc", ""])),
    st.tuples(st.just("--mesh"), st.sampled_from(["data=3", "data=2,data=4", "foo=8", "data=-1,fsdp=-1", "data",
                                                   "data=0", "tensor=16", "data=x"])),
    st.tuples(st.just("--opt"), st.sampled_from(["ns_steps=abc", "b1=2", "eps=-1", "nesterov=3", "beta1=0.9",
                                                  "novalue", "b2=NaN", "weight_decay=[1]"])),
    st.tuples(st.just("--switch-at"), st.sampled_from(["0:data=8", "x:data=8", "5", "999:data=8", "4:data=3",
                                                        "4:foo=2", ":", "4:data=2,data=4"])),
    st.tuples(st.just("--data"), st.sampled_from(["/nonexistent/corpus.txt", "/nonexistent/", "/dev/null"])),
    st.tuples(st.just("--optimizer"), st.sampled_from(["adam", "", "MUON", "sgd_momentum"])),
    st.tuples(st.just("--model"), st.sampled_from(["huge", "", "tiny2"])),
    st.tuples(st.just("--d-model"), st.sampled_from(["0", "-64", "63"])),
    st.tuples(st.just("--n-heads"), st.sampled_from(["0", "-4", "3"])),
    st.tuples(st.just("--init-from"), st.sampled_from(["/nonexistent", "hf:/nonexistent"])),
)


RUNS = itertools.count()


@SETTINGS
@given(flag=FLAGS)
def test_every_invalid_flag_is_exit_2_with_one_line_and_no_run_directory(tmp_path, capsys, flag):
  out = tmp_path / f"run{next(RUNS)}"
  argv = ["--model", "tiny", "--steps", "8", "--optimizer", "muon" if flag[0] == "--opt" else "adamw",
          "--no-progress", "--out", str(out), *flag]
  with pytest.raises(SystemExit) as e:
    main(argv)
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2, (flag, err)
  ours = len(err) == 1 and err[0].startswith("error: ")
  assert ours or flag[0] in "\n".join(err), (flag, err)  # or tyro's own box naming the flag (a wrong type)
  assert "Traceback" not in "\n".join(err), (flag, err)
  assert not os.path.exists(out), (flag, "left a run directory")
