"""Every command line's flags checked before any work (`research.flags`): every flag of every bench, tool and
experiment has a rule; random values of every declared type (hypothesis) end in exit 2 with one `error:` line or reach
the command with values it can use; the issue's examples are refused before anything is written."""

import dataclasses
import functools
import importlib
import inspect
import math
import os
import typing

import pytest
import tyro
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from research import entry, export, flags, plot, quantize, sample, soak, sweep
from research.bench import cli
from research.experiments import NAMES, common

pytestmark = pytest.mark.xdist_group("flags")
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
EXPERIMENTS = NAMES  # every experiment, read from research/experiments/ (a new one is checked here unlisted)
CONFIGS = {"plot": plot.PlotConfig, "sweep": sweep.SweepConfig, "soak": soak.Config, "sample": sample.SampleConfig,
           "export": export.ExportConfig, "quantize": quantize.QuantizeConfig,
           **{f"experiments.{m}": importlib.import_module(f"research.experiments.{m}").Config for m in EXPERIMENTS}}
POSITIONAL = {"plot": ["RUN"], "sample": ["RUN"], "export": ["RUN", "NEW"], "quantize": ["RUN", "NEW"]}
NESTED = {"train"}  # sweep's --train.*: the train CLI's own flags, checked by the trainer (test_bad_input_property)


def bench_flags(name):
  bench = cli.BENCHMARKS[name]
  hints = typing.get_type_hints(bench, include_extras=True)
  out = {}
  for k, hint in hints.items():
    if k == "return":
      continue
    inner = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    if dataclasses.is_dataclass(inner):  # hf, quant, sample: an Args dataclass whose fields are the flags
      out.update(typing.get_type_hints(inner, include_extras=True))
    else:
      out[k] = hint
  return out


def config_flags(config):
  return {k: v for k, v in typing.get_type_hints(config, include_extras=True).items() if k not in NESTED}


def test_every_flag_of_every_command_line_has_a_rule():
  missing = [f"bench {b}: --{k}" for b in cli.BENCHMARKS for k, hint in bench_flags(b).items()
             if flags.rule_for(k, hint) is None]
  missing += [f"{c}: --{k}" for c, config in CONFIGS.items() for k, hint in config_flags(config).items()
              if flags.rule_for(k, hint) is None]
  assert not missing, missing


def test_a_string_flag_without_a_declaration_has_no_rule():  # the check above can fail
  assert flags.rule_for("some_new_flag", str) is None
  assert flags.rule_for("some_new_flag", tuple[str, ...]) is None
  assert flags.rule_for("some_new_flag", int) == flags.COUNT and flags.rule_for("my_seed", int) == flags.NONNEGATIVE


