"""`python -m research.bench finetune`: the memory and FLOPs of every fine-tuning method's train step, side by side.

Question: what does each way of fine-tuning cost per step against AdamW full fine-tuning of the same model and batch,
in state bytes per parameter, in activation / intermediate bytes, and in FLOPs?

For each model shape and method the trainer's own pieces build the train state and the train step exactly as
`research.train` does (`build.make_optimizer`, `state.initial_state` — random base, no --init-from —,
`setup.blockwise.blockwise_parts`, `setup.run.train_programs`: the blockwise, --freeze-layers or plain step), but
abstractly: the state is `state.abstract_initial_state` (`jax.eval_shape` of the state's construction: a 3B model's
AdamW state is never allocated), and the step is `jit(...).lower(abstract state, x, y).compile()`d. From the compiled
program:

  XLA FLOPs        `compiled.cost_analysis()["flops"]`, XLA's static count, and its ratio to AdamW's. It counts a
                   while loop's body ONCE (measured: tiny's AdamW step gives 52.2M FLOPs at 2 layers, 54.3M at 4),
                   and the layers are one scan, so it misses (L − 1) layers of work: not a step cost;
  matmul FLOPs     the step's matrix-product FLOPs counted in its jaxpr (`matmul_flops`: 2·|out|·|contracted| per
                   dot_general, scan bodies times their length): the step's real work up to elementwise ops. For
                   AdamW it equals `models.flops_per_token` · tokens exactly (checked at tiny, 2 and 4 layers);
  argument bytes   `memory_analysis().argument_size_in_bytes`: the train state + the (B, T) int32 batch;
  temp bytes       activations kept for the backward, gradients and other intermediates;
  output bytes     the new state + metrics; the state is donated, so `alias` of them reuse the arguments' buffers;
  peak estimate    argument + temp + output − alias bytes: the per-device number the trainer's memory pre-flight
                   (research/train/setup/memory.py) checks every run against, beside the measured RSS where it is run;
  state B/param    the abstract state's bytes / the model's parameter count (`models.count_params`). Anchors: AdamW
                   with float32 parameters 4 + 8 (moments) = 12 (its gradients are temp), LoRA ≤ 2.3, BAdam ≤ 3.0,
                   BREAD ≤ 3.5 (the last three with a bfloat16 base).
For the shapes in `rss_shapes` each method also runs for real in a fresh child process (one CPU device): peak RSS
(`ru_maxrss`) minus the RSS just before the state is built (JAX and the code already imported and started), over
building the state, compiling the step and running 2 steps: the host memory the method needs here.

Methods (rows):
  adamw    full fine-tuning, AdamW, float32 parameters and moments.
  freeze   AdamW with --freeze 'blocks/(wq_DQ|wk_DK|wv_DK|wo_QD)|embed' (attention projections and the embedding
           table, tied to the head in `base` / `llama-3b`) and --frozen-dtype bfloat16 (fine-tuning's default).
  freeze-half  AdamW with --freeze-layers L/2 (research/train/steps/layerfreeze.py): the bottom half of the layers and
           the embedding frozen in bfloat16, the backward stopping at layer L/2; the top half trains on a float32
           master.
  lora, dora, prediag, sora   --peft METHOD, rank `rank`, base weights bfloat16 (`PeftFlags(base_dtype="bfloat16")`).
  badam    --optimizer badam run by the blockwise step (`research.train.steps.blockstep`), storage bfloat16. Its layer
           scans are cond-masked (only the layers below / above the active one run): a static count takes each
           cond's costly branch, i.e. every layer run, and over-counts. The row "badam (per block)" counts the same
           step split statically at block b (`blockstep.make_block_steps(..., static_block=b)`: one trace per b)
           for `badam_blocks` evenly spaced blocks (first and last included), averaged: the cost over a block cycle
           (the per-block cost is linear in b, so first/middle/last average to the cycle's mean).
  muon, sparse_adapter   full fine-tuning with Muon; the SNIP-pruned sparse adapter (as the PEFT rows): measured
           on request (`methods`), not in the default table.
  bread    --optimizer bread (low-rank mode, rank 8): the blockwise step (`models.blockwise.backprop_to_layer`), storage
           bfloat16; the layers above the active one move through their factors' AdamW steps in the same backward.
  bread-sgd  --optimizer bread --opt mode="sgd": the same step, the layers above taking SGD steps. Both backwards are a
           loop from the top layer down to the active one b, trip count L − 1 − b, known at run time only: counted at
           the cycle's mean (L − 1)/2 (the cost is linear in the trips).

Shapes: `base` (the preset, byte vocabulary 256, tied), `llama-1b` (TinyLlama-1.1B: d 2048, 22 layers, 32 heads / 4
KV, d_ff 5632, vocab 32000, untied), `llama-3b` (Llama-3.2-3B: d 3072, 28 layers, 24 heads / 8 KV, d_ff 8192, vocab
128256, tied embeddings as in its config.json). Compute dtype float32 unless --compute-dtype says otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import resource
import subprocess
import sys
import time
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np

from models import TransformerConfig, count_params, preset
from models.peft import ADAPTERS
from research import flags
from research.bench.report import Progress, call_command, machine, table
from research.bench.timing import trainer_optimizer, trainer_plan
from research.data import Corpus
from research.train.config import PeftFlags, TrainConfig
from research.train.feed import make_loader
from research.train.setup import memory
from research.train.setup.blockwise import blockwise_parts
from research.train.setup.initial_state import abstract_initial_state, initial_state
from research.train.setup.run import train_programs
from research.train.steps import blockstep, frozen
from sharding import batch_sharding, devices_for, make_mesh

PEFT = tuple(ADAPTERS)  # every registered method (models/peft.py): each a measurable row
# the default table's rows (the recorded one's); every PEFT method and the rows below are measured on request
METHODS = ("adamw", "freeze", "freeze-half", "lora", "dora", "prediag", "sora", "badam", "bread", "bread-sgd")
KNOWN = METHODS + tuple(m for m in PEFT if m not in METHODS) + ("muon", "bread-sgd-f32")
# run by the blockwise step (research/train/steps/blockstep.py)
BLOCKWISE = ("badam", "bread", "bread-sgd", "bread-sgd-f32")
LAYER_LOOP = BLOCKWISE[1:]  # BREAD's: a backward written as a loop over the layers above the active one
FREEZE = r"blocks/(wq_DQ|wk_DK|wv_DK|wo_QD)|embed"
MESH = "data=1"
MIB = 2 ** 20
TRAINS = {"adamw": "all weights", "freeze": "all but attn q/k/v/o + embedding (frozen bf16)",
          "freeze-half": "the top half of the layers + final norm (--freeze-layers L/2, frozen bf16)",
          "badam": "1 layer per step (blockwise step, bf16 storage)",
          "bread": "1 layer by AdamW + rank-8 factors on the layers above (blockwise step, bf16 storage)",
          "bread-sgd": "1 layer by AdamW + SGD on the layers above (blockwise step, bf16 storage)",
          "muon": "all weights (Muon)"}


SHAPE = flags.Rule(choices=lambda: (*flags.presets(), "llama-1b", "llama-3b"))  # a preset or a Llama shape
SOME_SHAPES = dataclasses.replace(SHAPE, empty=True)  # --rss-shapes: none is a choice


def shape(name: str) -> TransformerConfig:
  """The model config of a shape name: a preset, or `llama-1b` / `llama-3b` (module docstring)."""
  if name == "llama-1b":
    return TransformerConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632,
                             tie_embeddings=False, norm_eps=1e-5)
  if name == "llama-3b":
    return TransformerConfig(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, d_ff=8192,
                             tie_embeddings=True, norm_eps=1e-5, rope_theta=500_000.0)
  return preset(name)


def train_config(method: str, mcfg: TransformerConfig, batch_size: int, seq_len: int, rank: int,
                 peft: PeftFlags | None = None, opt: tuple[str, ...] = ()) -> TrainConfig:
  """The trainer's flags for `method` (the model fields are overridden by `mcfg` where it matters); `peft`: the
  adapters' flags (default: rank `rank`, bfloat16 base); `opt`: more --opt KEY=VALUE items."""
  flags = {"freeze": {"freeze": FREEZE, "frozen_dtype": "bfloat16"},
           "freeze-half": {"freeze_layers": mcfg.n_layers // 2, "frozen_dtype": "bfloat16"},
           "badam": {"optimizer": "badam", "frozen_dtype": "bfloat16"},
           "bread": {"optimizer": "bread", "frozen_dtype": "bfloat16"},
           "muon": {"optimizer": "muon"},
           "bread-sgd": {"optimizer": "bread", "opt": ('mode="sgd"',), "frozen_dtype": "bfloat16"},
           "bread-sgd-f32": {"optimizer": "bread", "opt": ('mode="sgd"',), "frozen_dtype": "float32"}}.get(method, {})
  if method in PEFT:
    flags = {"peft": method, "peft_options": peft or PeftFlags(rank=rank, base_dtype="bfloat16")}
  flags["opt"] = flags.get("opt", ()) + tuple(opt)
  return TrainConfig(model="base", batch_size=batch_size, seq_len=seq_len, mesh=MESH, devices=1, steps=1000,
                     optimizer=flags.pop("optimizer", "adamw"), **flags)


def build(method: str, mcfg, batch_size: int, seq_len: int, rank: int, abstract: bool = True,
          static_block: int | None = None, peft: PeftFlags | None = None, opt: tuple[str, ...] = ()):
  """(state, train_step, batch sharding, mesh) of `method` as research/train/loop.py builds them; `abstract`: the
  state as ShapeDtypeStructs with their shardings (`state.abstract_initial_state`), nothing allocated;
  `static_block`: the blockwise BAdam step split at that block in the program (`make_block_steps`)."""
  cfg = train_config(method, mcfg, batch_size, seq_len, rank, peft, opt)
  plan = trainer_plan(cfg, mcfg, make_mesh(MESH, devices=devices_for(MESH)))
  mesh = plan.mesh
  tx, schedule = trainer_optimizer(cfg)
  plain = trainer_optimizer(cfg, freeze=False)[0] if plan.trains.freeze else None
  tokens = np.arange(4 * batch_size * (seq_len + 1)) % mcfg.vocab_size  # SNIP's batch
  loader = make_loader(Corpus(tokens, tokens, mcfg.vocab_size, "synthetic", "synthetic"), cfg.training, cfg.data,
                       cfg.data_options)
  with contextlib.redirect_stderr(io.StringIO()):  # blockwise_parts' note on a non-eligible config, the reports
    parts = blockwise_parts(plan, schedule, cfg.optim.grad_clip)
    graphdef, state, shardings, _ = abstract_initial_state(plan, tx, plain, parts, loader, cfg.peft_options)
    if not abstract:
      state = initial_state(plan, tx, plain, parts, shardings, loader, cfg.peft_options)[0]
  batch_sh = batch_sharding(mesh, (batch_size, seq_len))
  step = (blockstep.make_block_steps(graphdef, parts, shardings, batch_sh, static_block)[0] if parts else
          train_programs(plan, graphdef, tx, parts, shardings, batch_sh)[0])
  return state, step, batch_sh, mesh


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def matmul_flops(jaxpr, while_trips: float = 1.0) -> float:
  """FLOPs of the matrix products of a jaxpr: 2 · |output| · |contracted dims| per dot_general, a scan body's times its
  length, a cond's costliest branch (the executed one for BAdam's masked layer scans is not known statically: this
  counts every layer as run), a while body `while_trips` times; every nested jaxpr (jit, remat, custom rules)
  included."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
      (contract, _), _ = params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in contract])
    elif name == "scan":
      total += params["length"] * matmul_flops(params["jaxpr"].jaxpr, while_trips)
    elif name == "cond":
      total += max(matmul_flops(b.jaxpr, while_trips) for b in params["branches"])
    elif name == "while":
      total += while_trips * matmul_flops(params["body_jaxpr"].jaxpr, while_trips)
    else:
      for v in params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            total += matmul_flops(inner, while_trips)
  return total


def _traced_flops(step, state, batch_sh, mesh, batch_size: int, seq_len: int, while_trips: float = 1.0) -> float:
  x = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sh)
  with jax.set_mesh(mesh):
    return matmul_flops(step.trace(state, x, x).jaxpr.jaxpr, while_trips)  # the step's own jaxpr (a jit with compiler
    # options cannot be traced inside another transformation, as make_jaxpr would)


def _bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _trainable(method: str, state) -> int:
  """Weights the step can change: the adapters (PEFT), the active layer (BAdam), the unfrozen leaves (--freeze)."""
  if method in PEFT:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  if method in BLOCKWISE or method == "freeze-half":  # BREAD's steps reach every layer above (no state but the
    # factors): counted as BAdam's; --freeze-layers trains its master
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.master))
  mask = frozen.frozen_mask(FREEZE if method == "freeze" else None)
  flags = jax.tree.leaves(mask(state.params)) if mask else [False] * len(jax.tree.leaves(state.params))
  return sum(int(np.prod(x.shape)) for x, f in zip(jax.tree.leaves(state.params), flags) if not f)


def measure(method: str, mcfg, batch_size: int, seq_len: int, rank: int, peft: PeftFlags | None = None) -> dict:
  """The compiled step's FLOPs and bytes and the state's bytes of `method` (see the module docstring)."""
  t = time.perf_counter()
  state, step, batch_sh, mesh = build(method, mcfg, batch_size, seq_len, rank, peft=peft)
  compiled = memory.compile_step(step, state, (batch_size, seq_len), batch_sh, mesh)
  mem = memory.StepBytes.of(compiled)  # the trainer's memory pre-flight reads the same four numbers
  trips = (mcfg.n_layers - 1) / 2 if method in LAYER_LOOP else 1.0  # BREAD's layer loop, its cycle mean
  return {"method": method, "flops": _flops(compiled), "matmul_flops": _traced_flops(step, state, batch_sh, mesh,
                                                                                   batch_size, seq_len, trips),
          "state_bytes": _bytes(state), "trainable": _trainable(method, state), **dataclasses.asdict(mem),
          "compile_s": time.perf_counter() - t}


def badam_block_flops(mcfg, batch_size: int, seq_len: int, rank: int, n_blocks: int) -> dict:
  """The blockwise BAdam step's matmul FLOPs with the layer split static (`active_layer_forward(..., static_split=True)`
  at block b, one trace per b) for `n_blocks` evenly spaced blocks (all when L ≤ n_blocks), and their mean."""
  L = mcfg.n_layers
  blocks = list(range(L)) if L <= n_blocks else sorted({round(i * (L - 1) / (n_blocks - 1)) for i in range(n_blocks)})
  flops = []
  for b in blocks:
    state, step, batch_sh, mesh = build("badam", mcfg, batch_size, seq_len, rank, static_block=b)
    flops.append(_traced_flops(step, state, batch_sh, mesh, batch_size, seq_len))
  return {"blocks": blocks, "flops": flops, "mean": float(np.mean(flops))}


def step_seconds(method: str, mcfg, batch_size: int, seq_len: int, rank: int, steps: int,
                 peft: PeftFlags | None = None, opt: tuple[str, ...] = ()) -> float:
  """Mean wall seconds per call of `method`'s train step on a real state (one device, random tokens), over `steps`
  calls after 2 warm-up calls (compilation): for BAdam / BREAD-SGD give steps = layers x switch_every (in `opt`) to
  average one block cycle, as a run does."""
  state, step, batch_sh, mesh = build(method, mcfg, batch_size, seq_len, rank, abstract=False, peft=peft, opt=opt)
  rng = np.random.default_rng(0)
  batches = [tuple(jax.device_put(rng.integers(0, mcfg.vocab_size, (batch_size, seq_len), np.int32), batch_sh)
                   for _ in range(2)) for _ in range(steps + 2)]
  with jax.set_mesh(mesh):
    for x, y in batches[:2]:
      state = step(state, x, y)[0]
    jax.block_until_ready(state)
    t = time.perf_counter()
    for x, y in batches[2:]:
      state = step(state, x, y)[0]
    jax.block_until_ready(state)
  return (time.perf_counter() - t) / steps


CHILD = "import json, sys; from research.bench.finetune import rss_child; rss_child(**json.loads(sys.argv[1]))"


def rss_child(shape_name: str, method: str, batch_size: int, seq_len: int, rank: int, compute_dtype: str):
  """(In a fresh process.) Builds `method`'s real state, compiles and runs 2 steps; prints the peak RSS above the
  RSS just before the state was built, in bytes, as JSON."""
  jax.devices()
  with open("/proc/self/status") as f:
    before = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
  mcfg = dataclasses.replace(shape(shape_name), compute_dtype=compute_dtype)
  state, step, batch_sh, mesh = build(method, mcfg, batch_size, seq_len, rank, abstract=False)
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    for _ in range(2):
      x, y = (jax.device_put(rng.integers(0, mcfg.vocab_size, (batch_size, seq_len), np.int32),
                             batch_sh) for _ in range(2))
      state, metrics = step(state, x, y)
    loss = float(metrics["loss"])
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(json.dumps({"rss": peak - before, "loss": loss}))


def _rss(shape_name: str, method: str, batch_size: int, seq_len: int, rank: int, compute_dtype: str) -> dict:
  args = json.dumps({"shape_name": shape_name, "method": method, "batch_size": batch_size, "seq_len": seq_len,
                     "rank": rank, "compute_dtype": compute_dtype})
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  res = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, env=env, cwd=root)
  if res.returncode:
    return {"error": (res.stderr.strip().splitlines() or ["no output"])[-1][:120]}
  return json.loads(res.stdout.strip().splitlines()[-1])


def step_bytes(row: dict) -> memory.StepBytes:
  return memory.StepBytes(**{f.name: row[f.name] for f in dataclasses.fields(memory.StepBytes)})


def _ratio(x, ref) -> str:
  return f"{x / ref:.2f}x" if ref else "n/a"


def shape_table(name: str, mcfg, rows: list[dict], block: dict | None, with_rss: bool) -> list[str]:
  """The markdown section of one shape: every method's row beside AdamW's (the first row), ratios to it."""
  n = count_params(mcfg)
  ref = rows[0]
  cols = ["method", "trains", "trainable params", "state MiB", "state B/param", "argument MiB", "temp MiB",
          "output MiB", "peak est. MiB", "peak / adamw", "matmul GFLOP", "matmul / adamw", "XLA GFLOP (scan once)",
          "XLA / adamw"]
  cols += ["RSS peak MiB (2 steps)", "RSS / adamw", "peak est. / RSS"] if with_rss else []
  out = []
  for r in rows:
    label = TRAINS.get(r["method"], f"adapters r={r.get('rank', '')}, base bf16")
    if "error" in r:
      out.append([r["method"], label, f"failed: {r['error']}"] + [""] * (len(cols) - 3))
      continue
    peak, ref_peak = (step_bytes(x).peak for x in (r, ref))
    flops = f"{r['matmul_flops'] / 1e9:.4g}" + (" (every layer: cond)" if r["method"] == "badam" else "")
    cells = [r["method"], label, f"{r['trainable'] / 1e6:.2f}M ({r['trainable'] / n:.2%})",
             f"{r['state_bytes'] / MIB:.1f}", f"{r['state_bytes'] / n:.2f}", f"{r['argument'] / MIB:.1f}",
             f"{r['temp'] / MIB:.1f}", f"{r['output'] / MIB:.1f}", f"{peak / MIB:.1f}", _ratio(peak, ref_peak),
             flops, _ratio(r["matmul_flops"], ref["matmul_flops"]), f"{r['flops'] / 1e9:.4g}",
             _ratio(r["flops"], ref["flops"])]
    if with_rss:
      rss, ref_rss = r.get("rss", {}), ref.get("rss", {})
      cells += ([f"{rss['rss'] / MIB:.0f}", _ratio(rss["rss"], ref_rss.get("rss")), _ratio(peak, rss["rss"])]
                if "rss" in rss else [f"failed: {rss.get('error', 'not run')}", "", ""])
    out.append(cells)
    if r["method"] == "badam" and block is not None:
      where = ", ".join(map(str, block["blocks"]))
      out.append(["badam (per block)", f"static split, mean over blocks {where}"] + [""] * 8 +
                 [f"{block['mean'] / 1e9:.4g}", _ratio(block["mean"], ref["matmul_flops"])] + [""] * (len(cols) - 12))
  head = (f"## {name}: {n / 1e6:.1f}M parameters (d_model {mcfg.d_model}, {mcfg.n_layers} layers, {mcfg.n_heads} "
          f"heads / {mcfg.kv_heads} KV, d_ff {mcfg.d_ff}, vocab {mcfg.vocab_size}, "
          f"{'tied' if mcfg.tie_embeddings else 'untied'}, compute {mcfg.compute_dtype})")
  return [head, ""] + table(cols, out) + [""]


def finetune(shapes: Annotated[tuple[str, ...], SHAPE] = ("base", "llama-1b", "llama-3b"),
             methods: Annotated[tuple[str, ...], flags.one_of(*KNOWN)] = METHODS,
             batch_size: int = 1, seq_len: int = 512, rank: int = 8, compute_dtype: str = "float32",
             rss_shapes: Annotated[tuple[str, ...], SOME_SHAPES] = ("base",),
             badam_blocks: Annotated[int, flags.NONNEGATIVE] = 3,
             out: str | None = None) -> dict:
  """Every fine-tuning method's compiled train step against AdamW full fine-tuning, per shape (module docstring).

  Args:
    shapes: `base` (or any preset), `llama-1b`, `llama-3b`.
    methods: rows, from `METHODS`; `adamw` is always measured first (the reference of the ratios).
    batch_size, seq_len: the batch every step is compiled (and, for `rss_shapes`, run) with.
    rank: the PEFT adapters' rank.
    compute_dtype: the model's matmul dtype (parameters stay float32 unless the method stores them otherwise).
    rss_shapes: shapes whose methods are also run for real in a child process each for their peak RSS.
    badam_blocks: blocks at which the static-split BAdam step is compiled (evenly spaced; all when L ≤ this).
    out: markdown file for the tables (rewritten after each shape), else printed only.
  Returns {shape: {"rows": [...], "badam_blocks": {...} or None}}.
  """
  args = {k: v for k, v in locals().items()}
  methods = ("adamw",) + tuple(m for m in methods if m != "adamw")
  t0 = time.perf_counter()
  progress = Progress(call_command("finetune", finetune, args), out, [
      f"Fine-tuning methods' train steps compiled on one device ({machine()}), batch {batch_size} x seq "
      f"{seq_len}, PEFT rank {rank}. Bytes from XLA's compiled program (memory_analysis); matmul FLOPs counted in the "
      f"step's jaxpr (scan bodies x length); XLA GFLOP = cost_analysis, which counts each scan body once (not a "
      f"step cost); "
      f"state B/param = the train state's bytes / the model's parameter count; peak est. = argument + temp + "
      f"output - aliased (donated) bytes. RSS: a fresh process per method builds the state and runs 2 steps "
      f"(peak RSS above the RSS before the state is built, compile included).", ""])
  result = {}
  for name in shapes:
    mcfg = dataclasses.replace(shape(name), compute_dtype=compute_dtype)
    rows, block = [], None
    for method in methods:
      print(f"[finetune] {name} {method} ...", file=sys.stderr, flush=True)
      try:
        row = measure(method, mcfg, batch_size, seq_len, rank)
      except Exception as e:  # a method that does not build or compile: its row says why
        row = {"method": method, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
      row["rank"] = rank
      if name in rss_shapes and "error" not in row:
        row["rss"] = _rss(name, method, batch_size, seq_len, rank, compute_dtype)
      rows.append(row)
      if method == "badam" and "error" not in row and badam_blocks > 0:
        block = badam_block_flops(mcfg, batch_size, seq_len, rank, badam_blocks)
    result[name] = {"rows": rows, "badam_blocks": block}
    progress.lines += shape_table(name, mcfg, rows, block, name in rss_shapes)
    progress.emit()
  progress.lines.append(f"Wall time {time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPU cores, "
                        f"{time.strftime('%Y-%m-%d')}.")
  progress.emit()
  return result

