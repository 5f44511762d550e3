"""The experiment trackers (research/train/hooks/trackers.py): what TensorBoard, W&B and MLflow hold is metrics.jsonl,
read back with each tool's own reader, through a stop and a resume; a failing tracker costs one warning line, not the
run.

Every run here has the same shapes (one compilation for the file); `peak_flops` is given so no run measures it.
"""

import errno
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from refusals import bad

from research.train import RunError, TrainConfig, run
from research.train.command import failure
from research.train.hooks import trackers

# test_train's tiny run's shapes, schedule and mesh (its compiled programs are shared through the session's cache)
TINY = dict(model="tiny", steps=8, batch_size=8, seq_len=32, log_every=1, eval_every=3, ckpt_every=2,
            warmup_steps=2, eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1e12)
SKIP = ("step", "spike_steps", "nonfinite_steps")


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**TINY, **kw})


def logged(out) -> list[dict]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def series(records) -> dict[str, list[tuple[int, float]]]:
  """{flat name: [(step, value)]} of every number in the records (dicts and lists flattened with "/")."""
  out = {}

  def walk(value, name, step):
    if isinstance(value, dict):
      for k, v in value.items():
        walk(v, f"{name}/{k}" if name else k, step)
    elif isinstance(value, list):
      for i, v in enumerate(value):
        walk(v, f"{name}/{i}", step)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      out.setdefault(name, []).append((step, float(value)))

  for r in records:
    walk({k: v for k, v in r.items() if k not in SKIP}, "", r["step"])
  return out


# ---- TensorBoard ----------------------------------------------------------------------------------------------------

