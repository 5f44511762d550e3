"""The 70B pre-flight bench at smoke size: a row per method, BAdam's state per device below AdamW's, and each row equal
to what the train CLI's own pre-flight prints for the same command (the bench cannot drift from the trainer); bad input
is one line and exit 2."""

import re
import shlex
import subprocess
import sys

import pytest

from research.bench import cli as bench
from research.bench.preflight import METHODS, preflight
from research.train.setup.memory import size

TRAINER_LINE = re.compile(r"^memory: the step needs an estimated (.+?) per device \(train state (.+?), activations, "
                          r"gradients and temporaries (.+?)\)", re.M)


WEIGHTS = """
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig.from_pretrained(sys.argv[1])
transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[2], safe_serialization=True)
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("preflight")
  out = tmp / "p.md"
  rows = bench.BENCHMARKS["preflight"](shape="llama-tiny", devices=2, seq_len=64, work=str(tmp / "work"), out=str(out))
  # the bench's config.json with random weights beside it (transformers writes both), so its commands train
  subprocess.run([sys.executable, "-c", WEIGHTS, str(tmp / "work" / "llama-tiny"), str(tmp / "hf")], check=True)
  return rows, out.read_text(), tmp


def test_a_row_per_method_and_badam_holds_less_state_than_adamw(smoke):
  rows, text, _ = smoke
  assert bench.BENCHMARKS["preflight"].__wrapped__ is preflight
  assert [r["method"] for r in rows] == list(METHODS) and all(r["exit"] == 0 for r in rows), rows
  by = {r["method"]: r for r in rows}
  assert by["badam"]["state"] < by["adamw"]["state"] and by["lora"]["state"] < by["adamw"]["state"]
  for r in rows:
    assert r["peak"] == r["argument"] + r["output"] - r["alias"] + r["temp"] and 0 < r["state"] <= r["argument"]
    assert "--mesh fsdp=2 --devices 2 --batch-size 4 --seq-len 64" in r["command"]
  table = [line for line in text.splitlines() if line.startswith("| ")]
  assert [line.split(" | ")[0] for line in table[1:]] == [f"| {m}" for m in METHODS]
  assert text.startswith("### llama-tiny on 2 × 80 GB\n\nCommand: `python -m research.bench preflight --shape "
                         "llama-tiny --devices 2 --seq-len 64 ")
  assert "**Peak RSS " in text and "XLA:CPU's compiled memory figures for a simulated mesh" in text


@pytest.mark.parametrize("method", ["adamw", "badam", "lora"])
def test_each_row_is_the_train_clis_own_preflight(smoke, method):
  rows, _, tmp = smoke
  row = next(r for r in rows if r["method"] == method)
  argv = shlex.split(row["command"])[3:]  # after `python -m research.train`
  argv[argv.index("--init-from") + 1] = f"hf:{tmp / 'hf'}"  # the same config, with weights
  argv[argv.index("--out") + 1] = str(tmp / f"train-{method}")  # a run directory of its own
  res = subprocess.run([sys.executable, "-m", "research.train", *argv, "--memory-limit", "0"], capture_output=True,
                       text=True)
  assert res.returncode == 0, res.stderr[-2000:]
  got = TRAINER_LINE.search(res.stdout)
  assert got, res.stdout
  assert got.groups() == (size(row["peak"]), size(row["state"]), size(row["temp"]))
  assert TRAINER_LINE.search(row["line"]).groups() == got.groups()


@pytest.mark.parametrize("argv, says", [
    (["--shape", "llama-1t"], "--shape 'llama-1t' is not one of llama-70b, llama-8b, llama-tiny"),
    (["--methods", "adamw", "sgd"], "--methods 'sgd' is not one of adamw, badam, lora, bread"),
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--devices", "2", "--batch-size", "3"], "--batch-size 3 does not divide over --devices 2"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    bench.main(["preflight", *argv, "--work", str(tmp_path), "--out", str(tmp_path / "p.md")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1
  assert not (tmp_path / "p.md").exists()
