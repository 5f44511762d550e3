"""A stopped run directory damaged at random (hypothesis: files removed, truncated, bit-flipped, or two files' bytes
swapped; one to three at once, anywhere: checkpoints, config.json, metrics.jsonl, the TensorBoard events) and then
resumed with the same command ends in one of three ways, never another:
- it trains to the end, and every step it computed has the uninterrupted run's losses (exact resume, from the newest
  intact checkpoint; a damaged one is moved aside with a warning);
- it is refused: exit 2 with one `error:` line;
- either way no traceback, and no byte the damage left is destroyed: every file's contents are still in the run
  directory afterwards (a quarantined checkpoint under ckpt.corrupt/), except the records a resume rewrites
  (metrics.jsonl past the resume step, config.json's history, the events files); a metrics.jsonl with damaged
  lines is kept as it was beside the one the resume goes on with."""

import json
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from runs import files, trace

from research.train import TrainConfig, main, run

TINY = dict(model="tiny", n_layers=1, steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=2,
            warmup_steps=1, eval_batches=2, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12, keep=10)  # (keep-N
# collection would retire step 2 by design: every checkpoint is kept here, so that any byte gone is a loss)
STOP = 6
REWRITTEN = ("metrics.jsonl", "config.json", "events.out.tfevents", ".lock")  # a resume's own records and lock
pytestmark = pytest.mark.xdist_group("damaged_run")


