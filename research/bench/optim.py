"""`python -m research.bench optim`: the Muon step against optax.contrib.muon and the Newton–Schulz FLOP floor.

On one device, in one run, for a tree of 6 transformer layers (d_model 768, a 768x3072 MLP, vocab 256:
≈43M parameters) routed the same way for both (hidden matrices to Muon; embedding and norms to AdamW):
  1. Newton–Schulz FLOP/s on (768, 3072) and (768, 768) vs a plain matmul of the same shape;
  2. the full optimizer step: optim.muon vs optax.contrib.muon vs optax.adamw;
  3. the standard NS FLOP floor of the tree at the measured matmul rates, and each step as a multiple;
  4. the Gram-space iteration: FLOPs and time vs the standard floor, fp32 accuracy vs the SVD polar
     factor next to standard NS and pytorch_optimizer's Gram Newton–Schulz;
  5. peak temporary memory of each compiled step (memory_analysis) and the optimizer state's bytes; every step is
     timed from the state after one step, and a periodic one over its period (`PERIOD`), per step;
  6. the 2026 matrix optimizers (NorMuon, AdaMuon, Scion, Dion at rank 1 and 1/4, SOAP, PSGD-Kron) at their
     registry defaults on the same tree, each step as a ratio to optax.adamw's and optim.muon's (MuonClip is Muon
     plus one elementwise rescale of W_q, W_k: not timed here).
"""

from __future__ import annotations

import statistics
import time
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optim
from optim.trees import tree_bytes
from research import flags
from research.bench.report import publish

D, F, LAYERS, VOCAB, STEPS = 768, 3072, 6, 256, 5


def param_tree(key=0):
  k = iter(jax.random.split(jax.random.key(key), 8 * LAYERS + 1))
  w = lambda *s: 0.02 * jax.random.normal(next(k), s, jnp.float32)
  layers = [{"wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D), "w_up": w(D, F), "w_down": w(F, D),
             "ln1": jnp.ones(D), "ln2": jnp.ones(D)} for _ in range(LAYERS)]
  return {"embed": w(VOCAB, D), "layers": layers, "final_norm": jnp.ones(D)}


def is_muon(path, leaf):
  return leaf.ndim == 2 and "embed" not in jax.tree_util.keystr(path)


def timed(f, *args, repeats):
  return interleaved({"f": (f, args)}, repeats)["f"]


def interleaved(cases: dict, repeats: int) -> dict:
  """Median wall time of each case, timed round-robin (one call of each per round) so that a change
  in machine load hits every case alike; each is called once first to warm up."""
  times = {k: [] for k in cases}
  for f, args in cases.values():
    jax.block_until_ready(f(*args))
  for _ in range(repeats):
    for k, (f, args) in cases.items():
      t = time.perf_counter()
      jax.block_until_ready(f(*args))
      times[k].append(time.perf_counter() - t)
  return {k: statistics.median(v) for k, v in times.items()}


# Optimizers whose work is periodic are timed over one period (a `lax.scan` of that many steps, reported per step):
# SOAP refreshes its eigenbases every `precondition_frequency` (10) steps; Kron at update probability 1/10 fits its
# preconditioner every 10th step (its default schedule is at 1 for the first 500 steps: the plain `kron` row).
PERIOD = {"soap": 10, "kron (p = 1/10)": 10}


def step_fn(tx, params, period: int = 1):
  """A compiled update + apply (`period` of them in a `lax.scan`), its memory analysis, and its arguments: the state
  after one step (SOAP's first step only builds its bases)."""
  grads = jax.tree.map(lambda p: jnp.sin(p * 7.0) * 0.01, params)

  def step(state, params, grads):
    u, state = tx.update(grads, state, params)
    return state, optax.apply_updates(params, u)

  def steps(state, params, grads):
    body = lambda carry, _: (step(*carry, grads), None)
    return jax.lax.scan(body, (state, params), None, length=period)[0]

  state, _ = jax.jit(step)(jax.jit(tx.init)(params), params, grads)
  compiled = jax.jit(steps).lower(state, params, grads).compile()
  return compiled, (state, params, grads)


