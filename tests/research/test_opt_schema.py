"""--opt checked by the optimizer registry's schema and the optimizer's own init on the model's parameters, before any
work: a block index past the model's blocks, a pattern list given as one string, a pattern that matches nothing;
--data.workers and --mix values no run can use; and random --opt values of every declared type (hypothesis): one
line and exit 2, or a finished run."""

import json
import math
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from refusals import bad

from optim.registry import schema
from research.train import main

pytestmark = pytest.mark.xdist_group("opt_schema")
TWO_LAYERS = ("--n-layers", "2", "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "8",
              "--seq-len", "32")


def test_a_block_index_past_the_model_is_one_line(tmp_path, capsys):  # was a 52-line traceback
  err = bad(tmp_path, capsys, *TWO_LAYERS, "--optimizer", "badam", "--opt", "start_block=7")
  assert err == "error: --optimizer/--opt: start_block=7 is outside the 2 blocks"


def test_a_pattern_list_given_as_one_string_is_refused(tmp_path, capsys):  # was six one-letter patterns
  err = bad(tmp_path, capsys, *TWO_LAYERS, "--optimizer", "badam", "--opt", 'always_active="blocks"')
  assert "always_active='blocks' must be a list of strings" in err


def test_a_pattern_that_matches_nothing_is_refused_as_freeze_refuses_one(tmp_path, capsys):  # trained silently
  out = tmp_path / "run"
  with pytest.raises(SystemExit) as e:
    main([*TWO_LAYERS, "--optimizer", "badam", "--opt", 'always_active=["nosuch"]', "--model", "tiny",
          "--no-progress", "--out", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err[-1].startswith("error: --optimizer/--opt: always_active=['nosuch']: 'nosuch' "
                                                  "matches no parameter"), err
  assert [line for line in err if line.startswith("error")] == err[-1:] and not out.exists()


def test_negative_data_workers_are_refused(tmp_path, capsys):  # was a traceback
  assert bad(tmp_path, capsys, "--data.workers", "-1") == "error: --data.workers must lie in [0, inf), got -1"


def test_a_non_finite_mixture_rate_is_refused_up_front(tmp_path, capsys):  # trained, then died on NaN weights
  for name in ("a", "b", "c"):
    (tmp_path / f"{name}.txt").write_text(f"{name} text to train on. " * 400)
  data = [f"{n}={tmp_path / f'{n}.txt'}" for n in "abc"]
  err = bad(tmp_path, capsys, "--data", *data, "--mix", "dynamic:eta=inf")
  assert "--mix 'dynamic:eta=inf': needs a finite eta" in err


def typed_values(kind):
  base = kind.removesuffix(" | None")
  if base == "int":
    return st.sampled_from(["0", "1", "-1", "7", "2.5", "true", '"x"'])
  if base == "float":
    return st.sampled_from(["0", "0.5", "-1", "1e400", "NaN", "inf", '"x"', "[1]"])
  if base == "bool":
    return st.sampled_from(["true", "false", "1", '"yes"'])
  if base == "str":
    return st.sampled_from(['"ascending"', '"random"', '"x"', "3", '""'])
  return st.sampled_from(['["final_norm"]', '["nosuch"]', '"blocks"', "[]", "[1]", '["blocks/wq"]'])


@settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_opt_values_of_every_declared_type_are_one_line_or_a_finished_run(data, tmp_path_factory, capsys):
  name = data.draw(st.sampled_from(["badam", "bread", "adamw"]))
  keys = {k: kind for k, (kind, declared) in schema(name).items() if declared != "factory"}
  key = data.draw(st.sampled_from(sorted(keys)))
  value = data.draw(typed_values(keys[key]))
  out = tmp_path_factory.mktemp("opt") / "run"
  argv = [*TWO_LAYERS, "--optimizer", name, "--opt", f"{key}={value}", "--model", "tiny", "--no-progress",
          "--out", str(out)]
  capsys.readouterr()
  try:
    main(argv)
  except SystemExit as e:
    err = capsys.readouterr().err.strip().splitlines()
    assert e.code == 2 and err and err[-1].startswith("error: "), (argv, e.code, err)
    assert sum(line.startswith("error") for line in err) == 1 and "Traceback" not in "\n".join(err), (argv, err)
    assert not out.exists(), (argv, "a refused run left its directory")
    return
  records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  assert records and all(math.isfinite(r["loss"]) for r in records if "loss" in r), argv
