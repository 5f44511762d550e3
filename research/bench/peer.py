"""`python -m research.bench peer`: optlab's train step against the PyTorch step a researcher would otherwise write,
for the same model, on the same batches, in one run; then optlab's optimizer overheads and Newton–Schulz precision.

1. Side by side. The model is built once in optlab (`research/train/`: the trainer's jitted step, AdamW with
   clipping, the compute dtype, `--attention auto`) and written with `models.hf.to_hf`; the peer loads those weights
   into Hugging Face `LlamaForCausalLM` (`attn_implementation="sdpa"`: F.scaled_dot_product_attention), trains with
   `torch.optim.AdamW` (fused on CUDA) and `clip_grad_norm_`, under `torch.autocast` for bfloat16, eager and
   `torch.compile`d. Both take the same token batches; the first step's losses (before any update) must agree, so
   the two sides are the same model. Each side: `warmup` untimed steps, then `steps` timed back to back, waited for
   at the end (tokens/s = batch·T·steps / wall time). MFU = `models.flops_per_token` × tokens/s over the peak of
   `research/train/throughput.Peak` (the chip's datasheet figure for the dtype; a measured matmul on a CPU), the
   same FLOP count for both. Peak memory: the devices' `peak_bytes_in_use` / `torch.cuda.max_memory_allocated` on a
   GPU; on a CPU optlab's compiled step (`memory_analysis`: arguments + temporaries) and no torch figure.
2. Optimizer overhead: optlab's train step with AdamW, Muon and NorMuon (their defaults), time relative to AdamW.
3. Newton–Schulz: `optim.newton_schulz.orthogonalize` of a (d_model, d_ff) matrix in float32 and bfloat16: time,
   and the error against the SVD's polar factor U Vᵀ, ‖O − UVᵀ‖_F / ‖UVᵀ‖_F (quintic NS is approximate by design:
   both dtypes have an error; what matters is whether bfloat16 adds to it).

Without torch or transformers the peer rows say so in one line and the rest runs. Defaults are issue 37's H100 shape
(205M parameters, T 2048, batch 8, bfloat16); on a CPU pass a small one (the tests use d 64, 2 layers, T 64).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import Transformer, count_params, flops_per_token
from models.attention import resolve
from models.hf import to_hf
from optim.newton_schulz import orthogonalize
from research import flags
from research.bench.floor import floor_params, floor_step
from research.bench.report import Progress, git_commit, machine, table
from research.bench.timing import build_train_step
from research.data import get_batch, load_corpus
from research.train.config import TrainConfig
from research.train.hooks.throughput import Peak
from research.train.runtime.xla import compiler_options
from research.train.setup.build import make_optimizer, optimizer_needs

SOME_MESHES = dataclasses.replace(flags.MESH, empty=True)  # --meshes: none (one device) is the default


def peer(d_model: int = 1024, n_layers: int = 16, n_heads: int = 16, d_ff: int = 2816, seq_len: int = 2048,
         batch_size: int = 8, dtype: str = "bfloat16", warmup: int = 5, steps: int = 20, compile_torch: bool = True,
         optimizers: tuple[str, ...] = ("adamw", "muon", "normuon"),
         meshes: Annotated[tuple[str, ...], SOME_MESHES] = (), repeats: int = 1, out: str | None = None) -> dict:
  """optlab vs its PyTorch peer, optimizer overheads, Newton–Schulz precision (module docstring).

  Args:
    d_model, n_layers, n_heads, d_ff: the model (byte vocabulary, tied embeddings, RoPE, RMSNorm, SwiGLU).
    seq_len, batch_size: the batch.
    dtype: compute dtype, bfloat16 or float32 (parameters and optimizer state stay float32 on both sides).
    warmup, steps: untimed and timed steps per contender.
    compile_torch: also time the peer under torch.compile (minutes to compile on a CPU).
    optimizers: optlab optimizers for the overhead table (the first is the baseline).
    meshes: further meshes to time optlab's step on (e.g. "data=2,fsdp=2,tensor=2", `make run`'s layout).
    repeats: timing rounds; each round times every contender in turn, and the table gives the median and range.
    out: also write the report (markdown) to this file.
  """
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to torch too (before jax starts)
  shape = dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff)
  flags = dict(shape, compute_dtype=dtype, optimizer="adamw", lr=3e-4, grad_clip=1.0)
  extra = (f" --meshes {' '.join(meshes)}" if meshes else "") + (f" --repeats {repeats}" if repeats > 1 else "")
  report = Progress(f"python -m research.bench peer {_args(shape, seq_len, batch_size, dtype, warmup, steps)}{extra}",
                    out)
  peak = Peak(dtype=dtype)
  corpus = load_corpus()
  batches = [get_batch(corpus.train, 0, s, batch_size, seq_len) for s in range(warmup + steps)]
  ours = _optlab(flags, batches, warmup, steps)
  fpt = flops_per_token(ours["mcfg"], seq_len)
  report.lines += [f"{machine()}; git {git_commit()}; {_versions()}", f"model: {count_params(ours['mcfg']) / 1e6:.1f}M "
                   f"parameters ({_args(shape, seq_len, batch_size, dtype, warmup, steps)}), {fpt / 1e9:.2f} GFLOP per "
                   f"token; MFU over {peak.flops / 1e12:.1f} TFLOP/s ({peak.source})", ""]
  floor = _floor(flags, ours, batches, warmup, steps)
  rows = [dict(ours, name=f"optlab (jit, attention {ours['attention']}, 1 device)")]
  rows += [dict(_optlab(flags, batches, warmup, steps, spec), name=f"optlab, mesh {spec}") for spec in meshes]
  rows += [floor]
  rows += _torch_rows(ours, batches, warmup, steps, dtype, compile_torch, report)
  for _ in range(repeats - 1):  # the further rounds, every contender in turn: load drifts hit all of them alike
    rows = [_timed(r) for r in rows]
  ours, floor = rows[0], rows[len(meshes) + 1]
  report.lines += [f"### 1. Train step, side by side ({repeats} interleaved rounds of {steps} steps: median "
                   "tokens/s, min–max in brackets)", ""] + table(
      ["contender", "tokens/s", "step ms", "MFU", "x optlab", "x JAX floor", "peak memory", "loss at step 0"],
      [[r["name"], f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f}–{r['tokens_per_s_max']:,.0f})",
        f"{r['step_s'] * 1e3:.1f}",
        f"{r['tokens_per_s'] * fpt / peak.flops:.1%}", f"{r['tokens_per_s'] / ours['tokens_per_s']:.2f}",
        f"{r['tokens_per_s'] / floor['tokens_per_s']:.2f}", _gib(r.get("memory")), f"{r['loss0']:.5f}"]
       for r in rows])
  report.emit()
  overhead = [_optlab(dict(flags, optimizer=name), batches, warmup, steps) for name in optimizers]
  report.lines += ["", "### 2. optlab's optimizers: the whole train step", ""] + table(
      ["optimizer", "step ms", "x " + optimizers[0], "tokens/s"],
      [[name, f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / overhead[0]['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}"]
       for name, r in zip(optimizers, overhead)])
  report.emit()
  ns = [_newton_schulz(d_model, d_ff, dt) for dt in ("float32", "bfloat16")]
  report.lines += ["", f"### 3. Newton–Schulz (quintic, 5 steps) on a {d_model} x {d_ff} matrix", ""] + table(
      ["dtype", "ms", "x float32", "error vs U Vᵀ (SVD)"],
      [[r["dtype"], f"{r['s'] * 1e3:.2f}", f"{r['s'] / ns[0]['s']:.2f}", f"{r['error']:.4f}"] for r in ns])
  report.emit()
  plain = lambda r: {k: v for k, v in r.items() if k not in ("mcfg", "timer")}
  return {"side_by_side": [plain(r) for r in rows], "floor": plain(floor),
          "optimizers": dict(zip(optimizers, [r["step_s"] for r in overhead])), "newton_schulz": ns}


def _args(shape, seq_len, batch_size, dtype, warmup, steps) -> str:
  return (" ".join(f"--{k.replace('_', '-')} {v}" for k, v in shape.items())
          + f" --seq-len {seq_len} --batch-size {batch_size} --dtype {dtype} --warmup {warmup} --steps {steps}")


def _versions() -> str:
  try:
    import torch
    import transformers
    return f"torch {torch.__version__}, transformers {transformers.__version__}"
  except ImportError:
    return "torch or transformers not installed"


def _gib(nbytes) -> str:
  return "n/a" if nbytes is None else f"{nbytes / 2 ** 30:.2f} GiB"


def _optlab(flags: dict, batches, warmup: int, steps: int, spec: str = "data=1") -> dict:
  """optlab's train step (research/bench/timing.build_train_step) on the mesh `spec`, timed over the batches."""
  B, T = batches[0][0].shape
  cfg, mcfg, mesh, state, step, batch_sh = build_train_step("small", spec, B, T, **flags)
  device = [tuple(jax.device_put(a, batch_sh) for a in b) for b in batches]
  with jax.set_mesh(mesh):
    compiled = step.lower(state, *device[0]).compile()
    mem = compiled.memory_analysis()
    state, out = compiled(state, *device[0])
    loss0 = float(out["loss"])
    for b in device[1:warmup]:
      state, out = compiled(state, *b)
    jax.block_until_ready(out)
  held = [state]

  def timer() -> float:  # the timed steps, continuing from the state the last call left
    with jax.set_mesh(mesh):
      st, t = held[0], time.perf_counter()
      for b in device[warmup:]:
        st, o = compiled(st, *b)
      jax.block_until_ready(o)
      held[0] = st
      return time.perf_counter() - t
  stats = jax.devices()[0].memory_stats() or {}
  memory = stats.get("peak_bytes_in_use") or (mem.argument_size_in_bytes + mem.temp_size_in_bytes if mem else None)
  return _timed(dict(mcfg=mcfg, seed=cfg.training.seed, loss0=loss0, memory=memory, attention=_resolved(mcfg, T),
                     timer=timer, tokens=B * T * steps, steps=steps))


