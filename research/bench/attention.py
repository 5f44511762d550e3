"""`python -m research.bench attention`: what each attention implementation costs, alone and in the train step, and
what context parallelism saves in memory and sends over the wire.

Question: does the blockwise `flash` kernel (models/attention.py) beat XLA's materialized causal softmax (`xla`) on
this machine, in time and memory, alone and inside the real train step; and does context parallelism over C devices
(sharding/context.py: zig-zag layout, ring or all-gather attention) cut the per-device activation memory by C while
sending the K/V bytes its algorithm says it should?

All in one run, as ratios of numbers measured side by side:
1. Kernel. One causal attention forward + backward (`jax.vjp` of `models.attention.attend`, jit, one warm-up call,
   then the implementations' calls interleaved and the median of each reported) at the attention shape of a preset
   (default `base`: N = 12 query heads, K = 12 kv heads, head_dim H = 64), batch 1, fp32, one device: time, the
   compiled program's temp bytes (`memory_analysis().temp_size_in_bytes`), and the useful FLOP rate against the
   machine's fp32 matmul rate measured in the same run. Useful FLOPs count the causal triangle only:
       forward 2 matmuls (QKᵀ, PV) × T²/2 (query, key) pairs × N·H × 2 FLOPs = 2·B·T²·N·H,
       backward 2.5× the forward (scores recomputed, dV, dP, dQ, dK: 5 matmuls against 2), in all 7·B·T²·N·H.
   `xla` computes the whole T² square and masks it, so its useful rate is at most half its raw rate. Every
   implementation's output and gradients are compared with the first's (max |difference|).
2. Train step. The real step of research/train/ (AdamW, clipping, fp32), built and timed by
   `research.bench.timing.time_train_step` exactly as `python -m research.bench train` does, for one preset at one long
   sequence on one device with each attention: step time, tokens/s, model FLOP/s (`models.flops_per_token`, whose
   attention term 12·L·N·H·T per token ignores the causal half: the same numerator for every implementation) and MFU
   against the same matmul rate.
3. Memory against C. The train step of a small model at a long sequence compiled (not run) on `--mesh context=C`
   for each C and algorithm; per device: temp bytes (the activations kept for the backward and the intermediates:
   the activation memory, which context parallelism splits) and argument bytes (parameters, optimizer state and the
   batch: replicated over `context`, so constant in C), each against C = 1 and the ideal 1/C. At C = 1 both
   algorithms are `flash`; `xla` at C = 1 is shown for reference. With `sharding.context.balance` the causal work per
   device, max/mean, of the contiguous split and of zig-zag.
4. Communication. The collectives `sharding.collectives` reads from the same compiled steps, those of attention
   (inside its shard_map: the HLO metadata `op_name` of the instruction contains "shard_map"; "transpose(" marks the
   backward) split from the ones GSPMD adds around it, next to the analytic wire bytes per device per train step.
   With L layers, blk = B·(T/C)·K·H elements in one device's K (or V) block, b bytes per K/V element (the compute
   dtype), g = max(b, 4) bytes per gradient element (the kernels accumulate dK, dV in at least float32):
       ring       forward  L · 2(C−1) · blk·b              (C−1 hops of K and of V)
                  backward L · [2(C−1) · blk·b + 2C · blk·g]  (the ring again; dK, dV travel C hops, home included)
       allgather  forward  L · 2(C−1) · blk·b              (all-gather K and V: (C−1)/C of C·blk each)
                  backward L · [2(C−1) · blk·b + 2(C−1) · blk·g]  (all-gather again; reduce-scatter dK, dV)
   Bytes are the audit's ring wire bytes (a collective-permute sends its operand). GSPMD's own collectives are the
   zig-zag reorders (`to_zigzag` / `from_zigzag` and their transposes: collective-permutes and all-to-alls) and the
   gradient all-reduce over `context` of the replicated parameters (textbook 2·(C−1)/C · P · 4 bytes, plus the same
   for the V·D table once more when the embedding is tied: its head and lookup gradients are all-reduced apart).

On the CPU the C devices are simulated (`jax_num_cpu_devices`) and share the machine's cores: sections 3 and 4 are
read from compiled programs, which are what the same step runs and sends on accelerators.
"""

from __future__ import annotations

import inspect
import os
import re
import statistics
import sys
import time
from typing import Annotated

import jax
import jax.numpy as jnp

