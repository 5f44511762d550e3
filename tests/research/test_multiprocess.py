"""Multi-process runs: two local processes with 4 CPU devices each (gloo collectives over localhost) train on one
global 8-device mesh, each feeding only its own rows of every batch, and match a single-process 8-device run; their
checkpoint resumes in one process; only process 0 writes the run's files. Plus when `jax.distributed` starts."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from runs import free_port

from research.train import TrainConfig, run
from research.train.command import WATCHDOG_EXIT, failure
from research.train.runtime import processes
from research.train.runtime.processes import DistributedError

TINY = dict(model="tiny", n_layers=1, steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=2,
            warmup_steps=1, eval_batches=2, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12)


def assert_same_run(a, b):
  """Same steps and learning rates; losses, gradient norms and held-out losses equal to float32 rounding: gloo
  sums the cross-process parts of each all-reduce in another order than one process does (measured: 1 ulp on
  the first loss, 9e-8 relative)."""
  assert [(r["step"], r["lr"], "val_loss" in r) for r in a] == [(r["step"], r["lr"], "val_loss" in r) for r in b]
  for key in ("loss", "grad_norm", "val_loss"):
    got, want = ([r[key] for r in x if key in r] for x in (a, b))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0, err_msg=key)


ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS",
       "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


def test_two_processes_of_four_devices_match_one_of_eight(tmp_path):
  out, port = tmp_path / "two", free_port()
  args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
  args += ["--no-progress", "--stop-at=4", f"--out={out}", "--devices=4", f"--coordinator=localhost:{port}",
           "--num-processes=2"]
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  procs = [subprocess.Popen([sys.executable, "-m", "research.train", *args, f"--process-id={i}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    one = run(TrainConfig(out=str(tmp_path / "one"), **TINY))  # the reference, meanwhile, in this process
    logs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], "\n\n".join(logs)
  assert all("stopped" not in log and "Traceback" not in log for log in logs)
  with open(out / "metrics.jsonl") as f:
    two = [json.loads(line) for line in f]
  # one writer: each step once; the same losses, gradient norms, learning rates and held-out loss
  assert [r["step"] for r in two] == [1, 2, 3, 4]
  assert_same_run(two, one[:4])
  meta = json.load(open(out / "config.json"))
  assert meta["train"]["distributed"]["process_id"] == 0 and len(meta["devices"]) == 8
  # the checkpoint the two processes wrote together resumes in one process, on the same mesh, exactly
  resumed = run(TrainConfig(out=str(out), **TINY))
  assert_same_run(resumed, one)


def two_processes(out, port, *extra):
  args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
  args += ["--no-progress", f"--out={out}", "--devices=4", f"--coordinator=localhost:{port}", "--num-processes=2",
           *extra]
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  return [subprocess.Popen([sys.executable, "-m", "research.train", *args, f"--process-id={i}"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def test_a_dead_peer_ends_the_others_in_one_line_and_a_restart_resumes_exactly(tmp_path):
  """Process 1 is SIGKILLed after step 8 of 24: process 0's next collective fails (Gloo sees the closed socket) and it
  says so in one line and exits 4 at once, instead of waiting in jax.distributed's shutdown barrier for the heartbeat
  timeout and aborting with a stack trace (where the kill lands while process 0 waits on something Gloo does not
  watch, e.g. an async checkpoint's barrier, as happens now and then on a loaded machine, the watchdog's one line ends
  it at --peer-timeout instead: still one line, exit 4, well before the heartbeat timeout); both restarted, the run
  resumes from its last checkpoint and logs what an uninterrupted two-process run logs, bit for bit. (A peer that
  hangs instead, as NCCL makes it: the watchdog test below.)"""
  flags = [f"--{k}={v}" for k, v in dict(steps=24, ckpt_every=4, eval_every=12).items()]
  whole = two_processes(tmp_path / "whole", free_port(), *flags)
  assert [p.communicate(timeout=600) and p.returncode for p in whole] == [0, 0]
  out = tmp_path / "two"
  procs = two_processes(out, free_port(), "--peer-timeout=15", *flags)
  try:
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
      time.sleep(0.05)
    procs[1].kill()
    killed = time.time()
    _, err = procs[0].communicate(timeout=200)
    waited = time.time() - killed
  finally:
    for p in procs:
      p.kill()
  lines = [line for line in err.strip().splitlines() if line.startswith("error")]
  assert procs[0].returncode == 4, err[-2000:]
  assert len(lines) == 1 and "a peer process probably died" in lines[0], err[-2000:]
  assert "Traceback" not in err and "Check failure" not in err, err[-2000:]  # no stack trace beside the line
  if lines[0].startswith("error: a collective failed in a 2-process run ("):
    assert waited < 15, waited  # not the watchdog's timeout, nor JAX's heartbeat timeout (75 s here)
  else:  # the kill landed while process 0 waited where Gloo does not look (e.g. an async checkpoint's barrier)
    assert lines[0].startswith("error: no progress for 15 s after step ") and waited < 15 + 5, (lines, waited)
  procs = two_processes(out, free_port(), *flags)
  logs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], logs[0][1][-2000:]
  assert "resuming" in logs[0][1]
  read = lambda path: [json.loads(line) for line in open(path)]  # noqa: E731
  keys = ("step", "loss", "grad_norm", "lr", "val_loss")
  assert [[r.get(k) for k in keys] for r in read(metrics)] == \
      [[r.get(k) for k in keys] for r in read(tmp_path / "whole" / "metrics.jsonl")]


WATCHED = """
import sys, time
from research.train.hooks.watchdog import Watchdog
with Watchdog(float(sys.argv[1]), "after step {step}: stuck") as w:
  w.beat(7)
  time.sleep(30)  # a collective that never returns
