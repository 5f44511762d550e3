"""`python -m research.bench moe`: one MoE model's train step under each parallel layout, timed, with its traffic.

Question: what does each layout (data, expert, tensor, fsdp, pipeline stage) cost the same mixture-of-experts train
step on the simulated mesh, and do the expert all-to-alls and tensor all-reduces that the compiler emits match the
analytic count?

For one model (default the `moe_tiny` preset: 2 blocks, D = 64, 8 SwiGLU experts of width 32, top-2, dropless) and
batch, per layout: the real train step of research/train/ (`make_steps`: AdamW, clipping, aux losses) is compiled
for the layout; its collectives are read from the compiled HLO (`sharding.collectives`) and each is attributed to the
mesh axes its replica groups span; the steps of all layouts are then run round-robin (one step of each layout per
round, so load on the shared machine hits them alike) and the median is reported.

Analytic bytes, per device per train step (ring algorithms, r(n) = (n−1)/n; the HLO audit counts the same way).
Notation: B·T tokens per step; N = data·fsdp·expert (the axes that split the batch); G = B·T/N tokens per device;
k top-k; D model width; b bytes per activation element; L MoE blocks per device (L/S with S pipeline stages);
P = expert axis size; Y = tensor axis size. A pipeline of S stages and M microbatches runs each stage on M + S − 1
microbatch slots, bubbles included, so there G = (M+S−1)/M · B·T/N.

- EP all-to-all. Each device sends each of its G·k assignments (a D-vector) to the device owning the chosen expert
  (dispatch) and gets the expert output back (combine): 2 all-to-alls forward, their transposes (all-to-alls of the
  same size) backward, 4 per MoE block. Under uniform routing a fraction r(P) of the assignments leaves the device:
      ideal (exact sizes, `ragged_all_to_all`):  4 · L · G·k·D·b · r(P)
  XLA:CPU runs the fixed-capacity dropless path of sharding/experts.py: every destination gets a buffer of all
  A = G·k local assignments, an operand of P·A·D·b of which r(P) leaves, plus the int32 expert ids forward:
      as run:  4 · L · (P−1)·G·k·D·b  +  L · (P−1)·G·k·4   (P× the ideal)
  (capacity-factor dispatch instead: (E·C)·D·b per all-to-all, C = ceil(cf·G·k/E): 4 · L · r(P)·E·C·D·b.)
- TP all-reduces (Megatron, activations replicated over `tensor`): a ring all-reduce of V bytes sends 2·r(Y)·V.
  Per block, textbook (Shoeybi et al., arXiv 1909.08053, §3): forward after the row-parallel attention output and
  FFN down projections, backward at the inputs of the column-parallel QKV and gate/up projections:
      2·r(Y)·b·D · (2·G + 2·R)     R = rows the experts compute on a device: G·k (no EP), P·G·k (the fixed-capacity
                                   EP buffer), E·C (capacity dispatch); a shared expert adds 2·G
  The compiled step all-reduces the input gradient once per consuming projection (q, k, v; gate, up) before
  summing, so backward is 3·G (attention) + 2·R (experts):
      as compiled:  2·r(Y)·b·D · (4·G + 3·R)
  plus, once per step, the tied head's input gradient (vocabulary split over `tensor`) 2·r(Y)·G₀·D·b, G₀ = B·T/N
  (and a few per-token cross-entropy reductions over the vocabulary shards, 4-byte scalars, not modelled).
Other traffic (gradient all-reduces over the data axes, FSDP gathers, pipeline permutes) is reported as measured.

On the CPU the 8 devices are simulated and share the machine's cores: times show partitioning and dispatch overhead,
not scaling; the bytes are what the same program sends on accelerators.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ConfigError, Transformer, count_params, preset
from research.bench.report import git_commit, publish
from research.data import get_batch, load_corpus
from research.train.config import TrainConfig
from research.train.runtime.devices import setup_jax
from research.train.setup.build import make_optimizer, optimizer_needs
from research.train.steps import train_state
from research.train.steps.step import make_steps
from sharding import batch_sharding, collectives, devices_for, make_mesh, mesh_spec, shard_batch
from sharding.mesh import DATA, EXPERT, FSDP, STAGE, TENSOR

LAYOUTS = ("data=1", "data=8", "expert=8", "data=2,expert=2,tensor=2", "expert=4,fsdp=2", "stage=2,data=2,expert=2")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
MIB = 2 ** 20


def analytic(mcfg, sizes: dict[str, int], batch: int, seq: int) -> dict[str, float]:
  """Bytes per device per train step of the EP all-to-alls ("ep_ideal", "ep_as_run") and the TP all-reduces
  ("tp_textbook", "tp_compiled"); the formulas are in the module docstring."""
  m = mcfg.moe
  D, k, E, b = mcfg.d_model, m.top_k, m.num_experts, jnp.dtype(mcfg.compute_dtype).itemsize
  N = sizes.get(DATA, 1) * sizes.get(FSDP, 1) * sizes.get(EXPERT, 1)
  P, Y, S = sizes.get(EXPERT, 1), sizes.get(TENSOR, 1), sizes.get(STAGE, 1)
  M = (mcfg.microbatches or S) if S > 1 else 1
  r = lambda n: (n - 1) / n
  calls = M + S - 1  # MoE invocations per block and device: 1, or every microbatch slot of the pipeline
  g = batch * seq / N / M  # tokens per invocation
  G0, G, L = batch * seq / N, calls * g, mcfg.n_layers // S
  if m.capacity_factor is None:
    R = G * k * P  # rows the local experts compute: P destinations' buffers of G·k rows (P = 1: the G·k themselves)
    ep_as_run = 4 * L * (P - 1) * G * k * D * b + L * (P - 1) * G * k * 4
  else:
    R = calls * E * math.ceil(m.capacity_factor * g * k / E)  # E·C slots per invocation
    ep_as_run = 4 * L * r(P) * R * D * b
  shared = G if m.num_shared else 0
  head = 2 * r(Y) * G0 * D * b
  return {"ep_ideal": 4 * L * G * k * D * b * r(P), "ep_as_run": ep_as_run if P > 1 else 0.0,
          "tp_textbook": 2 * r(Y) * b * D * L * (2 * G + 2 * R + 2 * shared) + head if Y > 1 else 0.0,
          "tp_compiled": 2 * r(Y) * b * D * L * (4 * G + 3 * R + 3 * shared) + head if Y > 1 else 0.0}


def axes_of(op, mesh) -> tuple[str, ...]:
  """The mesh axes along which the devices of the collective's (first) group differ."""
  group = op.groups[0] if op.groups else ()
  coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in group]) if group else np.zeros((0, 0))
  return tuple(a for j, a in enumerate(mesh.axis_names) if len(coords) and len(set(coords[:, j])) > 1)