from models import count_params, preset
from models.attention import IMPLEMENTATIONS, attend, check_attention
from research import flags
from research.bench.report import Progress, git_commit, machine, table
from research.bench.timing import build_train_step, time_train_step
from research.data import load_corpus
from research.train.hooks.throughput import measure_matmul_flops
from research.train.runtime.devices import setup_jax
from sharding import collectives
from sharding.audit import Audit
from sharding.context import ALGORITHMS, balance

MIB, GIB = 2 ** 20, 2 ** 30
MATMUL_TRIALS = 5
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%?(\S+) = .*?\bop_name="([^"]*)"', re.M)


def attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
  """Useful FLOPs of one causal attention forward + backward: 7·B·T²·N·H (module docstring)."""
  return 3.5 * 2.0 * batch * seq * seq * heads * head_dim


def analytic_bytes(mcfg, algorithm: str, context: int, batch: int, seq: int) -> dict[str, float]:
  """Wire bytes per device per train step of the context-parallel attention of every layer, {"fwd", "bwd", "total"}
  (module docstring); a mesh of `context` only (the batch not split)."""
  C, L = context, mcfg.n_layers
  if C == 1:
    return {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
  blk = batch * (seq // C) * mcfg.kv_heads * mcfg.hd
  b = jnp.dtype(mcfg.compute_dtype).itemsize
  fwd = L * 2 * (C - 1) * blk * b
  grads = 2 * (C if algorithm == "ring" else C - 1) * blk * max(b, 4)
  bwd = L * (2 * (C - 1) * blk * b + grads)
  return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}


def _budget(gib: float | None) -> float:
  """Bytes a program may need to be run: `gib`, or 3/4 of the memory available now (other jobs share the machine)."""
  if gib is not None:
    return gib * GIB
  try:
    with open("/proc/meminfo") as f:
      avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration):
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  return 0.75 * avail


def _matmul_rate(n: int) -> float:
  # median of several samples: on a shared VM one timing varies by up to +-25% (research/bench.py)
  return statistics.median(measure_matmul_flops(n, repeats=5) for _ in range(MATMUL_TRIALS))


def _kernel(model: str, seqs, batch: int, impls, repeats: int, budget_gib, say) -> list[dict]:
  """Section 1: per T and implementation, fwd+bwd time, temp bytes and the max difference from impls[0]."""
  cfg = preset(model)
  N, K, H = cfg.n_heads, cfg.kv_heads, cfg.hd
  rows = []
  for T in seqs:
    keys = jax.random.split(jax.random.key(T), 4)
    q, do = (jax.random.normal(keys[i], (batch, T, N, H), jnp.float32) for i in (0, 3))
    k, v = (jax.random.normal(keys[i], (batch, T, K, H), jnp.float32) for i in (1, 2))
    programs, group = {}, []
    for impl in impls:
      def fwd_bwd(q, k, v, do, impl=impl):
        o, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, impl=impl), q, k, v)
        return o, *vjp(do)
      say(f"  kernel T={T} {impl}: compiling")
      compiled = jax.jit(fwd_bwd).lower(q, k, v, do).compile()
      mem = compiled.memory_analysis()
      row = {"seq": T, "impl": impl, "temp_bytes": mem.temp_size_in_bytes, "flops": attention_flops(batch, T, N, H)}
      need, budget = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes, _budget(budget_gib)
      if need > budget:
        row["skipped"] = f"not run: needs {need / GIB:.2f} GiB > budget {budget / GIB:.2f} GiB"
      else:
        programs[impl] = compiled
      group.append(row)
    outs = {impl: jax.block_until_ready(c(q, k, v, do)) for impl, c in programs.items()}  # the warm-up calls
    times = {impl: [] for impl in programs}
    for i in range(repeats):  # interleaved: load from other jobs hits every implementation alike
      for impl, c in programs.items():
        say(f"  kernel T={T} {impl}: call {i + 1}/{repeats}")
        t = time.perf_counter()
        jax.block_until_ready(c(q, k, v, do))
        times[impl].append(time.perf_counter() - t)
    for row in group:
      if row["impl"] in times:
        ts = times[row["impl"]]
        row.update(time_s=statistics.median(ts), time_min_s=min(ts), time_max_s=max(ts))
      if row["impl"] in outs and impls[0] in outs:
        row["max_diff"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(outs[row["impl"]], outs[impls[0]]))
    rows += group
    del outs
  return rows


