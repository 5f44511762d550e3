"""`python -m research.bench preflight`: the memory pre-flight of a full-size fine-tune, on paper: does Llama-3-70B
fine-tune on four 80 GB devices (BAdam, NeurIPS 2024), by the compiler's count, with nothing of the model allocated?

For a named shape (`SHAPES`) a Hugging Face config.json alone is written (no weights: `--init-from hf:DIR` reads only
it, research/train/setup/init_from.py `source_config`). Then each method runs in a fresh child process
(`python -m research.bench.preflight TRAIN-FLAGS`) that builds what the train CLI builds for those flags up to its
memory pre-flight, by the trainer's own setup functions (`step_estimate`): the mesh and data, the optimizer, the
abstract initial state (ShapeDtypeStructs with shardings), the train step compiled against it on N simulated CPU
devices, and XLA's `memory_analysis` of that program per device (research/train/setup/memory.py `estimate`). No
weight is read or allocated; the children's peak RSS, in the table, shows it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated

import jax
import tyro

from models import count_params
from research import entry, flags
from research.bench.finetune_3b import method_flags
from research.bench.report import call_command, git_commit, publish, run_child, table
from research.train.command import failures_in_one_line
from research.train.config import TrainConfig
from research.train.runtime.devices import setup_jax
from research.train.setup import checks, memory
from research.train.setup.build import resolved_peft
from research.train.setup.run import programs

LLAMA_3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                   tie_word_embeddings=False, max_position_embeddings=8192)
SHAPES = {"llama-70b": LLAMA_3_70B,
          "llama-8b": {**LLAMA_3_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                       "num_attention_heads": 32},
          "llama-tiny": {**LLAMA_3_70B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}
METHODS = ("adamw", "badam", "lora", "bread")
TRAINS = {"adamw": "every parameter: float32 weights, AdamW moments",
          "badam": "one layer at a time: bfloat16 weights, the layer's float32 master and AdamW moments",
          "lora": "rank-{rank} adapters (float32, AdamW) on a bfloat16 base",
          "bread": "BAdam's step + SGD on the layers above the active one (BREAD-SGD)"}
GB = 10 ** 9
PAPER_LAYOUT = ("BAdam's Llama 3-70B run used 4×A100-80GB; /work/shared/reference does not give its layout, only "
                "that the package runs multi-GPU under DeepSpeed ZeRO-3, \"model parallel\" in its README "
                "(optimizers.md §9). ZeRO-3 shards as fsdp does (weights, gradients and optimizer state split evenly, "
                "gathered a layer at a time); a split of whole layers per GPU (naive model parallelism) would instead "
                "keep the active block's float32 master and Adam state on one GPU, so the per-GPU peaks would be "
                "uneven and the largest above this even split.")


def write_config(path: str, shape: str) -> str:
  """The shape's Hugging Face config.json alone (a LlamaForCausalLM in bfloat16) in directory `path`.

  Args:
    path: the directory (made if missing).
    shape: a key of `SHAPES`.

  Returns:
    `path`.
  """
  os.makedirs(path, exist_ok=True)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **SHAPES[shape]}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
  return path


def train_flags(model: str, run_dir: str, method: str, devices: int, batch_size: int, seq_len: int, rank: int,
                compute_dtype: str) -> list[str]:
  """The train CLI's flags of one method's fine-tune from `--init-from hf:MODEL` on `--mesh fsdp=DEVICES`.

  Args:
    model: the directory holding the config.json.
    run_dir: the run's --out (checked writable, never created).
    method: a key of `TRAINS` (its flags: research/bench/finetune_3b.py `method_flags`).
    devices: the simulated CPU devices, all on the fsdp axis.
    batch_size: sequences per step, all devices together.
    seq_len: tokens per sequence.
    rank: LoRA's.
    compute_dtype: the matmuls' dtype.

  Returns:
    The flags, `python -m research.train`'s arguments.
  """
  return ["--init-from", f"hf:{model}", "--out", run_dir, "--mesh", f"fsdp={devices}", "--devices", str(devices),
          "--batch-size", str(batch_size), "--seq-len", str(seq_len), "--remat", "True", "--compute-dtype",
          compute_dtype, "--steps", "1", "--no-compile-cache", *method_flags(method, rank)]


def step_estimate(argv: list[str]) -> dict:
  """The memory pre-flight of `python -m research.train ARGV`, built by the trainer's own `programs` (research/train/
  setup/run.py, what `start` runs up to `_memory`) but not checked against any limit; nothing allocated but the
  data's batches.

  Args:
    argv: the train CLI's flags.

  Returns:
    {"argument", "output", "alias", "temp", "peak", "state"}: bytes per device (`memory.Estimate`), "line": the
    trainer's own pre-flight line, "params": the model's parameter count, "build_s" and "compile_s": seconds to build
    the abstract state and programs, and to lower and compile the train step.
  """
  cfg = tyro.cli(TrainConfig, args=argv, prog="python -m research.train")  # the train CLI's parser
  checks.check(cfg)
  cfg = dataclasses.replace(cfg, peft_options=resolved_peft(cfg.peft_options, cfg.trains, cfg.weights.init_from))
  setup_jax(cfg.runtime.devices, cfg.runtime.compile_cache)
  t = time.perf_counter()
  b = programs(cfg)  # the trainer's own construction, up to its pre-flight
  mesh, mcfg, batch_sh = b.plan.mesh, b.plan.model, b.batch_sh
  built = time.perf_counter()
  est = memory.estimate(b.syncer.train, b.abstract, (cfg.training.batch_size, cfg.training.seq_len), batch_sh, mesh)
  s = est.step
  return {"argument": s.argument, "output": s.output, "alias": s.alias, "temp": s.temp, "peak": s.peak,
          "state": est.state, "line": est.line(), "params": count_params(mcfg), "build_s": built - t,
          "compile_s": time.perf_counter() - built}


def _child(argv: list[str]) -> None:
  """`python -m research.bench.preflight TRAIN-FLAGS`: `step_estimate`'s dict as one JSON line on stdout, on XLA:CPU;
  a failure the train CLI reports in one line (research/train/command.py `failures_in_one_line`) likewise here."""
  jax.config.update("jax_platforms", "cpu")  # simulated devices, whatever accelerator the machine has
  with failures_in_one_line():
    result = step_estimate(argv)
  print(json.dumps(result), flush=True)


def _check(devices: int, batch_size: int):
  """What the flags' own rules (research/flags.py, checked by the bench CLI) cannot see: two flags together."""
  if batch_size % devices:
    raise entry.UsageError(f"--batch-size {batch_size} does not divide over --devices {devices} (fsdp={devices} "
                           f"splits the batch)")