"""


def test_the_watchdog_ends_a_stuck_process_in_one_line_after_the_timeout():
  t = time.time()
  p = subprocess.run([sys.executable, "-c", WATCHED, "1.5"], capture_output=True, text=True, timeout=60)
  assert p.returncode == 4 and p.stderr.strip() == "error: no progress for 1.5 s after step 7: stuck", p.stderr
  assert 1.5 <= time.time() - t < 20


def test_when_jax_distributed_starts(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  started = []
  monkeypatch.setattr(processes.jax.distributed, "initialize", lambda **kw: started.append(kw))
  assert not processes.initialize()  # nothing asks for it
  assert not processes.initialize("localhost:1234", 2, 0, mode="off")
  monkeypatch.setenv("SLURM_JOB_ID", "7")
  monkeypatch.setenv("SLURM_PROCID", "0")
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert not processes.initialize()  # one task: a single-process run
  assert processes.initialize("localhost:1234", 2, 1)
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert processes.initialize()  # srun with 4 tasks: JAX's SLURM detection fills in the rest
  assert processes.initialize(mode="on")
  monkeypatch.setenv("SLURM_NTASKS", "1")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:555")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert processes.initialize()
  beat = {"heartbeat_timeout_seconds": 100}
  assert started == [
      {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1, **beat},
      {"coordinator_address": None, "num_processes": None, "process_id": None, **beat},
      {"coordinator_address": None, "num_processes": None, "process_id": None, **beat},
      {"coordinator_address": "10.0.0.1:555", "num_processes": 2, "process_id": 1, **beat}]


@pytest.mark.parametrize("kw, message", [
    (dict(coordinator="localhost"), r"'localhost' is not HOST:PORT"),
    (dict(coordinator="localhost:1234", num_processes=2), "needs --num-processes and --process-id"),
    (dict(num_processes=2, process_id=0), "need --coordinator HOST:PORT"),
    (dict(coordinator="localhost:1234", num_processes=2, process_id=2), r"--process-id 2 must lie in \[0, "),
    (dict(coordinator="localhost:1234", num_processes=0, process_id=0), "--num-processes must be positive"),
])
def test_bad_multiprocess_settings_are_one_clear_error(monkeypatch, kw, message):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(processes.jax.distributed, "initialize", lambda **kw: pytest.fail("must not start"))
  with pytest.raises(DistributedError, match=message):
    processes.initialize(**kw)


def test_starting_after_the_backend_is_one_clear_error(monkeypatch):
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  import jax
  jax.devices()  # the backend is up, as in any process that used JAX already
  with pytest.raises(DistributedError, match="must start before JAX's backend"):
    processes.initialize("localhost:1234", 2, 0)


def test_a_failed_collective_in_a_multi_process_run_is_one_line_and_status_4(monkeypatch):
  """The CLI's reading of a dead peer, which the two-process test above reaches only when the kill lands in a step
  (else the watchdog's line ends the run): a JaxRuntimeError, or an error naming Gloo, in a 2-process run is status 4
  and one line naming the cause; the same error in one process is a bug (its traceback shown)."""
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  status, line = failure(jax.errors.JaxRuntimeError("UNAVAILABLE: Gloo all-reduce: connection closed by peer"))
  assert status == WATCHDOG_EXIT == 4 and line == (
      "a collective failed in a 2-process run (UNAVAILABLE: Gloo all-reduce: connection closed by peer): a peer "
      "process probably died; restart every process with the same command to resume")
  assert failure(RuntimeError("[Gloo] connection reset by peer"))[0] == 4
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  assert failure(RuntimeError("[Gloo] connection reset by peer")) is None