def tensorboard_view(out):
  """What TensorBoard's event accumulator shows for the run directory (purging on restarts, as TensorBoard does)."""
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(str(out), size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return acc, {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_float32(view):
  return {k: [(s, float(np.float32(v))) for s, v in pts] for k, pts in view.items()}


def test_tensorboard_shows_metrics_jsonl_through_a_stop_and_a_resume_from_an_earlier_checkpoint(tmp_path):
  from tensorboard.plugins.hparams import plugin_data_pb2
  first = run(cfg(tmp_path, stop_at=4))  # the default tracker
  acc, view = tensorboard_view(tmp_path)
  assert view == as_float32(series(logged(tmp_path))) and len(view["loss"]) == 4 and "val_loss" in view
  assert "config/text_summary" in acc.Tags()["tensors"]
  content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
  hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
  assert hparams["train/lr"].number_value == 3e-3 and hparams["model_config/d_model"].number_value == 64
  # the session died after logging steps 3-4 but before checkpoint 4 was committed: the resume starts from step 2
  shutil.rmtree(tmp_path / "ckpt" / "4")
  run(cfg(tmp_path))
  records = logged(tmp_path)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
  assert records[2] != first[2]  # step 3 was logged again (no throughput on the first step after the restart)
  _, view = tensorboard_view(tmp_path)
  assert view == as_float32(series(records))  # nothing of the dead session's steps 3-4 left, no step twice
  files = sorted(glob.glob(str(tmp_path / "**" / "*tfevents*"), recursive=True))
  assert len(files) == 2 and all(os.path.dirname(f) == str(tmp_path) for f in files)  # in the run directory itself


def test_a_tracker_that_fails_costs_one_warning_line_and_nothing_else(tmp_path, capsys, monkeypatch):
  """TensorBoard's event file goes stale mid-run (a network file system) and MLflow's server is down from the start:
  each is reported once, the run completes, metrics.jsonl is whole."""
  pytest.importorskip("mlflow")
  from tensorboardX.event_file_writer import EventsWriter
  with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
  monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed}")
  monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
  write, calls = EventsWriter.write_event, []

  def full_disk(self, event):
    calls.append(event.step)
    if len(calls) > 30:  # the header and a couple of records went through
      raise OSError(errno.ESTALE, "Stale file handle")
    return write(self, event)

  monkeypatch.setattr(EventsWriter, "write_event", full_disk)
  records = run(cfg(tmp_path, tracker=("tensorboard", "mlflow"), ckpt_every=8))
  assert [r["step"] for r in records] == [r["step"] for r in logged(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]
  warnings = [line for line in capsys.readouterr().err.splitlines() if "--tracker" in line]
  assert len(warnings) == 2, warnings
  assert re.match(r"warning: --tracker mlflow failed to start \(.*127\.0\.0\.1", warnings[0]), warnings
  assert re.match(r"warning: --tracker tensorboard failed to log step \d \(OSError: .*Stale file handle", warnings[1])
  assert len(calls) == 31  # nothing was written after the failure
  assert 1 <= max(s for s, _ in tensorboard_view(tmp_path)[1]["loss"]) < 8


def test_a_full_run_directory_refusing_the_event_files_stops_the_run_like_a_failed_save(tmp_path, capsys,
                                                                                        monkeypatch):
  """The event files share --out's disk with metrics.jsonl and the checkpoints: when that disk refuses them the run
  stops with the one error line of a failed save (no tracker warning), metrics.jsonl cut back to the newest
  checkpoint; with space back, the same command resumes and TensorBoard shows each step once."""
  from tensorboardX.event_file_writer import EventsWriter
  write, full = EventsWriter.write_event, [True]

  def full_disk(self, event):
    if full[0] and event.step == 7 and event.HasField("summary"):
      raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, event)

  monkeypatch.setattr(EventsWriter, "write_event", full_disk)
  with pytest.raises(Exception) as e:
    run(cfg(tmp_path, ckpt_every=4))
  assert trackers.rundir.refused(OSError(errno.EROFS, "")) and not trackers.rundir.refused(OSError(errno.ESTALE, ""))
  failed = failure(e.value)
  assert failed[0] == 2 and failed[1] == (f"writing step 7's metrics in {tmp_path} failed: No space left on device "
                                          f"[errno 28]; step 4 is the newest intact checkpoint (free space or fix "
                                          f"the directory, then rerun the same command to resume)"), failed
  assert "--tracker" not in capsys.readouterr().err
  assert [r["step"] for r in logged(tmp_path)] == [1, 2, 3, 4]
  full[0] = False
  run(cfg(tmp_path, ckpt_every=4))
  assert [r["step"] for r in logged(tmp_path)] == list(range(1, 9))
  assert [s for s, _ in tensorboard_view(tmp_path)[1]["loss"]] == list(range(1, 9))


def test_tracker_none_writes_metrics_jsonl_only(tmp_path):
  run(cfg(tmp_path, tracker=("none",), ckpt_every=8))
  assert len(logged(tmp_path)) == 8
  assert glob.glob(str(tmp_path / "**" / "*tfevents*"), recursive=True) == []
  assert not (tmp_path / "trackers.json").exists() and not (tmp_path / "wandb").exists()


# ---- a missing package ----------------------------------------------------------------------------------------------

def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
  trackers.check(cfg(tmp_path).logging.tracker)  # tensorboardX is a dependency: the default is accepted
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
  message = "--tracker wandb needs the wandb package: pip install 'optlab[wandb]'"
  with pytest.raises(RunError, match=f"^{re.escape(message)}$"):
    trackers.check(cfg(tmp_path, tracker=("tensorboard", "wandb")).logging.tracker)
  assert bad(tmp_path, capsys, "--tracker", "wandb") == f"error: {message}"  # exit 2, no run directory left
  with pytest.raises(RunError, match="--tracker none means metrics.jsonl only"):
    trackers.check(cfg(tmp_path, tracker=("none", "mlflow")).logging.tracker)
  monkeypatch.setitem(sys.modules, "tensorboardX", None)
  with pytest.raises(RunError, match=r"^--tracker tensorboard \(the default\) needs the tensorboardX package"):
    trackers.check(cfg(tmp_path).logging.tracker)


# ---- Weights & Biases, offline --------------------------------------------------------------------------------------

def wandb_records(path):
  """The protobuf records of a W&B transaction log (.wandb): LevelDB's log format (32 KiB blocks of records, each
  with a 7-byte header: CRC, length, type full/first/middle/last) after W&B's own 7-byte header ":W&B", key, version."""
  from wandb.proto import wandb_internal_pb2
  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, part = 7, b""
  while pos + 7 <= len(data):
    room = 32768 - pos % 32768
    _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if room < 7 or (size == 0 and kind == 0):  # the block's zero padding
      pos += room
      continue
    part += data[pos + 7:pos + 7 + size]
    pos += 7 + size
    if kind in (1, 4):  # full, last
      yield wandb_internal_pb2.Record.FromString(part)
      part = b""


def wandb_history(paths) -> dict[str, list[tuple[int, float]]]:
  view = {}
  for path in paths:
    for rec in wandb_records(path):
      if rec.WhichOneof("record_type") == "history":
        for item in rec.history.item:
          name = "/".join(item.nested_key) or item.key
          if not name.startswith("_"):  # W&B's own _step, _runtime, _timestamp
            view.setdefault(name, []).append((rec.history.step.num, float(json.loads(item.value_json))))
  return view


def wandb_offline(tmp_path, monkeypatch):
  for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
    monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def test_wandb_offline_run_holds_metrics_jsonl_and_a_resume_continues_its_id(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  wandb_offline(tmp_path, monkeypatch)
  out = tmp_path / "run-a"
  run(cfg(out, tracker=("wandb",), stop_at=4))
  run_id = json.loads((out / "trackers.json").read_text())["wandb"]["id"]
  files = glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
  assert len(files) == 1 and wandb_history(files) == series(logged(out))
  (header,) = [r.run for r in wandb_records(files[0]) if r.WhichOneof("record_type") == "run"]
  assert (header.run_id, header.project, header.display_name) == (run_id, "optlab", "run-a")
  config = {item.key: json.loads(item.value_json) for item in header.config.update}
  assert config["model_config"]["d_model"] == 64 and config["train"]["tracker"] == ["wandb"]
  assert not glob.glob(str(out / "*tfevents*"))  # --tracker wandb alone: no TensorBoard files
  run(cfg(out, tracker=("wandb",)))
  assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] == run_id
  files = sorted(glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb")))
  assert len(files) == 2  # one offline directory per session, the same run id (`wandb sync` uploads both)
  assert wandb_history(files) == series(logged(out)) and len(logged(out)) == 8


# ---- MLflow, against a real server ----------------------------------------------------------------------------------

class MlflowServer:
  """`mlflow server` on a free local port over SQLite in `home`, in a process group of its own."""

  def __init__(self, home):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    self.home, self.uri, self.log = home, f"http://127.0.0.1:{port}", open(home / "server.log", "w")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner and its consumer processes
    self.proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                  "--workers", "1", "--backend-store-uri", f"sqlite:///{home}/mlflow.db"],
                                 cwd=home, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

  def ready(self) -> str:
    """The URI, once /health answers."""
    deadline = time.time() + 180
    while True:
      try:
        urllib.request.urlopen(f"{self.uri}/health", timeout=2).read()
        return self.uri
      except OSError:
        assert self.proc.poll() is None and time.time() < deadline, (self.home / "server.log").read_text()[-2000:]
        time.sleep(0.25)

  def stop(self):
    os.killpg(self.proc.pid, signal.SIGTERM)
    try:
      self.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    self.log.close()


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(request, tmp_path_factory):
  """The MLflow server of the module's MLflow test, started with the module's first test so that it boots (~15 s on
  2 cores) while the others train; None when no selected test needs it or MLflow is not installed."""
  wanted = any(item.module is request.module and item.name.startswith("test_mlflow") for item in request.session.items)
  wanted = wanted and importlib.util.find_spec("mlflow") is not None
  server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")) if wanted else None
  yield server
  if server is not None:
    server.stop()


def mlflow_view(client, run_id, names) -> dict[str, list[tuple[int, float]]]:
  history = {k: sorted(client.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp)) for k in names}
  return {k: [(m.step, m.value) for m in points] for k, points in history.items()}


