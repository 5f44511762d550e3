"""The run tools' command lines (`research.sample`, `export`, `quantize`, `plot`) under random bad flags (hypothesis):
each call either works or ends in exit status 2 with one `error:` line (or tyro's own message naming the flag, for a
value of the wrong type), never a traceback, and a refused call writes nothing."""

import itertools
import os

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from research import export, plot, quantize, sample
from research.train import TrainConfig, run

pytestmark = pytest.mark.xdist_group("tools_bad_input")
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
CALLS = itertools.count()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  out = tmp_path_factory.mktemp("tools") / "run"
  run(TrainConfig(model="tiny", n_layers=1, steps=2, batch_size=8, seq_len=32, eval_every=2, eval_batches=1,
                  ckpt_every=2, progress=False, peak_flops=1e12, out=str(out)))
  return str(out)


def pick(options):
  return st.sampled_from(options)


SAMPLE = st.lists(st.one_of(
    st.tuples(pick(["--max-new-tokens", "--samples", "--top-k", "--seed"]), pick(["0", "-1", "1.5", "abc", ""])),
    st.tuples(pick(["--temperature"]), pick(["nan", "inf", "-1", "0", "abc"])),
    st.tuples(pick(["--prompt"]), pick(["", "\u00e9\u4e2d", "x" * 300])),
    st.tuples(pick(["--tokenizer"]), pick(["/nonexistent.json", "RUN/config.json", "RUN"]))), max_size=2)
EXPORT = st.lists(st.one_of(
    st.tuples(pick(["--step"]), pick(["-1", "0", "3", "999", "abc"])),
    st.tuples(pick(["--architecture"]), pick(["foo", "llama", "qwen2", ""])),
    st.tuples(pick(["--dtype"]), pick(["float16", "int8", "bfloat16"]))), max_size=2)
QUANTIZE = st.lists(st.one_of(
    st.tuples(pick(["--bits", "--group", "--act-bits", "--calib", "--calib-len", "--eval-batches", "--batch-size",
                    "--hessian-samples"]), pick(["0", "-1", "3", "1.5", "abc", "100000"])),
    st.tuples(pick(["--method", "--select-by", "--sensitivity", "--search", "--candidates", "--targets"]),
              pick(["", "foo", "rtn", "gptq,foo", "none"])),
    st.tuples(pick(["--alpha"]), pick(["nan", "-1", "2", "abc"])),
    st.tuples(pick(["--mesh"]), pick(["data=3", "foo=2", "data=8"])),
    st.tuples(pick(["--data", "--plan", "--tokenizer"]), pick(["/nonexistent", "RUN/config.json"]))), max_size=2)


def refused_or_worked(main, argv, capsys, out=None):
  """Runs `main(argv)`: a refusal is exit 2 with one error line (or tyro's box naming a flag) and creates no `out`."""
  existed = out is not None and os.path.exists(out)
  capsys.readouterr()
  try:
    main(argv)
    return "worked"
  except SystemExit as e:
    err = capsys.readouterr().err.strip().splitlines()
    assert e.code == 2, (argv, e.code, err)
    text = "\n".join(err)
    assert "Traceback" not in text, (argv, text)
    ours = len(err) == 1 and err[0].startswith("error: ")
    tyros = "For full helptext" in text  # tyro's message (a box on a terminal, plain text when captured) ends so
    names_it = any(flag in text for flag in argv if flag.startswith("--")) or "Required" in text
    assert ours or tyros and names_it, (argv, text)
    assert out is None or existed or not os.path.exists(out), (argv, "a refused call left", out)
    return "refused"


def flags(pairs, run_dir):
  return [x.replace("RUN", run_dir) for pair in pairs for x in pair]


@SETTINGS
@given(pairs=SAMPLE, path=pick(["RUN", "RUN/ckpt", "RUN/config.json", "/nonexistent"]))
@example(pairs=[], path="RUN")  # the valid call, which must work
@example(pairs=[], path="RUN/config.json")  # a file for the run directory: was a NotADirectoryError traceback
def test_sample(trained, capsys, pairs, path):
  got = refused_or_worked(sample.main, [path.replace("RUN", trained), "--max-new-tokens", "2",
                                        *flags(pairs, trained)], capsys)
  assert got == "worked" or pairs or path != "RUN"


@SETTINGS
@given(pairs=EXPORT, source=pick(["RUN", "RUN/ckpt", "/nonexistent"]), existing=st.booleans())
@example(pairs=[], source="RUN", existing=False)
def test_export(trained, tmp_path, capsys, pairs, source, existing):
  out = str(tmp_path / f"export{next(CALLS)}")
  if existing:  # a non-empty directory is refused, and kept as it was
    os.makedirs(out)
    open(os.path.join(out, "mine.txt"), "w").write("kept")
  got = refused_or_worked(export.main, [source.replace("RUN", trained), out, *flags(pairs, trained)], capsys,
                          None if existing else out)
  assert got == "worked" or pairs or source != "RUN" or existing
  if existing:
    assert open(os.path.join(out, "mine.txt")).read() == "kept"


@settings(SETTINGS, max_examples=15)
@given(pairs=QUANTIZE)
@example(pairs=[])
def test_quantize(trained, tmp_path, capsys, pairs):
  out = str(tmp_path / f"q{next(CALLS)}")
  got = refused_or_worked(quantize.main, [trained, out, "--calib", "2", "--calib-len", "16", "--eval-batches", "1",
                                          "--batch-size", "2", "--method", "rtn", *flags(pairs, trained)], capsys, out)
  assert got == "worked" or pairs


@SETTINGS
@given(runs=st.lists(pick(["RUN", "/nonexistent", "RUN/config.json", "RUN/ckpt"]), min_size=1, max_size=2),
       out=pick([None, "RUN", "OUT/new/dir/x.png", "RUN/config.json/x.png", "OUT/curves.png"]))
@example(runs=["RUN"], out="OUT/curves.png")
@example(runs=["RUN"], out="OUT/new/dir/x.png")
def test_plot(trained, tmp_path, capsys, runs, out):
  argv = [r.replace("RUN", trained) for r in runs]
  if out is not None:
    argv += ["--out", out.replace("RUN", trained).replace("OUT", str(tmp_path))]
  got = refused_or_worked(plot.main, argv, capsys)
  assert got == "worked" or runs != ["RUN"] or out not in ("OUT/curves.png", "OUT/new/dir/x.png")