@pytest.mark.parametrize("argv, says", [
    (["peer", "--steps", "0"], "--steps must be >= 1, got 0"),  # was a ZeroDivisionError traceback
    (["peer", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),  # was a 36-line DataError traceback
    (["peer", "--dtype", "float16"], "--dtype 'float16' is not one of float32, bfloat16"),  # 240 lines from XLA
    (["train", "--steps", "0"], "--steps must be >= 1, got 0"),  # was a StatisticsError
    (["moe", "--bias-rate", "nan"], "--bias-rate must be a finite number, got nan"),
    (["dion", "--rank-fractions", "0.5", "1.5"], "--rank-fractions must be in (0, 1], got 1.5"),
    (["reshard", "--src", "foo=8"], "--src 'foo=8': unknown mesh axis 'foo'"),
    (["finetune-3b", "--shape", "llama-2t"], "--shape 'llama-2t' is not one of"),
    (["preflight", "--methods"], "--methods: give at least one value"),
    (["optim", "--skip", "nosuch"], "--skip 'nosuch' is not one of"),
    (["hf", "--d-model", "0"], "--d-model must be >= 1, got 0"),  # a field of an Args dataclass
    (["nosuch"], "no benchmark 'nosuch'; choose from train, optim"),  # was tyro's 9-line box
])
def test_the_issues_bench_examples_are_one_line(capsys, argv, says):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {says}"), err


def test_bench_data_with_negative_gb_writes_nothing(tmp_path, capsys):  # it wrote a file, then failed
  work = tmp_path / "work"
  with pytest.raises(SystemExit) as e:
    cli.main(["data", "--gb", "-1", "--work", str(work)])
  assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --gb must be > 0")
  assert not work.exists()


# Values as typed on a command line: every declared type's edge cases, plus junk
INTS = ["0", "-1", "1", "2", "1000000", "1.5", "abc", ""]
FLOATS = ["nan", "inf", "-inf", "-1", "0", "0.5", "1", "1e30", "abc"]
TEXT = ["", "x", "small", "float16", "bfloat16", "data=3", "foo=2", "data=2,fsdp=-1", "/nonexistent/x", "llama-8b",
        "adamw", "xla"]
# What may reach a command (an independent statement, not flags.py's table): no flag of any bench or tool takes a
# negative number, a non-finite one, or an empty string; an integer 0 only where it means "none" or "off"
ZERO_OK = {"warmup", "workers", "seed", "badam_blocks", "calib_seed", "tune_seed", "sizes", "step", "group",
           "act_bits", "process_id"}  # integers only: a float is checked as finite and >= 0


def typed(hint) -> list[str]:
  text = str(hint)
  if "float" in text:
    return FLOATS
  if "int" in text and "str" not in text:
    return INTS
  return TEXT


def flag_args(data, table):
  """Up to 3 flags of the command drawn at random, each with a value of its declared type (or junk)."""
  names = data.draw(st.lists(st.sampled_from(sorted(table)), max_size=3, unique=True))
  argv = []
  for k in names:
    hint = table[k]
    flag = flags.flag_name(k)
    if hint is bool or str(hint) in ("bool", "bool | None"):
      argv.append(data.draw(st.sampled_from([flag, "--no-" + flag[2:]])))
      continue
    values = data.draw(st.lists(st.sampled_from(typed(hint)), min_size=0 if "tuple" in str(hint) else 1,
                                max_size=2))
    argv += [flag, *values]
  return argv


def usable(name, value) -> bool:
  if isinstance(value, (tuple, list)):
    return all(usable(name, v) for v in value)
  if isinstance(value, bool) or value is None:
    return True
  if isinstance(value, float):  # a rate, scale or budget: 0 is "none" or "off" where it is allowed at all
    return math.isfinite(value) and value >= 0
  if isinstance(value, int):
    return value > 0 or value == 0 and (name in ZERO_OK or "seed" in name)
  if isinstance(value, str):
    return name in ("out",) or value.strip() != ""
  return True


def refused_or_reached(call, argv, capsys):
  """`call(argv)`: exit 2 with one error line (ours, or tyro's message naming the flag), or None when it ran."""
  capsys.readouterr()
  try:
    call(argv)
  except SystemExit as e:
    err = capsys.readouterr().err.strip().splitlines()
    text = "\n".join(err)
    assert e.code == 2 and "Traceback" not in text, (argv, e.code, text)
    ours = len(err) == 1 and err[0].startswith("error: ")
    assert ours or "For full helptext" in text, (argv, text)
    return "refused"
  return "reached"


@SETTINGS
@given(data=st.data())
def test_random_values_of_every_bench_flag_are_refused_or_usable(data, capsys, monkeypatch, tmp_path):
  name = data.draw(st.sampled_from(sorted(cli.BENCHMARKS)))
  table = bench_flags(name)
  argv = [a.replace("/nonexistent/x", str(tmp_path / "new" / "x")) if data.draw(st.booleans()) else a
          for a in flag_args(data, table)]
  reached = []
  original = cli.BENCHMARKS[name].__wrapped__

  @functools.wraps(original)
  def stub(*args, **kwargs):  # the bench's signature, none of its work: what reached it
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    for v in bound.arguments.values():
      reached.extend(dataclasses.asdict(v).items() if dataclasses.is_dataclass(v) else [])
    reached.extend(bound.arguments.items())

  monkeypatch.setitem(cli.BENCHMARKS, name, cli.checked_first(stub))
  got = refused_or_reached(cli.main, [name, *argv], capsys)
  bad = [(k, v) for k, v in reached if not dataclasses.is_dataclass(v) and not usable(k, v)]
  assert got == "refused" or not bad, (name, argv, bad)


@settings(SETTINGS, max_examples=80)
@given(data=st.data())
def test_random_values_of_every_experiment_and_tool_flag_are_refused_or_usable(data, capsys, tmp_path):
  name = data.draw(st.sampled_from(sorted(CONFIGS)))
  config = CONFIGS[name]
  table = config_flags(config)
  positional = {k for k, v in table.items() if "Positional" in str(v)}
  argv = flag_args(data, {k: v for k, v in table.items() if k not in positional})
  places = {"RUN": str(tmp_path), "NEW": str(tmp_path / "new")}
  argv = [places[p] for p in POSITIONAL.get(name, [])] + argv

  def parse_and_check(argv):
    cfg = tyro.cli(config, args=argv)
    with entry.one_line_errors():
      (common.check_config if name.startswith("experiments.") else flags.check_config)(cfg)
    return cfg

  got = refused_or_reached(parse_and_check, argv, capsys)
  if got == "reached":
    cfg = tyro.cli(config, args=argv)
    bad = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
           if f.name not in NESTED and not usable(f.name, getattr(cfg, f.name))]
    assert not bad, (name, argv, bad)