def test_mlflow_server_holds_metrics_jsonl_and_a_resume_continues_the_run(tmp_path, monkeypatch, mlflow_server):
  pytest.importorskip("mlflow")
  from mlflow.tracking import MlflowClient
  uri = mlflow_server.ready()
  monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
  monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "trackers-test")
  monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
  out = tmp_path / "run-m"
  first = run(cfg(out, tracker=("mlflow",), stop_at=4))
  stored = json.loads((out / "trackers.json").read_text())["mlflow"]
  client = MlflowClient()
  got = client.get_run(stored["run_id"])
  assert stored["tracking_uri"] == uri and got.info.run_name == "run-m" and got.info.status == "KILLED"
  assert client.get_experiment(got.info.experiment_id).name == "trackers-test"
  assert got.data.params["train/lr"] == "0.003" and got.data.params["model_config/d_model"] == "64"
  expected = series(logged(out))
  assert set(got.data.metrics) == set(expected) and mlflow_view(client, stored["run_id"], expected) == expected
  # the session died after logging steps 3-4 but before checkpoint 4 was committed: the resume starts from step 2,
  # MLflow keeps the points it holds (it cannot delete them) and gets the steps after them
  shutil.rmtree(out / "ckpt" / "4")
  run(cfg(out, tracker=("mlflow",)))
  assert json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"] == stored["run_id"]
  assert client.get_run(stored["run_id"]).info.status == "FINISHED"
  expected = series(first + [r for r in logged(out) if r["step"] > 4])
  assert mlflow_view(client, stored["run_id"], expected) == expected  # every step once
  assert len(client.search_runs([got.info.experiment_id])) == 1