def _by_axes(audit, mesh, kind: str, axis: str) -> float:
  """Wire bytes of the collectives of one kind whose groups span exactly the mesh axis `axis`."""
  return sum(op.count * op.wire_bytes for op in audit.ops if op.kind == kind and axes_of(op, mesh) == (axis,))


def _prepare(spec: str, mcfg, tx, batch: int, seq: int, batches) -> dict:
  mesh = make_mesh(spec, devices=devices_for(spec))
  graphdef, state, shardings = train_state.create(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)), tx, mesh)
  batch_sh = batch_sharding(mesh, (batch, seq))
  train_step, _ = make_steps(graphdef, tx, shardings, batch_sh)
  placed = [shard_batch(b, mesh) for b in batches]
  t = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = train_step.lower(state, *placed[0]).compile()
  return {"spec": spec, "mesh": mesh, "state": state, "step": compiled, "batches": placed, "times": [],
          "compile_s": time.perf_counter() - t, "audit": collectives(compiled)}


def moe(model: str = "moe_tiny", layouts: tuple[str, ...] = LAYOUTS, batch_size: int = 16, seq_len: int = 64,
        bias_rate: float | None = 1e-3, warmup: int = 2, rounds: int = 10, out: str | None = None) -> list[dict]:
  """Step time, tokens/s and collective bytes of one MoE train step per layout, against the analytic EP / TP bytes.

  Args:
    model: an MoE preset (models.PRESETS, e.g. moe_tiny).
    layouts: mesh specs (each uses the first prod(sizes) devices); a `stage` axis runs the GPipe pipeline.
    batch_size, seq_len: the global batch (the same for every layout).
    bias_rate: aux-loss-free balancing rate (DeepSeek-V3 selection bias, updated every step) set on the preset's
      MoE config; None keeps the preset's.
    warmup: untimed rounds after compilation.
    rounds: timed rounds; each runs one step of every layout in turn (median reported).
    out: also write the table (markdown) to this file.
  """
  t_start, load_start = time.perf_counter(), os.getloadavg()[0]
  setup_jax(8, True)  # the persistent compilation cache: a rerun skips the minutes of compiling
  mcfg = preset(model)
  if mcfg.moe is None:
    raise ConfigError(f"bench moe needs a mixture-of-experts preset (e.g. moe_tiny), got {model!r}")
  if bias_rate is not None:
    mcfg = dataclasses.replace(mcfg, moe=dataclasses.replace(mcfg.moe, bias_rate=bias_rate))
  for spec in layouts:  # a bad mesh fails before minutes of compiling
    make_mesh(spec, devices=devices_for(spec))
  optim = TrainConfig(model=model).optim
  tx, _ = make_optimizer(optim, warmup + rounds, optimizer_needs(optim))
  corpus = load_corpus()
  batches = [get_batch(corpus.train, 0, s, batch_size, seq_len) for s in range(warmup + rounds)]
  runs = []
  for spec in layouts:
    print(f"  compiling {spec} ...", file=sys.stderr, flush=True)
    runs.append(_prepare(spec, mcfg, tx, batch_size, seq_len, batches))
  for i in range(warmup + rounds):
    for run in runs:
      with jax.set_mesh(run["mesh"]):
        t = time.perf_counter()
        run["state"], metrics = run["step"](run["state"], *run["batches"][i])
        jax.block_until_ready((run["state"], metrics))
      if i >= warmup:
        run["times"].append(time.perf_counter() - t)
      run["loss"] = float(metrics["loss"])

  dev = jax.devices()[0]
  m = mcfg.moe
  lines = [f"`{model}`: {count_params(mcfg) / 1e6:.2f}M params, {mcfg.n_layers} blocks, D={mcfg.d_model}, "
           f"{m.num_experts} experts of width {m.d_expert or mcfg.d_ff}, top-{m.top_k}, "
           f"{'dropless' if m.capacity_factor is None else f'capacity factor {m.capacity_factor}'}, "
           f"aux-loss-free bias rate {m.bias_rate}; batch {batch_size} x {seq_len}, AdamW (research/train/ "
           f"make_steps), fp32; git {git_commit()}, jax {jax.__version__}, {dev.platform}, {jax.device_count()} "
           f"simulated devices on {os.cpu_count()} cores", "",
           "| layout | step ms (min-max) | tokens/s | loss | compile s | " + " | ".join(KINDS) +
           " | EP a2a over expert: measured / as run / ideal | TP all-reduce over tensor: measured / compiled / "
           "textbook |", "|" + "---|" * (7 + len(KINDS))]
  rows = []
  for run in runs:
    mesh, audit = run["mesh"], run["audit"]
    sizes = dict(mesh.shape)
    a = analytic(mcfg, sizes, batch_size, seq_len)
    step_s = statistics.median(run["times"])
    summary = audit.summary(fold_scatter=True)
    row = {"layout": mesh_spec(mesh), "step_s": step_s, "step_min_s": min(run["times"]),
           "step_max_s": max(run["times"]), "tokens_per_s": batch_size * seq_len / step_s, "loss": run["loss"],
           "compile_s": run["compile_s"], "bytes": {k: summary[k].wire_bytes for k in summary},
           "ep_measured": _by_axes(audit, mesh, "all-to-all", EXPERT),
           "tp_measured": _by_axes(audit, mesh, "all-reduce", TENSOR), **a}
    rows.append(row)
    cell = lambda kind: f"{summary[kind].count} / {summary[kind].wire_bytes / MIB:.3f}" if kind in summary else "–"
    ep = (f"{row['ep_measured'] / MIB:.3f} / {a['ep_as_run'] / MIB:.3f} / {a['ep_ideal'] / MIB:.3f}"
          if sizes.get(EXPERT, 1) > 1 else "–")
    tp = (f"{row['tp_measured'] / MIB:.3f} / {a['tp_compiled'] / MIB:.3f} / {a['tp_textbook'] / MIB:.3f}"
          if sizes.get(TENSOR, 1) > 1 else "–")
    lines.append(f"| {row['layout']} | {step_s * 1e3:.0f} ({row['step_min_s'] * 1e3:.0f}-{row['step_max_s'] * 1e3:.0f})"
                 f" | {row['tokens_per_s']:.0f} | {row['loss']:.4f} | {row['compile_s']:.0f} | "
                 + " | ".join(cell(k) for k in KINDS) + f" | {ep} | {tp} |")
  lines += ["", "Collective cells: `count / MiB` sent per device per step (ring wire bytes; XLA:CPU's all-reduce + "
            "dynamic-slice counted as reduce-scatter). EP / TP columns in MiB: the all-to-alls whose groups span only "
            "`expert`, the all-reduces whose groups span only `tensor`, next to the analytic counts of the module "
            "docstring of research/bench/moe.py (as run = fixed-capacity dropless buffers; compiled = per-projection "
            "backward all-reduces; ideal / textbook = exact-size all-to-all / Megatron's 4 per block). Loss: after "
            f"{warmup + rounds} steps on the same batches (dropless routing: layout-independent up to fp32 rounding).",
            f"step ms: median of {rounds} rounds after {warmup} warm-up rounds, layouts interleaved round-robin; "
            f"1-minute load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end; total wall time "
            f"{time.perf_counter() - t_start:.0f} s"]
  publish(lines, out)
  return rows