def preflight(shape: Annotated[str, flags.one_of(*SHAPES)] = "llama-70b",
              methods: Annotated[tuple[str, ...], flags.one_of(*METHODS)] = METHODS, devices: int = 4,
              batch_size: int | None = None, seq_len: int = 1024, rank: int = 8, compute_dtype: str = "bfloat16",
              device_gb: float = 80.0, work: str = "runs/preflight", out: str | None = None,
              append: bool = False) -> list[dict]:
  """Each method's per-device bytes for fine-tuning `shape` on `devices` devices, from the trainer's compiled step.

  Args:
    shape: a key of `SHAPES` (the config.json written to `work`).
    methods: from `METHODS`.
    devices: simulated CPU devices, the mesh fsdp=DEVICES (parameters, optimizer state and batch split over all).
    batch_size: sequences per step, all devices together; default None, 2 per device.
    seq_len: tokens per sequence.
    rank: LoRA's.
    compute_dtype: the matmuls' dtype (--compute-dtype).
    device_gb: each device's memory, in 10^9 bytes, that a method's step peak must fit in.
    work: the config.json, the children's logs.
    out: markdown file for the table.
    append: add this run's section below `out`'s existing text instead of replacing it.

  Returns:
    One dict per method: `step_estimate`'s, with "method", "command" (the train CLI's), "exit", "error",
    "peak_rss" (the child's, bytes) and "wall_s".

  Raises:
    entry.UsageError: a batch that does not divide over the devices, or a refusal of the train CLI's (a shape that
      does not divide over the mesh); an unknown shape or method and a count not positive are refused by the bench
      CLI's flag rules before this runs (research/flags.py).
  """
  batch_size = 2 * devices if batch_size is None else batch_size
  _check(devices, batch_size)
  args = {k: v for k, v in locals().items() if k in ("shape", "methods", "devices", "seq_len", "rank", "compute_dtype",
                                                       "device_gb", "work", "out")}
  args["batch_size"] = None if batch_size == 2 * devices else batch_size
  command = call_command("preflight", preflight, args) + " --append" * append  # a flag: no value
  model = write_config(os.path.join(work, shape), shape)
  preface = Path(out).read_text().rstrip("\n") + "\n\n" if append and out and os.path.exists(out) else ""
  rows: list[dict] = []
  for method in methods:
    print(f"[preflight] {shape}, {method}, fsdp={devices} ...", file=sys.stderr, flush=True)
    name = f"{shape}-{devices}-{method}"
    flags = train_flags(model, os.path.join(work, "runs", name), method, devices, batch_size, seq_len, rank,
                        compute_dtype)
    code, rss, stdout, stderr, wall = run_child([sys.executable, "-m", "research.bench.preflight", *flags],
                                                os.path.join(work, "logs", name))
    error = _error(stderr, code) if code else None
    if code == entry.EXIT_BAD_INPUT:  # the train CLI refused the flags (a shape that does not divide, say)
      raise entry.UsageError(f"{method}: {(error or '').removeprefix('error: ')}")
    result = json.loads(stdout.strip().splitlines()[-1]) if code == 0 else {}
    rows.append({"method": method, "command": "python -m research.train " + shlex.join(flags), "exit": code,
                 "error": error, "peak_rss": rss, "wall_s": wall, **result})
    lines = [f"### {shape} on {devices} × {device_gb:g} GB", "", f"Command: `{command}`", "",
             *_header(shape, devices, batch_size, seq_len, compute_dtype, device_gb, rows),
             *_table(rows, rank, device_gb)]
    if out:  # each finished method kept, should a later one be stopped
      with open(entry.parent_made(out), "w") as f:
        f.write(preface + "\n".join(lines) + "\n")
  publish(lines, None)
  return rows