def optimizers():
  labels = lambda p: jax.tree_util.tree_map_with_path(lambda path, x: "muon" if is_muon(path, x) else "adam", p)
  dims = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, x: optax.contrib.MuonDimensionNumbers(0, 1) if is_muon(path, x) else None, p)
  common = dict(weight_decay=0.0, adam_learning_rate=1e-3)
  return {
      "optim.muon": optim.muon(1e-3, scale="keller", labels=labels, **common),
      "optim.muon gram": optim.muon(1e-3, scale="keller", labels=labels, method="gram", **common),
      "optax.contrib.muon": optax.contrib.muon(1e-3, muon_weight_dimension_numbers=dims, **common),
      "optax.adamw": optax.adamw(1e-3),
      # the 2026 set: the registry's factories at their defaults (their own parameter groups)
      "normuon": optim.get_optimizer("normuon", 1e-3),
      "adamuon": optim.get_optimizer("adamuon", 1e-3),
      "scion": optim.get_optimizer("scion", 1e-3),
      "dion (rank 1)": optim.get_optimizer("dion", 1e-3),
      "dion (rank 1/4)": optim.get_optimizer("dion", 1e-3, rank_fraction=0.25),
      "soap": optim.get_optimizer("soap", 1e-3),
      "kron": optim.get_optimizer("kron", 1e-3),
      "kron (p = 1/10)": optim.get_optimizer("kron", 1e-3, preconditioner_update_probability=0.1),
  }


SKIPPABLE = flags.Rule(choices=lambda: optimizers(), empty=True)  # --skip: the steps the bench times