def test_paths_are_checked_for_their_kind(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(entry.UsageError, match="is a file; give a directory"):
    flags.Rule(path="dir").refuse("--runs", str(f))
  with pytest.raises(entry.UsageError, match="no such directory"):
    flags.Rule(path="dir").refuse("--runs", str(tmp_path / "nope"))
  with pytest.raises(entry.UsageError, match="is empty"):
    flags.OUT_DIR.refuse("--work", "")
  with pytest.raises(entry.UsageError, match="is empty"):
    flags.MESH.refuse("--mesh", " ")
  with pytest.raises(entry.UsageError, match="is a file, not a directory"):
    flags.OUT_DIR.refuse("--work", str(f / "sub"))
  flags.OUT_DIR.refuse("--work", str(tmp_path / "new" / "dir"))  # can be created: accepted
  assert not os.path.exists(tmp_path / "new")  # and nothing was made


@pytest.mark.parametrize("tool, argv, says", [
    (quantize, ["TMP", "TMP/q", "--bits", "5"], "--bits 5 is not one of 2, 3, 4, 8, 16, 32"),  # a number's choices
    (quantize, ["TMP", "TMP/q", "--targets", "blocks/(wq"], "--targets 'blocks/(wq': not a regular expression"),
    (quantize, ["TMP", "TMP/q", "--candidates", "rtn,gptx"], "--candidates 'rtn,gptx': 'gptx' not among"),
    (sample, ["/nonexistent"], "PATH /nonexistent: no such file or directory"),  # a positional by its usage name
    (export, ["TMP", "TMP/out", "--architecture", "GPT2LMHeadModel"], "--architecture 'GPT2LMHeadModel' is not one of"),
    (plot, ["/nonexistent"], "RUNS /nonexistent: no such directory"),
])
def test_the_tools_refuse_in_one_line_before_reading_anything(tmp_path, capsys, tool, argv, says):
  with pytest.raises(SystemExit) as e:
    tool.main([a.replace("TMP", str(tmp_path)) for a in argv])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {says}"), err
  assert sorted(os.listdir(tmp_path)) == []  # nothing made


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--batch-size", "0"), ("--seq-len", "-3"),
                                         ("--devices", "0")])
def test_a_shared_flag_has_one_rule_in_the_train_cli_and_the_benches(flag, value, tmp_path, capsys):
  """--steps, --batch-size, --seq-len, --devices: the train CLI's sections and every bench take the same rule from
  research/flags.py's table, so the same bad value reads the same everywhere."""
  from research.train import main as train
  lines = []
  bench = ["data", "--work", str(tmp_path / "w")] if flag == "--devices" else ["peer"]  # a bench with the flag
  for call, argv in ((train, ["--model", "tiny", "--no-progress", "--out", str(tmp_path / "run")]), (cli.main, bench)):
    with pytest.raises(SystemExit) as e:
      call([*argv, flag, value])
    assert e.value.code == 2
    lines.append(capsys.readouterr().err.strip())
  assert lines[0] == lines[1] == f"error: {flag} must be >= 1, got {value}"


def test_every_command_lines_defaults_keep_their_rules():
  """A rule that refuses a command's own default refuses the command as documented (bench peer's empty --meshes)."""
  for bench in cli.BENCHMARKS.values():
    bound = inspect.signature(bench).bind_partial()
    bound.apply_defaults()
    defaults = {k: v for k, v in bound.arguments.items() if v is not inspect.Parameter.empty}
    flags.check(defaults, typing.get_type_hints(bench, include_extras=True))
  for config in CONFIGS.values():
    fields = [f for f in dataclasses.fields(config) if f.name not in NESTED]
    given = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
             for f in fields if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    flags.check({k: v for k, v in given.items() if k not in ("out", "work", "runs")},  # written by a full run only
                typing.get_type_hints(config, include_extras=True))


@pytest.mark.parametrize("argv", [["peer", "--steps", "1"], ["finetune", "--methods", "adamw", "muon"],
                                  ["finetune", "--methods", "sparse_adapter", "bread-sgd-f32"]])
def test_documented_bench_calls_reach_the_bench(argv, monkeypatch):  # refusing one would break docs/benchmarks.md
  name = argv[0]
  original = cli.BENCHMARKS[name].__wrapped__
  reached = []
  monkeypatch.setitem(cli.BENCHMARKS, name, cli.checked_first(functools.wraps(original)(
      lambda *a, **k: reached.append(k))))
  cli.main(argv)
  assert reached


def test_quantize_takes_what_its_readers_take(tmp_path):  # a glob for --data (load_corpus), a trailing comma
  (tmp_path / "a.txt").write_text("text")
  flags.check_config(quantize.QuantizeConfig(source=str(tmp_path), out=str(tmp_path / "q"),
                                             data=str(tmp_path / "*.txt"), candidates="rtn,gptq,"))
  with pytest.raises(entry.UsageError, match="no glob match"):
    flags.check_config(quantize.QuantizeConfig(source=str(tmp_path), out=str(tmp_path / "q"),
                                               data=str(tmp_path / "*.parquet")))
