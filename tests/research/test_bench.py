"""The benchmark CLI dispatches and refuses bad input; the optimizer tree is the one the issue names."""

import jax
import pytest

from research.bench import attention as bench_attention
from research.bench import cli as bench
from research.bench import optim as bench_optim
from research.bench.ckpt import ckpt_bench


def test_benchmarks_are_registered():
  assert set(bench.BENCHMARKS) >= {"train", "optim", "ckpt"}


def test_ckpt_bench_times_checksums_against_save_and_restore(tmp_path):
  row, = ckpt_bench(presets=("tiny",), mesh="fsdp=4", rounds=1, tmp_dir=str(tmp_path),
                    out=str(tmp_path / "new" / "t.md"))  # --out's folders are made
  assert row["arrays"] > 10 and row["state_bytes"] > 1e5
  assert 0 < row["one_pass_s"] and 0 < row["checksums_s"] < row["save_s"] and row["checksums_s"] < row["restore_s"]
  assert "| tiny | 0.1M |" in (tmp_path / "new" / "t.md").read_text()


def test_optim_bench_tree_is_43m_params_with_36_muon_matrices():
  params = bench_optim.param_tree()
  assert 42e6 < sum(x.size for x in jax.tree.leaves(params)) < 44e6
  muon = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if bench_optim.is_muon(p, x)]
  assert len(muon) == 36 and {x.shape for x in muon} == {(768, 768), (768, 3072), (3072, 768)}


def test_bad_mesh_exits_with_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(["train", "--presets", "tiny", "--meshes", "data=3"])
  assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_attention_bench_flash_equals_xla_and_context_traffic_is_analytic(tmp_path):
  """Smoke size: flash's output and gradients equal xla's; the context-parallel collectives the compiled train step
  sends are exactly the analytic bytes of its algorithm; the activation memory per device falls with C."""
  assert bench.BENCHMARKS["attention"].__wrapped__ is bench_attention.attention
  out = tmp_path / "a.md"
  # the train-step section (research.bench.timing.time_train_step, as `bench train`) is left out: two more compiles
  r = bench.BENCHMARKS["attention"](kernel_model="tiny", kernel_seqs=(1024,), repeats=1, train_seq=None,
                                    context_model="tiny", context_seq=256, contexts=(1, 2), context_reference=None,
                                    matmul_n=256, out=str(out))
  xla, flash = r["kernel"]
  assert (xla["impl"], flash["impl"]) == ("xla", "flash") and flash["max_diff"] < 1e-4  # fp32, O(1) inputs
  # tiny: N=4, H=16; 1024 = two of flash's 512-blocks, so its blockwise path runs
  assert all(0 < k["time_s"] < 60 and k["flops"] == 7 * 1024 ** 2 * 4 * 16 for k in r["kernel"])
  rows = {(c["impl"], c["context"]): c for c in r["context"]}
  assert set(rows) == {("flash", 1), ("ring", 2), ("allgather", 2)}
  for algo in ("ring", "allgather"):
    c = rows[algo, 2]
    # tiny: L=2, K=2, H=16; blk = 256/2 * 2 * 16 = 4096 elements; fwd 2L(C-1) blocks, bwd + 2LC (ring) / 2L(C-1)
    assert c["analytic"]["fwd"] == 2 * 2 * 4096 * 4
    assert c["analytic"]["bwd"] == 2 * (2 * 4096 * 4 + 2 * (2 if algo == "ring" else 1) * 4096 * 4)
    assert (c["fwd"], c["bwd"]) == (c["analytic"]["fwd"], c["analytic"]["bwd"])
    assert c["temp_bytes"] < 0.6 * rows["flash", 1]["temp_bytes"]
    assert c["argument_bytes"] == rows["flash", 1]["argument_bytes"]  # the state is replicated over context
  text = out.read_text()
  assert text.startswith("Command: `python -m research.bench attention --kernel-model tiny --kernel-seqs 1024 ")
  assert "| 1024 | flash |" in text and "| ring | 2 | collective-permute 16 / " in text


def test_finetune_bench_smoke(tmp_path):
  """Smoke size (tiny, batch 2 x 32, compile only): one table with AdamW's row first and every method beside it; LoRA's
  state holds fewer bytes per parameter than AdamW's 12 (float32 weights + two moments), --freeze skips the frozen
  weights' gradient matmuls, and AdamW's counted matmul FLOPs are the analytic 6·N·tokens + attention."""
  from models import count_params, flops_per_token, preset
  from research.bench.finetune import finetune
  out = tmp_path / "f.md"
  r = bench.BENCHMARKS["finetune"](shapes=("tiny",), methods=("freeze", "lora"), batch_size=2, seq_len=32,
                                   rss_shapes=(), badam_blocks=0, out=str(out))
  assert bench.BENCHMARKS["finetune"].__wrapped__ is finetune
  rows = {row["method"]: row for row in r["tiny"]["rows"]}
  assert list(rows) == ["adamw", "freeze", "lora"] and not any("error" in row for row in rows.values())
  adamw, lora, freeze = rows["adamw"], rows["lora"], rows["freeze"]
  assert adamw["matmul_flops"] == flops_per_token(preset("tiny"), 32) * 2 * 32
  n = count_params(preset("tiny"))
  assert 12 * n < adamw["state_bytes"] <= 12 * n + 16  # float32 weights, m, v; the step and the optimizer's counts
  assert lora["state_bytes"] / n < 0.5 * adamw["state_bytes"] / n and freeze["matmul_flops"] < adamw["matmul_flops"]
  assert 0 < adamw["temp"] and adamw["argument"] >= adamw["state_bytes"]
  text = out.read_text()
  assert text.startswith("Command: `python -m research.bench finetune --shapes tiny --methods freeze lora ")
  lines = [line for line in text.splitlines() if line.startswith("| ")]
  assert lines[0].startswith("| method | trains |") and [line.split(" | ")[0] for line in lines[1:]] == \
      ["| adamw", "| freeze", "| lora"]
  assert "| 12.00 |" in lines[1]  # AdamW: 4 + 8 bytes of state per float32 parameter


