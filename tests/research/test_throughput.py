"""MFU's peak (the chip's datasheet figure for the compute dtype, a measured matmul only where no figure is known,
never raised by the model's rate) and the steady-state throughput (windows that start STEADY_AFTER steps after a
compile) beside the whole run's average."""

import types

import pytest

from research.train.hooks import peaks, throughput
from research.train.hooks.throughput import Meter, Peak

T = 1e12


@pytest.mark.parametrize("kind, dtype, precision, want, says", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", None, 989 * T, "bfloat16 datasheet peak 989 TFLOP/s"),
    ("NVIDIA H100 80GB HBM3", "float32", None, 495 * T, "float32 matmuls run as tfloat32"),  # XLA's default: TF32
    ("NVIDIA H100 80GB HBM3", "float32", "highest", 67 * T, "float32 datasheet peak 67 TFLOP/s"),
    ("NVIDIA H100 PCIe", "bfloat16", None, 756 * T, "PCIe"),
    ("NVIDIA H200", "bfloat16", None, 989 * T, "H200"),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", None, 312 * T, "A100"),
    ("NVIDIA L4", "bfloat16", None, 121 * T, "L4"),
    ("NVIDIA GeForce RTX 4090", "bfloat16", None, 165.2 * T, "RTX 4090"),
    ("TPU v4", "float32", None, 275 * T, "run as bfloat16"),  # TPUs multiply float32 in bfloat16 passes
    ("TPU v5 lite", "bfloat16", None, 197 * T, "v5e"),
    ("TPU v5p", "bfloat16", None, 459 * T, "v5p"),
    ("TPU v6 lite", "bfloat16", None, 918 * T, "v6e"),
    ("NVIDIA H200 NVL", "bfloat16", None, 835 * T, "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "float32", "bfloat16", 989 * T, "float32 matmuls run as bfloat16"),
])
def test_the_datasheet_peak_for_the_compute_dtype(kind, dtype, precision, want, says):
  flops, source = peaks.spec_peak(kind, dtype, precision)
  assert flops == pytest.approx(want) and says in source, source


@pytest.mark.parametrize("kind, dtype", [("cpu", "float32"), ("NVIDIA A100-SXM4-80GB", "float8"),
                                         ("Some Future Chip", "bfloat16"), ("TPU v4", "float32:highest"),
                                         ("TPU v4 lite", "bfloat16"), ("TPU v5 lite", "float32:high")])
def test_no_figure_where_the_table_has_none(kind, dtype):
  dtype, _, precision = dtype.partition(":")
  assert peaks.spec_peak(kind, dtype, precision or None) is None


def fake_device(monkeypatch, kind, platform="gpu"):
  device = types.SimpleNamespace(device_kind=kind, platform=platform)
  monkeypatch.setattr(throughput.jax, "local_devices", lambda: [device])


def test_a_known_chip_uses_its_datasheet_and_measures_nothing(monkeypatch):
  fake_device(monkeypatch, "NVIDIA H100 80GB HBM3")
  monkeypatch.setattr(throughput, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured a known chip"))
  peak = Peak(dtype="bfloat16")
  assert peak.flops == 989 * T and "NVIDIA H100 SXM / H200 bfloat16 datasheet peak" in peak.source
  assert peak.mfu(494.5 * T) == pytest.approx(0.5)


def test_a_run_on_several_chips_divides_by_all_of_them(monkeypatch):
  """tokens/s is the global batch's: on 8 H100s the peak is 8 x 989 TFLOP/s (on a CPU the simulated devices share
  the cores one sampled matmul used, so it stays one sample)."""
  fake_device(monkeypatch, "NVIDIA H100 80GB HBM3")
  peak = Peak(dtype="bfloat16", devices=8)
  assert peak.flops == 8 * 989 * T and peak.source.endswith("x 8 chips")
  monkeypatch.undo()  # this machine's CPU again
  cpu = Peak(dtype="float32", devices=8, samples=1, cache=False)
  assert "the simulated devices share these cores" in cpu.source and cpu.flops < 8e12


def test_an_unknown_device_measures_a_saturating_matmul_in_the_compute_dtype(monkeypatch, tmp_path):
  monkeypatch.setenv("OPTLAB_CACHE", str(tmp_path))
  fake_device(monkeypatch, "Some Future Chip")
  asked = []
  monkeypatch.setattr(throughput, "measure_matmul_flops", lambda n, dtype: asked.append((n, dtype)) or 100 * T)
  peak = Peak(dtype="bfloat16", samples=2)
  assert asked == [(8192, "bfloat16")] * 2 and peak.flops == 100 * T
  assert "8192³ bfloat16 matmul" in peak.source and "no datasheet peak for 'Some Future Chip'" in peak.source
  monkeypatch.setattr(throughput, "measure_matmul_flops", lambda n, dtype: 50 * T)  # a loaded machine later
  again = Peak(dtype="bfloat16", samples=1)
  assert again.flops == 100 * T and "earlier runs" in again.source  # the best this machine has shown
  assert Peak(dtype="float32", samples=1).flops == 50 * T  # per dtype


def test_the_models_rate_never_raises_the_peak():
  peak = Peak(given=2 * T)
  assert peak.mfu(3 * T) == pytest.approx(1.5) and peak.flops == 2 * T and peak.source == "--peak-flops"


def test_the_cpu_peak_is_a_measured_float32_matmul():
  peak = Peak(dtype="float32", samples=1, cache=False)
  assert peak.flops > 1e8 and "1024³ float32 matmul rate measured on this cpu" in peak.source


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_the_steady_state_leaves_out_the_steps_after_each_compile(monkeypatch):
  """Steps take 1 s for a while after each compile, then 0.25 s; windows of 2 steps. The whole-run average counts
  every window, the steady state only those starting STEADY_AFTER (here 4) steps after the last compile."""
  clock = Clock()
  monkeypatch.setattr(throughput.time, "perf_counter", clock)
  meter, peak = Meter(tokens_per_step=100, steady_after=4), Peak(given=1e6)
  meter.compiled(1)
  records = {}
  for step in range(2, 14):
    clock.now += 1.0 if step <= 5 else 0.25
    if step % 2 == 1:
      records[step] = meter.record(step, step == 13, flops_per_token=10.0, peak=peak)
  assert "tokens_per_s" not in meter.record(13, False, 10.0, peak)  # no whole step since the last window
  assert records[3]["tokens_per_s"] == pytest.approx(100) and records[13]["tokens_per_s"] == pytest.approx(400)
  last = records[13]  # windows (1,3] (3,5] (5,7] ... (11,13]: 12 steps in 4 + 8 * 0.25 = 6 s; steady from (5,7]
  assert last["run_tokens_per_s"] == pytest.approx(1200 / 6) and last["steady_tokens_per_s"] == pytest.approx(400)
  assert last["steady_mfu"] == pytest.approx(400 * 10 / 1e6) and last["steady_after"] == 4
  meter.compiled(13)  # a --switch-at layout: the next windows are not steady again
  for step in (15, 17, 19):
    clock.now += 2 * 0.5
    tail = meter.record(step, step == 19, 10.0, peak)
  # steady: the 8 steps before the switch in 2 s and (17,19] in 1 s; the run: 18 steps in 9 s
  assert tail["steady_tokens_per_s"] == pytest.approx(1000 / 3) and tail["run_tokens_per_s"] == pytest.approx(200)