def _error(stderr: str, code: int) -> str:
  """A failed child's error in one line: its `error:` line, else the first line of tyro's boxed message, else the
  traceback's last line."""
  lines = [line.strip(" │╭╰╮╯─") for line in stderr.splitlines()]
  lines = [line for line in lines if line]
  boxed = [line for line in stderr.splitlines() if line.startswith("│")]
  return next((line for line in reversed(lines) if line.startswith("error:")),
              boxed[0].strip(" │") if boxed else (lines or [f"exit {code}"])[-1])


def _header(shape, devices, batch_size, seq_len, compute_dtype, device_gb, rows) -> list[str]:
  """The section's text above its table: what was compiled, on what, what the numbers include, and the choices."""
  params = next((r["params"] for r in rows if "params" in r), None)
  n = SHAPES[shape]["num_hidden_layers"]
  own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  rss = max([own] + [r["peak_rss"] for r in rows])
  dev = f"{devices} simulated CPU device{'s' * (devices > 1)}"
  per = batch_size // devices
  layout = (f"`--mesh fsdp={devices}` shards every weight, master copy and moment evenly over the {devices} devices "
            f"(each layer's weights all-gathered in turn in the step) and splits the batch" if devices > 1 else
            "one device holds everything")
  paper = PAPER_LAYOUT if devices > 1 else "BAdam's Llama 3-8B run used one RTX3090-24GB."
  lines = [
      f"Commit {git_commit()}, {time.strftime('%Y-%m-%d')}. **Peak RSS {rss / 2 ** 30:.2f} GiB**, the largest of this "
      f"process's ({own / 2 ** 30:.2f} GiB) and its children's (one per method, in the table): nothing of the "
      f"model was allocated.", "",
      f"- **What**: a {shape} config.json only ({_count(params)}{n} layers, "
      f"bfloat16, untied embeddings; no weights). Per method a fresh process builds what the train CLI builds for "
      f"the command listed under the table, up to its memory pre-flight, with the trainer's own functions "
      f"(research/bench/preflight.py `step_estimate`), and compiles the train step against the abstract state "
      f"on {dev}.",
      f"- **These are XLA:CPU's compiled memory figures for a simulated mesh; a GPU compile may differ** "
      f"(XLA:CPU computes bfloat16 matmuls in float32, so its temporaries can be larger; XLA:GPU fuses, schedules "
      f"and picks attention kernels differently). Per device, from `memory_analysis`: the train state's shard "
      f"(weights, master copies, optimizer moments, adapters); temporaries (activations kept for the backward "
      f"under --remat, gradients, optimizer intermediates, gathered weights, collective buffers); the step's peak "
      f"= arguments (state + batch) + outputs − aliased (the donated state's buffers reused) + temporaries. Not "
      f"counted: the runtime's own reservation and fragmentation (CUDA context, allocator pools), the --init-from "
      f"load, the held-out evaluation and the checkpoint writer. Fits: peak ≤ {device_gb:g} × 10^9 bytes "
      f"(GB = 10^9 bytes throughout; a GPU sold as {device_gb:g} GB has {device_gb:g} GiB, "
      f"{device_gb * 2 ** 30 / GB:.1f} GB, less what the CUDA context and the allocator keep).",
      f"- **Layout**: {layout}: {per} sequence{'s' * (per > 1)} of {seq_len} tokens per device. {paper}",
      f"- **Choices**: the reference gives no sequence length; the default batch is 2 sequences per device (the "
      f"per-device batch of the paper's Llama 3-8B runs, with 8 accumulation steps), T = {seq_len} (ours), --remat "
      f"True (gradient checkpointing, which Ledzy/BAdam's README counts on), --compute-dtype {compute_dtype} (the "
      f"paper trains in mixed precision)."]
  if params:  # the paper's whole-model estimate, M in billions, D blocks
    m = params / 1e9
    lines.append(f"- BAdam's own estimate, 2M + 16M/D GB (M = {m:.2f}, D = {n} layer blocks): {2 * m + 16 * m / n:.1f} "
                 f"GB in all, {(2 * m + 16 * m / n) / devices:.1f} GB per device split evenly over {devices}, "
                 f"before activations.")
  return lines + [""]