def argv(out):
  return [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--no-progress", f"--out={out}"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
  """(the uninterrupted run's records, a run directory stopped at step 6 of 8)."""
  root = tmp_path_factory.mktemp("damaged")
  reference = run(TrainConfig(out=str(root / "ref"), progress=False, **TINY))
  run(TrainConfig(out=str(root / "stopped"), progress=False, stop_at=STOP, **TINY))
  return Stopped((trace(reference), root / "stopped"))


class Stopped(tuple):
  def __repr__(self):  # (hypothesis prints the fixtures of a failing example)
    return f"<the reference run's trace and {self[1]}>"


def damage(out, ops):
  """Applies ops [(kind, i, j, fraction)] to the files of `out` (i, j index its sorted file list, or name a file)."""
  for kind, i, j, fraction in ops:
    names = sorted(files(out))
    a, b = (os.path.join(out, k if isinstance(k, str) else names[k % len(names)]) for k in (i, j))
    if kind == "remove":
      os.remove(a)
    elif kind == "truncate":
      os.truncate(a, int(os.path.getsize(a) * fraction))
    elif kind == "flip" and os.path.getsize(a):
      data = bytearray(open(a, "rb").read())
      data[int(len(data) * fraction) % len(data)] ^= 1 << (hash(i) % 8)
      open(a, "wb").write(bytes(data))
    elif kind == "swap" and a != b:
      da, db = open(a, "rb").read(), open(b, "rb").read()
      open(a, "wb").write(db), open(b, "wb").write(da)


OPS = st.lists(st.tuples(st.sampled_from(["remove", "truncate", "flip", "swap"]), st.integers(0, 10**6),
                         st.integers(0, 10**6), st.floats(0, 0.999)), min_size=1, max_size=3)


# each example is a resume (seconds): no shrinking, and the same examples on every machine (a CI run is reproducible)
@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
@example(ops=[("swap", "metrics.jsonl", "ckpt/4/_CHECKPOINT_METADATA", 0.0)])  # records without a step, one-line JSON
def test_a_damaged_run_resumes_exactly_or_is_refused_in_one_line_and_nothing_is_destroyed(stopped, capsys, ops):
  reference, base = stopped
  work = tempfile.mkdtemp()
  try:
    out = os.path.join(work, "run")
    shutil.copytree(base, out)
    damage(out, ops)
    before = files(out)
    capsys.readouterr()
    try:
      main(argv(out))
      status = 0
    except SystemExit as e:
      status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    after = files(out)
    assert status in (0, 2), (status, err, ops)
    errors = [line for line in err if line.startswith("error:")]
    if status == 2:
      assert len(errors) == 1 and err[-1] == errors[0], (err, ops)
    else:
      assert not errors, (err, ops)
      records = [r for r in _records(out) if r["step"] > STOP]
      assert trace(records) == [t for t in reference if t[0] > STOP], ops
    lost = [name for name, data in before.items() if not name.startswith(REWRITTEN) and not kept(name, data, after)]
    if status == 0 and "metrics.jsonl" in before and not is_records(before["metrics.jsonl"]):
      lost += [] if kept("metrics.jsonl", before["metrics.jsonl"], after) else ["metrics.jsonl (damaged, not aside)"]
    assert not lost, (lost, ops, err)
  finally:
    shutil.rmtree(work)


def kept(name: str, data: bytes, after: dict) -> bool:
  """Whether a file's bytes are still at its path, or where a damaged file of its kind is moved: a checkpoint's to
  ckpt.corrupt/<step>[-n]/, a metrics file to metrics.jsonl.damaged[.n] (bytes equal elsewhere do not count: two
  checkpoints share files with equal bytes)."""
  if after.get(name) == data:
    return True
  top, _, rest = name.partition("/")
  if top == "ckpt":
    step, _, inner = rest.partition("/")
    return any(after.get(f"ckpt.corrupt/{s}/{inner}") == data for s in [step, *(f"{step}-{n}" for n in range(2, 9))])
  return any(after[k] == data for k in after if k == f"{name}.damaged" or k.startswith(f"{name}.damaged."))


def is_records(data: bytes) -> bool:
  """Whether every line is a metrics record, but an unterminated last one that does not parse (cut short)."""
  *lines, last = data.split(b"\n")
  try:
    json.loads(last.decode())
    lines.append(last)  # it parses: it must be a record too
  except ValueError:
    pass
  try:
    return all(isinstance(json.loads(line.decode()).get("step"), int) for line in lines)
  except (ValueError, AttributeError):
    return False


def _records(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_only_a_cut_short_last_line_is_excused(tmp_path):
  """A crash cuts the last line short (it does not parse: dropped); an unterminated last line that parses is another
  file's bytes (orbax's one-line metadata swapped in) and counts as damaged, so the file is kept aside."""
  from research.train.store.rundir import read_records
  path = tmp_path / "metrics.jsonl"
  for tail, damaged in ((b'{"step": 3, "lo', 0), (b'{"item_handlers": {}}', 1), (b'', 0)):
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n' + tail)
    assert read_records(str(path)) == ([{"step": 1}, {"step": 2}], damaged)
    assert is_records(path.read_bytes()) == (damaged == 0)


def test_a_damaged_file_is_kept_aside_as_it_was_without_copying_it(tmp_path):
  """keep_aside links (no space needed: a full disk still keeps it) and never replaces an earlier aside; the file
  that goes on is written anew and renamed, so the kept bytes stay as they were."""
  from research.train.store.rundir import MetricsLog, keep_aside
  path = tmp_path / "metrics.jsonl"
  damaged = b'{"step": 1, "loss": 2.0}\nTraceback\n{"step": 2, "loss": 1.0}\n'
  path.write_bytes(damaged)
  first = keep_aside(str(path), ".damaged")
  assert first == f"{path}.damaged" and os.stat(first).st_ino == os.stat(path).st_ino
  assert keep_aside(str(path), ".damaged") == f"{path}.damaged.1"
  log = MetricsLog(str(path))
  assert [r["step"] for r in log.open(up_to=2)] == [1, 2]  # and a third aside, .damaged.2
  log.write({"step": 3, "loss": 0.5})
  log.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
  assert all((tmp_path / f"metrics.jsonl.damaged{n}").read_bytes() == damaged for n in ("", ".1", ".2"))
