"""`python -m research.bench finetune-3b [--shape llama-8b]`: the BlockOptimizers papers' memory claim on this machine.

BAdam (NeurIPS 2024) fine-tunes Llama-3-8B on one 24 GB GPU, where AdamW needs ~16 bytes per parameter. Here: a
Llama-3.2-3B-shaped model (d 3072, 28 layers, 24 / 8 heads, d_ff 8192, vocab 128256, tied; 3.2B parameters) or with
`--shape llama-8b` a Llama-3-8B-shaped one (d 4096, 32 layers, 32 / 8 heads, d_ff 14336, vocab 128256, untied; 8.0B)
with random weights is written in the Hugging Face format (bfloat16, as the real models ship; once, kept in `work`):
tensor by tensor, each drawn by torch in bfloat16 (normal, std `initializer_range`; norms ones), named and shaped as
`transformers.LlamaForCausalLM` has them (built on the meta device: nothing allocated) and saved by `safetensors` in
files of at most 2 GB, so the writer never holds more than one file's tensors (a float32 model, or even a whole
bfloat16 one, never exists). Then each method fine-tunes it through the train CLI from `--init-from hf:DIR`, in a fresh
child process each, on one CPU device of this machine: `steps` steps of `batch_size` x `seq_len` tokens of the default
corpus. Recorded per method: the exit status, the memory pre-flight's line (or its refusal), the losses, and the
child's peak RSS (`os.wait4`'s `ru_maxrss`: loading, compiling, training, evaluating and the final checkpoint).

Methods: `adamw` (full fine-tuning: refused by the pre-flight when it cannot fit), `badam` (the blockwise step:
bfloat16 storage, one layer's float32 master and AdamW state), `badam-f32` (the same with --frozen-dtype float32),
`lora` (rank-`rank` adapters on a bfloat16 base), `bread` (BREAD-SGD, `--opt mode="sgd"`: the blockwise step whose
layer-by-layer backward also steps every layer above the active one by its gradient; `order="ascending"`, so the
first block is layer 0 and all 27 layers above it take SGD steps, the whole backward pass: under the default
descending order the first block is the top layer and BREAD is BAdam until the first switch) and `bread-lowrank`
(BREAD's low-rank mode, rank 8: the same blockwise step, the 27 layers above moved through their factors' AdamW steps in
the same backward; `order="ascending"` likewise). Finished
methods are kept in `work/results.json`, so a rerun continues with the others.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Annotated

import jax

from research import flags
from research.bench.report import Progress, call_command, machine, run_child, table

LLAMA_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=True, max_position_embeddings=8192)
# the same family at smoke size (the tests run the whole driver on it)
SHAPES = {"llama-3b": LLAMA_3B, "llama-tiny": {**LLAMA_3B, "vocab_size": 512, "hidden_size": 64,
                                               "intermediate_size": 128, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "num_key_value_heads": 2}}
LLAMA_8B = {**LLAMA_3B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "tie_word_embeddings": False}  # Llama-3-8B's shape
SHAPES["llama-8b"] = LLAMA_8B
WRITER = """
import json, os, sys, torch, transformers
from safetensors.torch import save_file
path, shape, shard_bytes = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
config = transformers.LlamaConfig(**shape, dtype="bfloat16", architectures=["LlamaForCausalLM"])
with torch.device("meta"):  # the tensors' names and shapes, nothing allocated
  names = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()
           if not (config.tie_word_embeddings and k == "lm_head.weight")}  # a tied head is the embedding
os.makedirs(path)
config.save_pretrained(path)
n, shard, used, weight_map = 0, {}, 0, {}
def flush():  # one file written, its tensors freed
  global n, shard, used
  if shard:
    n += 1
    save_file(shard, os.path.join(path, f"part-{n:05d}.safetensors"), metadata={"format": "pt"})
    shard, used = {}, 0
for i, (name, shp) in enumerate(names.items()):
  g = torch.Generator().manual_seed(i)  # one stream per tensor: the same file whatever the shard size
  t = (torch.ones(shp, dtype=torch.bfloat16) if name.endswith("norm.weight") else
       torch.randn(shp, generator=g, dtype=torch.bfloat16).mul_(config.initializer_range))
  if used and used + t.numel() * 2 > shard_bytes:
    flush()
  shard[name], used = t, used + t.numel() * 2
  weight_map[name] = f"part-{n + 1:05d}.safetensors"
flush()
rename = {f"part-{k:05d}.safetensors": f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)}
for old, new in rename.items():
  os.rename(os.path.join(path, old), os.path.join(path, new))
index = {"metadata": {"total_size": sum(2 * torch.Size(s).numel() for s in names.values())},
         "weight_map": {k: rename[v] for k, v in weight_map.items()}}