def _count(params: int | None) -> str:
  if params is None:
    return ""
  return f"{params / 1e9:.2f}B parameters, " if params >= 10 ** 8 else f"{params / 1e6:.2f}M parameters, "


def _gb(n: int) -> str:
  """Bytes in GB (10^9), or MB below a tenth of one."""
  return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 10 ** 6:.1f} MB"


def _table(rows: list[dict], rank: int, device_gb: float) -> list[str]:
  cells = []
  for r in rows:
    if r["exit"]:
      cells.append([r["method"], TRAINS[r["method"]].format(rank=rank), "-", "-", "-", f"failed: {r['error']}", "-",
                    f"{r['peak_rss'] / 2 ** 30:.2f}"])
      continue
    cells.append([r["method"], TRAINS[r["method"]].format(rank=rank), _gb(r["state"]), _gb(r["temp"]), _gb(r["peak"]),
                  "yes" if r["peak"] <= device_gb * GB else "**no**",
                  f"{r['compile_s']:.0f}", f"{r['peak_rss'] / 2 ** 30:.2f}"])
  lines = table(["method", "trains", "train state / device", "temporaries / device", "step peak / device",
                 f"fits {device_gb:g} GB", "compile s", "child peak RSS GiB"], cells)
  lines += ["", "Each row's train command (the pre-flight it prints is the row; the command would then build the state "
            "itself: do not run it on a small machine):", ""]
  lines += [f"- `{r['method']}`: `{r['command']}`" for r in rows]
  return lines + [""]


if __name__ == "__main__":
  _child(sys.argv[1:])