def test_finetune_3b_driver_at_smoke_size(tmp_path):
  """The 3B demonstration's driver on the same family at smoke size: transformers writes the HF model, each method
  trains in its own process from --init-from hf:, its pre-flight line, losses and peak RSS are recorded, and a rerun
  reads finished methods back instead of training them again."""
  from research.bench.finetune_3b import estimate_gib, finetune_3b
  out, work = tmp_path / "r.md", str(tmp_path / "work")
  kw = dict(methods=("badam", "lora"), steps=2, seq_len=16, shape="llama-tiny", work=work, out=str(out))
  rows = bench.BENCHMARKS["finetune-3b"](**kw)
  assert bench.BENCHMARKS["finetune-3b"].__wrapped__ is finetune_3b
  assert [r["method"] for r in rows] == ["badam", "lora"] and [r["exit"] for r in rows] == [0, 0], rows
  for r in rows:
    assert len(r["losses"]) == 2 and r["val_loss"] is not None and r["peak_rss"] > 2 ** 20
    assert r["memory_line"].startswith("memory: the step needs an estimated ") and estimate_gib(r["memory_line"])
  text = out.read_text()
  assert text.startswith("Command: `python -m research.bench finetune-3b --methods badam lora --steps 2 ")
  assert "| badam | trained |" in text and "| lora | trained |" in text
  assert finetune_3b(**kw) == rows  # read back from results.json (the wall times too): nothing ran again
  assert estimate_gib("memory: ... x 1 devices + 0.5 GiB in use = 9.87 GiB; host RAM has 23.5 GiB") == 9.87
  assert estimate_gib("memory: ... = 512.0 MiB; host RAM has 23.5 GiB") == 0.5
  assert estimate_gib("error: the run needs an estimated 25.65 GiB (train state 7.11 GiB ...") == 25.65
  assert estimate_gib("memory: the step needs an estimated 1.2 GiB per device (...); cuda:0 has 79.1 GiB") == 1.2


def test_data_bench_at_smoke_size(tmp_path):
  """The 8 GB scale check's driver on a tiny corpus: both corpora written to their sizes, the loader timed with and
  without threads, each corpus trained in its own process (peak RSS, tokens/s), the table written, and a rerun
  reads the finished parts back instead of running them again."""
  from research.bench.data import data
  out, work = tmp_path / "d.md", tmp_path / "work"
  kw = dict(gb=0.002, small_mb=1, model="tiny", batch_size=4, seq_len=16, steps=2, loader_batches=5, mesh="data=1",
            devices=1, work=str(work), out=str(out))
  got = bench.BENCHMARKS["data"](**kw)
  assert (work / "tokens-0.002gb.bin").stat().st_size == 2_000_000
  assert (work / "tokens-1mb.bin").stat().st_size == 2 ** 20
  for name in ("small", "big"):
    r = got["runs"][name]
    assert r["exit"] == 0 and len(r["losses"]) == 1 and r["peak_rss"] > 2 ** 20 and r["tokens_per_s"] > 0, r
  assert set(got["loader_tokens_per_s"]) == {2, 0} and min(got["loader_tokens_per_s"].values()) > 0
  text = out.read_text()
  assert text.startswith("Command: `python -m research.bench data --gb 0.002 ") and "| big | trained |" in text
  assert data(**kw) == got  # read back from results.json: nothing ran again


def test_peer_bench_runs_the_same_model_in_optlab_and_pytorch(tmp_path):
  """At a smoke shape on the CPU: both sides start from the same weights on the same batch (equal first losses),
  both train, the optimizer and Newton–Schulz tables are filled, the report is written."""
  from research.bench.peer import peer
  got = peer(d_model=64, n_layers=2, n_heads=4, d_ff=192, seq_len=64, batch_size=4, dtype="float32", warmup=1,
             steps=2, compile_torch=False, optimizers=("adamw", "muon"), repeats=2, out=str(tmp_path / "peer.md"))
  ours, floor, torch_eager = got["side_by_side"]
  assert torch_eager["name"].startswith("PyTorch") and "eager" in torch_eager["name"]
  # the JAX floor is the same model from the same weights: its loss before the first update is optlab's
  assert floor["name"].startswith("JAX floor") and abs(floor["loss0"] - ours["loss0"]) < 1e-5, (floor, ours)
  assert floor["tokens_per_s"] > 0 and got["floor"] == floor
  for row in (ours, floor, torch_eager):  # two interleaved rounds, the median between their extremes
    assert len(row["walls"]) == 2 and row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
  assert abs(ours["loss0"] - torch_eager["loss0"]) < 1e-4 and 5.0 < ours["loss0"] < 6.0  # ~ln 256 at init
  assert ours["tokens_per_s"] > 0 and torch_eager["tokens_per_s"] > 0 and ours["memory"] > 0
  assert set(got["optimizers"]) == {"adamw", "muon"} and all(s > 0 for s in got["optimizers"].values())
  fp32, bf16 = got["newton_schulz"]
  assert fp32["dtype"] == "float32" and bf16["dtype"] == "bfloat16" and 0 < fp32["error"] < 0.5 and bf16["error"] < 0.5
  text = (tmp_path / "peer.md").read_text()
  assert "### 1. Train step, side by side" in text and "### 3. Newton–Schulz" in text