def _train(model: str, seq: int, batch: int, impls, warmup: int, steps: int, budget_gib, say) -> list[dict]:
  """Section 2: the train step on one device per attention implementation."""
  corpus = load_corpus()
  rows = []
  for impl in impls:
    check_attention(impl, seq)
    say(f"  train {model} {batch}x{seq} attention={impl}")
    rows.append({"impl": impl, **time_train_step(model, "data=1", batch, seq, warmup, steps, corpus,
                                                  max_bytes=_budget(budget_gib), attention=impl)})
  return rows


def _context(model: str, layers: int | None, seq: int, batch: int, contexts, algorithms, reference, say) -> list[dict]:
  """Sections 3 and 4: the train step compiled on `context=C` per algorithm (and `reference` at C = 1); memory and
  collectives."""
  cases = ([(reference, 1)] if reference else []) + ([("flash", 1)] if 1 in contexts else [])
  cases += [(a, C) for a in algorithms for C in contexts if C > 1]
  flags = {"n_layers": layers} if layers else {}
  rows = []
  for impl, C in cases:
    check_attention(impl, seq, C)
    say(f"  context={C} attention={impl}: compiling")
    built = build_train_step(model, f"context={C}", batch, seq, attention=impl, **flags)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=built.batch_sh)
    t = time.perf_counter()
    with jax.set_mesh(built.mesh):
      compiled = built.step.lower(built.state, tokens, tokens).compile()
    mem = compiled.memory_analysis()
    names = {m.group(1): m.group(2) for m in _OP_NAME.finditer(compiled.as_text())}
    rows.append({"impl": impl, "context": C, "mcfg": built.mcfg, "compile_s": time.perf_counter() - t,
                 "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
                 "audit": collectives(compiled), "op_names": names})
    del built, compiled
  return rows


def _split(row) -> dict:
  """The row's collectives in three parts: attention's (inside its shard_map; forward and backward wire bytes), the
  parameter-gradient all-reduces GSPMD adds (over the whole `context` group: the parameters are replicated over it)
  and GSPMD's other collectives (the zig-zag reorders and their transposes)."""
  names, ops, n = row["op_names"], row["audit"].ops, row["audit"].num_devices
  wire = lambda sel: sum(op.count * op.wire_bytes for op in sel)
  mine = [op for op in ops if "shard_map" in names.get(op.name, "")]
  bwd = [op for op in mine if "transpose(" in names.get(op.name, "")]
  grads = [op for op in ops if op not in mine and op.kind == "all-reduce" and op.group_size == row["context"]]
  return {"attention": Audit(tuple(mine), n), "fwd": wire([op for op in mine if op not in bwd]), "bwd": wire(bwd),
          "grad_bytes": wire(grads), "layout": Audit(tuple(op for op in ops if op not in mine + grads), n)}


def _cells(audit: Audit) -> str:
  s = audit.summary()
  return ", ".join(f"{k} {s[k].count} / {s[k].wire_bytes / MIB:.2f}" for k in KINDS if k in s) or "–"