def optim_step(repeats: int = 5, out: str | None = None, skip: Annotated[tuple[str, ...], SKIPPABLE] = ()) -> str:
  """Muon step vs optax.contrib.muon and the Newton-Schulz FLOP floor (one device, fp32).

  Args:
    repeats: timed rounds (each times every case once; medians reported).
    out: also write the tables (markdown) to this file.
    skip: optimizer steps left out (e.g. soap kron, whose compiles are long on a GPU with little time).
  """
  params = param_tree()
  muon_shapes = [x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if is_muon(p, x)]
  lines = [f"jax {jax.__version__}, {jax.devices()[0].device_kind} x1, fp32, median of {repeats}; "
           f"tree: {LAYERS} layers, d_model {D}, MLP {F}, vocab {VOCAB}, "
           f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params ({len(muon_shapes)} Muon matrices)", ""]

  # 1-3, 5: every case compiled first, then timed round-robin: the matmuls, the lone NS runs, the steps
  shapes = [(D, F), (D, D)]
  xs = {s: jax.random.normal(jax.random.key(1), s, jnp.float32) for s in shapes}
  cases, memory, state = {}, {}, {}
  for s in shapes:
    cases[("matmul", s)] = (jax.jit(lambda a: a @ a.T), (xs[s],))
    cases[("ns", s)] = (jax.jit(lambda a: optim.orthogonalize(a, steps=STEPS)), (xs[s],))
  for name, tx in optimizers().items():
    if name in skip:
      continue
    compiled, args = step_fn(tx, params, PERIOD.get(name, 1))
    cases[("step", name)] = (compiled, args)
    memory[name] = compiled.memory_analysis().temp_size_in_bytes
    state[name] = tree_bytes(args[0])
  t = interleaved(cases, repeats)
  t.update({("step", name): t[("step", name)] / period for name, period in PERIOD.items() if ("step", name) in t})

  lines += ["| shape | matmul GFLOP/s | NS GFLOP/s | NS / matmul |", "|---|---|---|---|"]
  rate = {}
  for m, n in shapes:
    rate[(m, n)] = 2 * m * m * n / t[("matmul", (m, n))]
    ns_rate = optim.ns_flops(m, n, STEPS) / t[("ns", (m, n))]
    lines.append(f"| ({m}, {n}) | {rate[(m, n)] / 1e9:.1f} | {ns_rate / 1e9:.1f} | {ns_rate / rate[(m, n)]:.2f} |")

  # the floor: every Muon matrix's standard NS FLOPs at its shape's measured matmul rate
  rate_of = lambda s: rate[(min(s), max(s))]
  floor = sum(optim.ns_flops(*s, STEPS) / rate_of(s) for s in muon_shapes)
  gram_flops = sum(optim.ns_flops(*s, STEPS, "gram") for s in muon_shapes)
  std_flops = sum(optim.ns_flops(*s, STEPS) for s in muon_shapes)
  lines += ["", f"Standard NS floor of the tree: {std_flops / 1e9:.0f} GFLOP = {floor * 1e3:.0f} ms; "
            f"Gram-space FLOPs: {gram_flops / 1e9:.0f} GFLOP = {gram_flops / std_flops:.2f}x standard", "",
            "| optimizer step | time (ms) | x NS floor | x optax.contrib.muon | x optax.adamw | x optim.muon | "
            "peak temp memory (MiB) | state (MiB) | state / params |", "|---|---|---|---|---|---|---|---|---|"]
  ref, adamw, muon = (t[("step", k)] for k in ("optax.contrib.muon", "optax.adamw", "optim.muon"))
  n_params = tree_bytes(params)
  for name in memory:
    ts = t[("step", name)]
    lines.append(f"| {name} | {ts * 1e3:.1f} | {ts / floor:.2f} | {ts / ref:.2f} | {ts / adamw:.1f} | "
                 f"{ts / muon:.2f} | {memory[name] / 2 ** 20:.1f} | {state[name] / 2 ** 20:.1f} | "
                 f"{state[name] / n_params:.2f} |")

  # 4. accuracy vs the SVD polar factor (fp32, one (768, 3072) matrix)
  lines += ["", "| NS on (768, 3072), fp32, 5 steps | max abs error vs SVD polar factor | max |σ - 1| |",
            "|---|---|---|"]
  x = np.asarray(jax.random.normal(jax.random.key(2), (D, F), jnp.float32), np.float64)
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  polar = u @ vt
  for coeffs in ("quintic", "polar_express", "tuned5"):
    for method in ("standard", "gram"):
      o = np.asarray(optim.orthogonalize(jnp.asarray(x, jnp.float32), coeffs=coeffs, method=method), np.float64)
      s = np.linalg.svd(o, compute_uv=False)
      lines.append(f"| optlab {method}, {coeffs} | {np.abs(o - polar).max():.4f} | {np.abs(s - 1).max():.4f} |")
  try:
    lines += _pytorch_optimizer_rows(x, polar)
  except ImportError as e:
    lines.append(f"| pytorch_optimizer not installed ({e}) | | |")
  flags = f" --skip {' '.join(skip)}" if skip else ""
  return publish(lines, out, preface=f"Command: `python -m research.bench optim --out {out}{flags}`\n\n")


def _pytorch_optimizer_rows(x, polar):
  """The outside reference: pytorch_optimizer's (restarted) Gram Newton–Schulz on the same matrix, fp32."""
  import torch
  from pytorch_optimizer.optimizer.utils import zero_power_via_gram_newton_schulz, zero_power_via_newton_schulz_5
  rows = []
  g = torch.from_numpy(x.astype(np.float32))
  for name, fn in (("standard", zero_power_via_newton_schulz_5), ("gram", zero_power_via_gram_newton_schulz)):
    o = fn(g, num_steps=STEPS, weights=optim.COEFFICIENTS["quintic"][0], dtype=torch.float32).double().numpy()
    s = np.linalg.svd(o, compute_uv=False)
    rows.append(f"| pytorch_optimizer {name}, quintic | {np.abs(o - polar).max():.4f} | {np.abs(s - 1).max():.4f} |")
  return rows