json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"), indent=1)
"""
NAMES = {"llama-3b": "Llama-3.2-3B-shaped model (3.2B parameters, ",
         "llama-8b": "Llama-3-8B-shaped model (8.0B parameters, untied head, "}
SHARD_BYTES = 2 * 10 ** 9  # at most this many bytes of tensors in the writer's memory (one file's)
METHODS = ("adamw", "badam", "badam-f32", "lora", "bread", "bread-lowrank")
GIB = 2 ** 30


def method_flags(method: str, rank: int) -> list[str]:
  return {"adamw": [], "badam": ["--optimizer", "badam"],
          "bread": ["--optimizer", "bread", "--opt", 'mode="sgd"', 'order="ascending"'],
          "bread-lowrank": ["--optimizer", "bread", "--opt", 'order="ascending"'],
          "badam-f32": ["--optimizer", "badam", "--frozen-dtype", "float32"],
          "lora": ["--peft", "lora", "--peft.rank", str(rank), "--peft.alpha", str(2 * rank),
                   "--peft.base-dtype", "bfloat16"]}[method]


def write_model(path: str, shape: str = "llama-3b") -> float:
  """The random model of `shape` (`SHAPES`) in the HF format at `path` (written once); the seconds it took."""
  if os.path.exists(os.path.join(path, "config.json")):
    return 0.0
  t = time.perf_counter()
  if os.path.exists(path + ".partial"):  # an interrupted write
    shutil.rmtree(path + ".partial")
  res = subprocess.run([sys.executable, "-c", WRITER, path + ".partial", json.dumps(SHAPES[shape]),
                        str(SHARD_BYTES)], capture_output=True, text=True)
  if res.returncode:
    raise SystemExit(f"error: writing the model failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
  os.replace(path + ".partial", path)
  return time.perf_counter() - t


def run_method(method: str, model: str, run_dir: str, steps: int, batch_size: int, seq_len: int, rank: int,
               lr: float, remat: bool) -> dict:
  """One fine-tuning run in a fresh child process: its exit status, console lines, losses and peak RSS."""
  cmd = [sys.executable, "-m", "research.train", "--init-from", f"hf:{model}", "--out", run_dir, "--steps",
         str(steps), "--batch-size", str(batch_size), "--seq-len", str(seq_len), "--mesh", "data=1", "--devices", "1",
         "--lr", str(lr), "--warmup-steps", "0", "--eval-every", str(steps), "--eval-batches", "1", "--log-every", "1",
         "--ckpt-every", str(steps), "--keep", "1", *(["--remat", "True"] if remat else []),
         *method_flags(method, rank)]
  code, peak_rss, stdout, stderr, wall = run_child(cmd, run_dir)  # logs beside the run directory, kept
  records = []
  if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  memory = next((l for l in stdout.splitlines() if l.startswith("memory: the step")), None)
  measured = next((l for l in stdout.splitlines() if l.startswith("memory: measured")), None)
  return {"method": method, "command": " ".join(["python", "-m", "research.train"] + cmd[3:]), "exit": code,
          "memory_line": memory, "measured_line": measured,
          "error": stderr.strip().splitlines()[-1] if code and stderr.strip() else None,
          "stderr_tail": stderr.strip().splitlines()[-6:], "stdout": stdout.strip().splitlines(),
          "losses": [r["loss"] for r in records if "loss" in r],
          "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
          "peak_rss": peak_rss, "wall_s": wall}


def estimate_gib(line: str | None) -> float | None:
  """The pre-flight's total (GiB) from its line ("... = 9.87 GiB; host RAM has ...", or on one accelerator "...
  estimated 1.2 GiB per device ...") or its refusal ("error: the run needs an estimated 25.65 GiB (...")."""
  line = line or ""
  m = (re.search(r"= ([\d.]+) (GiB|MiB);", line)
       or re.search(r"^error: the run needs an estimated ([\d.]+) (GiB|MiB)", line)
       or re.search(r"estimated ([\d.]+) (GiB|MiB) per device", line))  # one accelerator: its own memory only
  return None if m is None else float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)


def measured_gib(line: str | None) -> tuple[float | None, str]:
  """(GiB, what) of the run's own closing line ("memory: measured 9.1 GiB (process peak RSS) against ...")."""
  m = re.search(r"measured ([\d.]+) (GiB|MiB) \(([^)]*)\)", line or "")
  return (None, "") if m is None else (float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1), m.group(3))


