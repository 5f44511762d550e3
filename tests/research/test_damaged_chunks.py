"""A damaged checkpoint in the chunked layout (each array's zarr chunks a file each: research/train/store/
checkpoint.py `CHUNK_BYTES`) reads as one line: the reads orbax still had in flight when the first one failed are
not reported beside it (they printed hundreds of `Exception ignored in: <coroutine object
_read_array_index_and_device_put>` tracebacks), whether the run resumes from an older checkpoint or is refused."""

import os
import re
import subprocess
import sys

from research.train import TrainConfig, run
from research.train.store import checkpoint

TINY = dict(model="tiny", n_layers=1, batch_size=8, seq_len=32, ckpt_every=2, eval_every=2, eval_batches=1,
            log_every=2, warmup_steps=1, mesh="data=2,fsdp=2,tensor=2")
KINDS = ("params.", "opt_state.1.0.mu.", "opt_state.1.0.count")  # parameters, optimizer state, a 13-byte scalar
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chunks(step_dir: str, prefix: str) -> list[str]:
  """The chunk files of every array of the checkpoint `step_dir` whose name starts with `prefix`."""
  state = os.path.join(step_dir, "state")
  return sorted(os.path.join(state, a, f) for a in os.listdir(state) if a.startswith(prefix)
                for f in os.listdir(os.path.join(state, a)) if not f.startswith("."))


def resume(out: str, steps: int) -> subprocess.Popen:
  argv = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + [f"--steps={steps}", "--amend", "--no-progress"]
  return subprocess.Popen([sys.executable, "-m", "research.train", *argv, f"--out={out}"], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_damaged_chunked_checkpoint_is_one_line(tmp_path):
  older, only = str(tmp_path / "older"), str(tmp_path / "only")
  run(TrainConfig(out=older, steps=4, progress=False, **TINY))  # checkpoints 2 and 4
  run(TrainConfig(out=only, steps=2, progress=False, **TINY))  # checkpoint 2 alone
  for kind in KINDS:  # step 4 of `older`: every other chunk file of each kind deleted
    files = chunks(os.path.join(older, "ckpt", "4"), kind)
    assert files, kind
    for f in files[::2]:
      os.remove(f)
  for kind in KINDS:  # the only checkpoint of `only`: one bit flipped in the first chunk of each kind
    f = chunks(os.path.join(only, "ckpt", "2"), kind)[0]
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(f, "wb").write(data)
  a, b = resume(older, 6), resume(only, 4)  # side by side
  err_a, err_b = a.communicate(timeout=600)[1].splitlines(), b.communicate(timeout=600)[1].splitlines()
  assert a.returncode == 0 and len(err_a) == 2, "\n".join(err_a)  # whole, to tell which report escaped the hooks
  assert re.fullmatch(rf"warning: checkpoint {older}/ckpt/4 (could not be restored|changed since it was saved): .+; "
                      rf"moved to {older}/ckpt\.corrupt/4, resuming from step 2", err_a[0]), err_a[0]
  assert err_a[1] == f"resuming {older} from step 2"
  assert b.returncode == 2 and len(err_b) == 1, "\n".join(err_b)
  assert re.fullmatch(rf"error: checkpoint {only}/ckpt/2 (could not be restored|changed since it was saved): .+; no "
                      rf"older checkpoint is readable: move {only}/ckpt aside or use a new --out", err_b[0]), err_b[0]


def test_the_hook_drops_orbax_coroutines_only(monkeypatch):
  """What the CLI's unraisable hook drops: a report whose object is a coroutine of orbax's code; others pass."""
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  monkeypatch.setattr(sys, "excepthook", lambda *exc: None)  # not ours yet: the hooks are installed afresh
  checkpoint.quiet_orbax_errors()
  scope = {}
  exec(compile("async def read(): pass", f"{os.sep}site-packages{os.sep}orbax{os.sep}x.py", "exec"), scope)
  exec(compile("async def mine(): pass", "mine.py", "exec"), scope)
  theirs, mine = scope["read"](), scope["mine"]()
  report = lambda obj: type("Report", (), {"exc_value": Exception("read failed"), "object": obj})()
  sys.unraisablehook(report(theirs))
  sys.unraisablehook(report(mine))
  assert [r.object for r in seen] == [mine]
  for name in ("os", "_loop_closed", "_orbax_coroutine"):  # as the interpreter's exit leaves a cleared module
    monkeypatch.setattr(checkpoint, name, None)
  sys.unraisablehook(report(theirs))
  assert [r.object for r in seen] == [mine]
  theirs.close(), mine.close()