def _floor(flags: dict, ours: dict, batches, warmup: int, steps: int) -> dict:
  """The JAX floor (research/bench/floor.py) from optlab's initial weights with its optimizer, timed the same way."""
  B, T = batches[0][0].shape
  cfg = TrainConfig(model="small", batch_size=B, seq_len=T, mesh="data=1", **flags)
  tx = make_optimizer(cfg.optim, cfg.training.steps, optimizer_needs(cfg.optim))[0]
  params = jax.device_put(floor_params(ours["mcfg"], ours["seed"]), jax.devices()[0])
  opt_state, step = tx.init(params), floor_step(ours["mcfg"], tx, compiler_options())
  data = [tuple(jax.device_put(np.asarray(a), jax.devices()[0]) for a in b) for b in batches]
  params, opt_state, loss = step(params, opt_state, *data[0])
  loss0 = float(loss)
  for b in data[1:warmup]:
    params, opt_state, loss = step(params, opt_state, *b)
  jax.block_until_ready(loss)
  held = [params, opt_state]

  def timer() -> float:
    p, o, t = *held, time.perf_counter()
    for b in data[warmup:]:
      p, o, loss = step(p, o, *b)
    jax.block_until_ready(loss)
    held[:] = [p, o]
    return time.perf_counter() - t
  return _timed(dict(name="JAX floor (plain jnp + optax, 2-D matmuls, layers unrolled, 1 device)", loss0=loss0,
                     memory=None, timer=timer, tokens=B * T * steps, steps=steps))