def attention(kernel_model: str = "base", kernel_seqs: tuple[int, ...] = (512, 2048, 8192), kernel_batch: int = 1,
              impls: Annotated[tuple[str, ...], flags.one_of(*IMPLEMENTATIONS)] = ("xla", "flash"), repeats: int = 5,
              train_model: str = "base",
              train_seq: int | None = 2048, train_batch: int = 1, warmup: int = 1, steps: int = 3,
              context_model: str = "small", context_layers: int | None = None, context_seq: int = 8192,
              context_batch: int = 1, contexts: tuple[int, ...] = (1, 2, 4, 8),
              algorithms: Annotated[tuple[str, ...], flags.one_of(*ALGORITHMS)] = ALGORITHMS,
              context_reference: Annotated[str | None, flags.one_of(*IMPLEMENTATIONS)] = "xla", matmul_n: int = 2048,
              memory_budget_gib: float | None = None, out: str | None = None) -> dict:
  """Attention implementations side by side (kernel and train step) and context parallelism's memory and traffic.

  Sections and conventions: the module docstring. An empty `kernel_seqs`, `train_seq` None or an empty `contexts`
  skips that section.

  Args:
    kernel_model: preset whose attention shape (heads, kv heads, head_dim) the kernel section uses.
    kernel_seqs: sequence lengths of the kernel section (flash needs a multiple of its 512 block, or fewer).
    kernel_batch: batch of the kernel section.
    impls: implementations compared in sections 1 and 2; the first is the reference of the ratios and differences.
    repeats: timed kernel calls per implementation after one warm-up call (median reported).
    train_model: preset of the train step of section 2 (one device).
    train_seq: its sequence length; None skips section 2.
    train_batch: its batch.
    warmup: untimed train steps after compiling.
    steps: timed train steps (median reported).
    context_model: preset of sections 3 and 4.
    context_layers: its number of layers (None: the preset's).
    context_seq: its sequence length (a multiple of 2·C and, at C = 1, of 512 or at most 512).
    context_batch: its batch.
    contexts: sizes C of the `context` mesh axis (C = 1 is the baseline of the memory ratios).
    algorithms: context-parallel attentions (sharding/context.py).
    context_reference: a single-device attention whose C = 1 step sections 3 and 4 also show (None: none).
    matmul_n: size of the reference fp32 matmul (MFU and the kernels' share of the matmul rate).
    memory_budget_gib: do not run a program (kernel or train step) needing more; default 3/4 of the memory
      available when it is about to run (compiled temp + argument + output bytes).
    out: also write the tables (markdown) to this file.
  """
  args = dict(locals())
  t_start, load_start = time.perf_counter(), os.getloadavg()[0]
  setup_jax(8, True)  # the persistent compilation cache: a rerun skips the compiling
  for impl in impls:  # bad input fails in one line before minutes of measuring
    for T in tuple(kernel_seqs) + ((train_seq,) if train_seq else ()):
      check_attention(impl, T)
  for C in contexts:
    for a in algorithms:
      check_attention(a, context_seq, C)
  if context_reference:
    check_attention(context_reference, context_seq)
  for name in (kernel_model, train_model, context_model):
    preset(name)

  say = lambda msg: print(msg, file=sys.stderr, flush=True)
  report = Progress(_command(args), out)
  lines, emit = report.lines, report.emit  # each finished section at once, and the file so far

  rate = _matmul_rate(matmul_n)
  lines += [f"{machine()} on {os.cpu_count()} cores; git {git_commit()}; fp32; {matmul_n}³ fp32 matmul on device 0: "
            f"{rate / 1e9:.1f} GFLOP/s (median of {MATMUL_TRIALS}, the denominator of every rate below)", ""]
  emit()
  result = {"matmul_flops": rate, "kernel": [], "train": [], "context": [], "balance": []}

  if kernel_seqs:
    c = preset(kernel_model)
    result["kernel"] = rows = _kernel(kernel_model, kernel_seqs, kernel_batch, impls, repeats, memory_budget_gib, say)
    ref = {r["seq"]: r for r in rows if r["impl"] == impls[0]}
    ratio = lambda r, key: f"{r[key] / ref[r['seq']][key]:.2f}" if key in r and key in ref[r["seq"]] else "–"
    lines += [f"### 1. Attention alone: causal fwd+bwd, `{kernel_model}` shape (N={c.n_heads} heads, K={c.kv_heads} "
              f"kv heads, H={c.hd}), batch {kernel_batch}, fp32, one device", ""]
    lines += table(["T", "attention", "fwd+bwd ms (min-max)", f"time / {impls[0]}", "temp MiB", f"temp / {impls[0]}",
                    "useful GFLOP/s", "of matmul rate", f"max abs diff vs {impls[0]}"], [[
        str(r["seq"]), r["impl"],
        f"{r['time_s'] * 1e3:.0f} ({r['time_min_s'] * 1e3:.0f}-{r['time_max_s'] * 1e3:.0f})" if "time_s" in r
        else r["skipped"], ratio(r, "time_s"), f"{r['temp_bytes'] / MIB:.0f}", ratio(r, "temp_bytes"),
        f"{r['flops'] / r['time_s'] / 1e9:.1f}" if "time_s" in r else "–",
        f"{r['flops'] / r['time_s'] / rate:.1%}" if "time_s" in r else "–",
        f"{r['max_diff']:.1e}" if "max_diff" in r else "–"] for r in rows])
    lines += ["", f"Useful FLOPs: the causal triangle, 7·B·T²·N·H (forward QKᵀ and PV, 2 FLOPs per multiply-add over "
              f"T²/2 pairs: 2·B·T²·N·H; backward 2.5× that). Time: median of {repeats} calls after a warm-up call, "
              f"the implementations interleaved. Temp: the compiled program's `temp_size_in_bytes`.", ""]
    emit()

  if train_seq:
    result["train"] = rows = _train(train_model, train_seq, train_batch, impls, warmup, steps, memory_budget_gib, say)
    ref = rows[0]
    ratio = lambda r, key: f"{r[key] / ref[key]:.2f}" if key in r and key in ref else "–"
    lines += [f"### 2. Train step: `{train_model}` ({rows[0]['params'] / 1e6:.1f}M params), batch {train_batch} x "
              f"{train_seq}, one device (research/train/steps/step.py make_steps: AdamW, clipping, fp32)", ""]
    lines += table(["attention", "step ms (min-max)", f"step / {impls[0]}", "tokens/s", "model GFLOP/s", "MFU",
                    "temp GiB", f"temp / {impls[0]}", "loss"], [[
        r["impl"], f"{r['step_s'] * 1e3:.0f} ({r['step_min_s'] * 1e3:.0f}-{r['step_max_s'] * 1e3:.0f})"
        if "step_s" in r else r["skipped"], ratio(r, "step_s"),
        *([f"{r['tokens_per_s']:.0f}", f"{r['model_flops'] / 1e9:.1f}", f"{r['model_flops'] / rate:.1%}"]
          if "step_s" in r else ["–"] * 3),
        f"{r['temp_bytes'] / GIB:.2f}", ratio(r, "temp_bytes"), f"{r['loss']:.4f}" if "loss" in r else "–"]
        for r in rows])
    lines += ["", f"step ms: median of {steps} steps after {warmup} warm-up steps on the same batches for every "
              f"attention (so the losses agree up to fp32 rounding); model FLOPs: `models.flops_per_token` (attention "
              f"counted as 12·L·N·H·T per token, no causal halving, the same for every implementation).", ""]
    emit()

  if contexts:
    result["context"] = rows = _context(context_model, context_layers, context_seq, context_batch, contexts,
                                        algorithms, context_reference, say)
    m = rows[0]["mcfg"]
    base = next((r for r in rows if r["impl"] == "flash"), rows[0])
    lines += [f"### 3. Memory per device against C: `{context_model}` ({m.n_layers} layers, D={m.d_model}, "
              f"N={m.n_heads}, K={m.kv_heads}, H={m.hd}), batch {context_batch} x {context_seq}, train step "
              f"compiled on `--mesh context=C`", ""]
    at = f"{base['impl']} C={base['context']}"
    lines += table(["attention", "C", "T per device", "temp MiB (activations)", f"temp / {at}", "ideal 1/C",
                    "argument MiB (state + batch)", f"temp + argument / {at}", "compile s"], [[
        r["impl"], str(r["context"]), str(context_seq // r["context"]), f"{r['temp_bytes'] / MIB:.0f}",
        f"{r['temp_bytes'] / base['temp_bytes']:.3f}", f"{1 / r['context']:.3f}", f"{r['argument_bytes'] / MIB:.1f}",
        f"{(r['temp_bytes'] + r['argument_bytes']) / (base['temp_bytes'] + base['argument_bytes']):.3f}",
        f"{r['compile_s']:.0f}"] for r in rows])
    result["balance"] = bal = [{"context": C, **balance(context_seq, C)} for C in contexts]
    lines += ["", "At C = 1 ring and allgather are `flash` (one device has the whole sequence)"
              + (f"; `{context_reference}` at C = 1 for reference" if context_reference else "")
              + ". Temp is what context parallelism splits; the arguments are replicated over `context`. compile s: "
              "`.lower(...).compile()` wall time (a rerun loads the program from the persistent compilation cache).",
              "",
              f"Causal work per device (`sharding.context.balance({context_seq}, C)`): the (query, key) pairs under "
              f"the mask each device owns, max / mean (1 = balanced), and what the zig-zag kernel computes (three of "
              f"its own block's four half-chunk pairs, then two per step) per device over the mean pairs:", ""]
    lines += table(["C", "contiguous max/mean", "zig-zag max/mean", "zig-zag computed / mean pairs"], [[
        str(b["context"]), f"{b['contiguous_max_over_mean']:.3f}", f"{b['zigzag_max_over_mean']:.3f}",
        f"{b['zigzag_computed'][0] / (sum(b['zigzag']) / b['context']):.3f}" if b["context"] > 1 else "–"]
        for b in bal])
    lines.append("")

    comm = []
    for r in rows:
      if r["context"] > 1:
        r.update(_split(r), analytic=analytic_bytes(r["mcfg"], r["impl"], r["context"], context_batch, context_seq))
        comm.append(r)
    if comm:
      P, VD, pb = count_params(m), m.vocab_size * m.d_model, jnp.dtype(m.param_dtype).itemsize
      tied = VD if m.tie_embeddings else 0
      grad_ar = lambda C, n: 2 * (C - 1) / C * n * pb / MIB
      lines += ["### 4. Communication per device per train step (MiB; collective cells `kind count / MiB`)", ""]
      lines += table(["attention", "C", "attention's collectives (in its shard_map)", "measured fwd / bwd",
                      "analytic fwd / bwd", "measured / analytic", "GSPMD: zig-zag reorders",
                      "GSPMD: grad all-reduce measured / 2r·P·b / 2r·(P+V·D)·b"], [[
          r["impl"], str(r["context"]), _cells(r["attention"]), f"{r['fwd'] / MIB:.2f} / {r['bwd'] / MIB:.2f}",
          f"{r['analytic']['fwd'] / MIB:.2f} / {r['analytic']['bwd'] / MIB:.2f}",
          f"{(r['fwd'] + r['bwd']) / r['analytic']['total']:.3f}", _cells(r["layout"]),
          f"{r['grad_bytes'] / MIB:.2f} / {grad_ar(r['context'], P):.2f} / {grad_ar(r['context'], P + tied):.2f}"]
          for r in comm])
      blk = context_batch * m.kv_heads * m.hd
      looped = sum(op.in_loop for r in comm for op in r["attention"].ops)
      total = sum(len(r["attention"].ops) for r in comm)
      lines += ["", f"Analytic (module docstring), blk = B·(T/C)·K·H = {blk}·T/C elements, b = "
                f"{jnp.dtype(m.compute_dtype).itemsize} bytes, L = {m.n_layers}: ring fwd L·2(C−1)·blk·b, bwd "
                f"L·[2(C−1)·blk·b + 2C·blk·g]; allgather fwd L·2(C−1)·blk·b, bwd L·[2(C−1)·blk·b + 2(C−1)·blk·g], "
                f"g = max(b, 4). "
                f"Attention's collectives: HLO `op_name` inside the shard_map; backward: under `transpose(`. The rest "
                f"are GSPMD's, not attention's: the all-reduces over the whole `context` group are the parameter "
                f"gradients (replicated parameters; textbook 2·r(C)·P·b, r(C) = (C−1)/C, P = {P}, b = {pb}"
                + (f"; a tied embedding's two gradient parts, head and lookup, are all-reduced before they are summed, "
                   f"which adds 2·r(C)·V·D·b, V·D = {VD}" if tied else "")
                + "); the others (collective-permutes, all-to-alls and pairwise all-reduces) move tokens and hidden "
                f"states for the zig-zag reorders (`to_zigzag` at the input, `from_zigzag` before the head) and their "
                f"transposes. "
                f"{looped} of {total} of attention's collective instructions sit in a while loop: the layer scan "
                f"(counted once per layer), as tensor and expert parallelism's per-layer collectives do; the ring's "
                f"own steps are unrolled.", ""]
    emit()

  rate_end = _matmul_rate(matmul_n)
  lines.append(f"Matmul re-measured at the end: {rate_end / 1e9:.1f} GFLOP/s (a drift from the start means other "
               f"jobs took the cores); 1-minute load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at "
               f"end; total wall time {time.perf_counter() - t_start:.0f} s")
  emit()
  result["matmul_flops_end"] = rate_end
  return result


def _command(args: dict) -> str:
  """The command line that reproduces a call with these arguments (the ones that differ from the defaults)."""
  params = inspect.signature(attention).parameters
  parts = ["python -m research.bench attention"]
  for name, value in args.items():
    if value == params[name].default:
      continue
    flag = "--" + name.replace("_", "-")
    if isinstance(value, tuple):
      parts.append(" ".join([flag, *map(str, value)]))
    else:
      parts.append(f"{flag} {value}")
  return " ".join(parts)