def finetune_3b(methods: Annotated[tuple[str, ...], flags.one_of(*METHODS)] = METHODS, steps: int = 4,
                batch_size: int = 1, seq_len: int = 64, rank: int = 8, lr: float = 1e-3, remat: bool = False,
                budget_gib: float = 16.0, work: str = "runs/finetune-3b", out: str | None = None,
                shape: Annotated[str, flags.one_of(*SHAPES)] = "llama-3b") -> list[dict]:
  """Fine-tunes the 3B (or 8B) shape with each method in a fresh process and tabulates peak RSS against `budget_gib`.

  Args:
    methods: from `METHODS`.
    steps, batch_size, seq_len, lr: each run's; one CPU device (mesh data=1).
    remat: --remat (each layer recomputed in the backward). Not needed for memory: a model stored in bfloat16 and
      computed in float32 keeps its products' outputs for the backward, not its layers' float32 weights
      (`models.params.layer_checkpoint`).
    rank: LoRA's.
    budget_gib: the peak RSS each method should stay within (16 GiB for 3B, 22 GiB for 8B on this 24 GiB machine).
    work: the model, the runs and results.json (finished methods are not rerun).
    out: markdown file for the table.
    shape: "llama-3b", "llama-8b", or "llama-tiny" (the same family at smoke size).
  """
  unknown = [m for m in methods if m not in METHODS]
  if unknown or shape not in SHAPES:
    raise SystemExit(f"error: unknown methods {unknown} or shape {shape!r}; choose from {', '.join(METHODS)} and "
                     f"{', '.join(SHAPES)}")
  os.makedirs(work, exist_ok=True)
  model = os.path.join(work, f"hf-{shape}")
  written = write_model(model, shape)
  saved = os.path.join(work, "results.json")
  done = {r["method"]: r for r in json.load(open(saved))} if os.path.exists(saved) else {}
  args = {k: v for k, v in locals().items() if k in ("methods", "steps", "batch_size", "seq_len", "rank", "lr",
                                                       "budget_gib", "work", "shape", "remat")}
  dev = jax.devices()[0]
  on_cpu = dev.platform == "cpu"
  progress = Progress(call_command("finetune-3b", finetune_3b, args), out, [
      f"A random {NAMES.get(shape, shape + ' model (')}"
      f"bfloat16, written tensor by tensor in the HF format in "
      f"{written:.0f} s this run, or earlier) fine-tuned from `--init-from hf:` by the train CLI, one fresh process "
      f"per method on one {dev.platform} device ({machine()}; {os.cpu_count()} cores), {steps} steps of "
      f"{batch_size} x {seq_len} tokens. Peak RSS: the child's ru_maxrss (load, compile, train, evaluate, "
      f"checkpoint). Measured: the run's own closing line ({'its peak RSS' if on_cpu else 'the largest'} "
      f"{'' if on_cpu else 'peak_bytes_in_use of its device'}). Estimate: the memory pre-flight's total (its line "
      f"below).", ""])
  rows = []
  for method in methods:
    if method not in done:
      print(f"[finetune-3b] {method} ...", file=sys.stderr, flush=True)
      run_dir = os.path.join(work, "runs", method)
      if os.path.exists(run_dir):  # an interrupted attempt: start it again
        shutil.rmtree(run_dir)
      done[method] = run_method(method, model, run_dir, steps, batch_size, seq_len, rank, lr, remat)
      json.dump(list(done.values()), open(saved + ".tmp", "w"), indent=1)
      os.replace(saved + ".tmp", saved)
    rows.append(done[method])
  cells = []
  for r in rows:
    est = estimate_gib(r["memory_line"] or r["error"])
    rss = r["peak_rss"] / GIB
    got, what = measured_gib(r.get("measured_line"))
    got, what = (got, what) if got is not None else (rss, "peak RSS")  # a run from before the closing line
    outcome = ("refused by the pre-flight" if r["exit"] == 2 and "estimated" in (r["error"] or "") else
               "trained" if r["exit"] == 0 else f"exit {r['exit']}")
    cells.append([r["method"], outcome, " → ".join(f"{x:.3f}" for x in r["losses"]) or "-",
                  f"{r['val_loss']:.3f}" if r["val_loss"] is not None else "-", f"{rss:.2f}",
                  f"{got:.2f} ({what})" if r["exit"] == 0 else "-",
                  ("yes" if got <= budget_gib else "NO") if r["exit"] == 0 else "-",
                  f"{est:.2f}" if est else "-", f"{est / got:.2f}" if est and r["exit"] == 0 else "-",
                  f"{r['wall_s']:.0f}"])
  progress.lines += table(["method", "outcome", "train loss per step", "val loss", "peak RSS GiB",
                           "measured peak GiB", f"≤ {budget_gib:g} GiB", "pre-flight estimate GiB",
                           "estimate / measured", "wall s"], cells)
  progress.lines += [""] + [f"- `{r['method']}`: `{r['command']}`" for r in rows] + [""]
  for r in rows:
    progress.lines += [f"`{r['method']}` pre-flight: {r['memory_line'] or '-'}"] + (
        [f"`{r['method']}` refusal: {r['error']}"] if r["error"] else []) + [""]
  progress.emit()
  return rows