def _timed(row: dict) -> dict:
  """A contender's row after one more timing round (`timer`): tokens/s and step time are the medians over rounds."""
  row.setdefault("walls", []).append(row["timer"]())
  wall = statistics.median(row["walls"])
  return dict(row, step_s=wall / row["steps"], tokens_per_s=row["tokens"] / wall,
              tokens_per_s_min=row["tokens"] / max(row["walls"]), tokens_per_s_max=row["tokens"] / min(row["walls"]))


def _resolved(mcfg, T) -> str:
  return resolve(mcfg.attention, mcfg.compute_dtype, T, mcfg.hd, 1, getattr(jax.devices()[0], "device_kind", ""))


def _torch_rows(ours, batches, warmup, steps, dtype, compile_torch, report) -> list[dict]:
  try:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
  except ImportError as e:
    report.lines += [f"PyTorch peer skipped: {e}", ""]
    return []
  device = "cuda" if torch.cuda.is_available() else "cpu"
  with tempfile.TemporaryDirectory(prefix="optlab-peer-") as tmp:
    # the weights optlab's step started from (the trainer's init is this call; the step-0 losses check it)
    to_hf(Transformer(ours["mcfg"], rngs=nnx.Rngs(ours["seed"])), os.path.join(tmp, "hf"))
    rows = []
    for compiled in (False, True) if compile_torch else (False,):
      net = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "hf"), dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
      rows.append(_torch_train(torch, net, batches, warmup, steps, dtype, device, compiled))
      print(f"  torch {'compiled' if compiled else 'eager'}: {rows[-1]['tokens_per_s']:,.0f} tokens/s",
            file=sys.stderr, flush=True)
      del net
  return rows


def _torch_train(torch, net, batches, warmup, steps, dtype, device, compiled) -> dict:
  """The peer's train step: forward under autocast, float32 cross-entropy, backward, clip, fused AdamW."""
  import torch.nn.functional as F
  net.train()
  params = [p for p in net.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=device == "cuda")
  forward = torch.compile(net) if compiled else net

  def step(x, y):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
      logits = forward(input_ids=x, use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  data = [tuple(torch.as_tensor(np.asarray(a), dtype=torch.long, device=device) for a in b) for b in batches]
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  loss0 = float(step(*data[0]))
  for b in data[1:warmup]:
    step(*b)
  sync()

  def timer() -> float:
    t = time.perf_counter()
    for b in data[warmup:]:
      loss = step(*b)
    float(loss), sync()
    return time.perf_counter() - t
  B, T = batches[0][0].shape
  return _timed(dict(name=f"PyTorch {torch.__version__} ({'torch.compile' if compiled else 'eager'}, SDPA, "
                          f"{'fused ' if device == 'cuda' else ''}AdamW)", loss0=loss0, timer=timer,
                     tokens=B * T * len(data[warmup:]), steps=len(data[warmup:]),
                     memory=torch.cuda.max_memory_allocated() if device == "cuda" else None))


def _newton_schulz(m: int, n: int, dtype: str, repeats: int = 5) -> dict:
  """Time of one `orthogonalize` of a random m x n matrix in `dtype`, and its error against the polar factor."""
  g = jax.random.normal(jax.random.key(0), (m, n), jnp.float32)
  f = jax.jit(lambda x: orthogonalize(x, compute_dtype=dtype))
  o = jax.block_until_ready(f(g))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(g))
    times.append(time.perf_counter() - t)
  u, _, vt = np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)
  polar = u @ vt
  error = np.linalg.norm(np.asarray(o, np.float64) - polar) / np.linalg.norm(polar)
  return {"dtype": dtype, "s": statistics.median(times), "error": float(error)}
