"""Host memory of a Hugging Face import: `models.from_hf` against a plain full load, and the floor.

  python -m research.bench hf --out research/results/bench_hf_import.md

Writes a random Llama-shaped checkpoint (`--d-model`, `--n-layers`, `--vocab`; fp32 safetensors via `models.to_hf`)
once, then loads it in a fresh process per row and reads that process's peak resident memory (ru_maxrss) minus
its resident memory just before the load (JAX, the backend and the model code already imported and started):

  from_hf, 1 device        every leaf built from safetensors slices (`jax.make_array_from_callback`)
  from_hf, fsdp=8          the same onto 8 simulated CPU devices (one host: every shard still lives here)
  full load (peer)         `safetensors.numpy.load_file` of the whole file, then stack and `device_put`: what a
                           loader without per-shard reads does
The floor is 1.0x: the parameters themselves must be resident. The target (issue 16) is < 1.5x.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import tyro

from research.bench.report import command, publish

CHILD = r"""
import json, os, resource, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from flax import nnx
import models
from sharding import make_mesh
path, mode = sys.argv[1], sys.argv[2]
jax.devices()
def rss():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
before = rss()
t = time.perf_counter()
if mode == "full":
  from safetensors.numpy import load_file
  _, config = models.hf.config_from_hf(json.load(open(os.path.join(path, "config.json"))))
  tensors = load_file(os.path.join(path, "model.safetensors"))
  out = []
  for p, (template, tr) in models.hf.tensor_map(config, "LlamaForCausalLM").items():
    lead = models.hf._stack_axes(template)
    if lead:
      x = np.stack([tensors[template.format(l=l)].T if tr else tensors[template.format(l=l)]
                    for l in range(config.n_layers)])
    else:
      x = tensors[template].T if tr else tensors[template]
    out.append(jax.device_put(np.ascontiguousarray(x)))
  jax.block_until_ready(out)
else:
  model, _ = models.from_hf(path, mesh=None if mode == "one" else make_mesh(mode))
  jax.block_until_ready(nnx.state(model))
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "seconds": seconds}))
"""


@dataclasses.dataclass
class Args:
  """Peak host memory of importing an HF checkpoint, ours vs a full load vs the floor."""
  d_model: int = 1024
  n_layers: int = 8
  vocab: int = 32000
  d_ff: int = 2816
  work: str = "runs/bench_hf"
  """Where the checkpoint is written (reused when present)."""
  out: str | None = None
  """Markdown file for the table (else printed only)."""


def _checkpoint(a: Args) -> tuple[str, int]:
  path = os.path.join(a.work, f"llama_d{a.d_model}_l{a.n_layers}_v{a.vocab}")
  if not os.path.exists(os.path.join(path, "model.safetensors")):
    from flax import nnx

    import models
    config = models.TransformerConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.n_layers, n_heads=16,
                                      n_kv_heads=4, d_ff=a.d_ff, tie_embeddings=False)
    models.to_hf(models.Transformer(config, rngs=nnx.Rngs(0)), path)
  return path, os.path.getsize(os.path.join(path, "model.safetensors"))


def hf(a: tyro.conf.OmitArgPrefixes[Args]):
  """Host memory of a Hugging Face import against a plain full load and the floor (see the module docstring)."""
  path, size = _checkpoint(a)
  rows = []
  for label, mode in (("from_hf, 1 device", "one"), ("from_hf, fsdp=8", "fsdp=8"), ("full load (peer)", "full")):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", CHILD, path, mode], capture_output=True, text=True, env=env)
    if res.returncode:
      sys.exit(f"error: {label}: {res.stderr.strip().splitlines()[-1]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    rows.append((label, (r["peak"] - r["before"]) / size, r["seconds"]))
  lines = [f"Checkpoint: {size / 2**20:.0f} MiB fp32 (Llama shape d_model={a.d_model}, {a.n_layers} layers, vocab "
           f"{a.vocab}, untied). Peak RSS above the pre-load RSS, as a multiple of the checkpoint's bytes.", "",
           "| loader | peak host memory / checkpoint bytes | seconds |", "|---|---|---|"]
  lines += [f"| {label} | {ratio:.2f}x | {sec:.1f} |" for label, ratio, sec in rows]
  lines += ["| floor (the parameters themselves) | 1.00x | |", "",
            "Command: `" + command("hf", a) + "`",
            f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores."]
  publish(lines, a.out, preface="# Hugging Face import: host memory\n\n")

