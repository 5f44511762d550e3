"""`python -m research.bench comm`: what one optimizer step sends over the wire, and whose Newton–Schulz work it is.

Question: does our distributed Muon keep Moonlight's bounds on a sharded model, i.e. communication ≤ 1.25× a ZeRO-1
AdamW step's and Newton–Schulz FLOPs per device ≤ 1.25× (total / devices), where Muon left to the partitioner
repeats every matrix's iteration on every device?

For each model (the ≈43M-parameter tree of research/bench/optim.py, the `small` preset) and mesh (`fsdp=8`,
`data=2,fsdp=4`), in one run: the optimizer update + apply, with gradients and optimizer state sharded like the
parameters (sharding/rules.py), compiled under the mesh for
  (a) AdamW, (b) optax.contrib.muon left to the partitioner (routed like ours: hidden matrices to Muon, embeddings
  and norms to its AdamW), (c) optim.muon, (d) optim.muon(distributed=True);
and for `small` the whole train step (research/train/steps/step.py `make_steps`) as well. Reported per device:
- collective bytes by kind, read from the compiled HLO by `sharding.collectives` (ring wire bytes; XLA:CPU's
  all-reduce + dynamic-slice counted as the reduce-scatter it stands for);
- Newton–Schulz FLOPs: `sharding.matmul_flops` of the compiled optimizer step (its only matmuls are Newton–Schulz
  products; loop trip counts included), next to the analytic total `optim.ns_flops` summed over the Muon matrices;
- the median step time on the simulated mesh (8 CPU "devices" sharing the machine's cores: relative, not scaling).
Targets, as ratios: (d)'s bytes against the analytic ZeRO-1 AdamW step over all devices
(`sharding.analytic_bytes(P, {"data": n}, zero1=True)`), counted as Moonlight does (Liu et al., arXiv 2502.16982,
§2.3): the ZeRO-1 step's reduce-scatter + all-gather plus what the optimizer adds; and (d)'s NS FLOPs per device
against total / devices.
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optim
from models import Transformer, count_params, preset
from research import flags
from research.bench.optim import param_tree
from research.bench.report import Progress, git_commit
from research.train.steps import train_state
from research.train.steps.step import make_steps
from sharding import (
  DATA,
  analytic_bytes,
  batch_sharding,
  collectives,
  devices_for,
  init_params,
  init_train_state,
  make_mesh,
  matmul_flops,
  mesh_spec,
  param_shardings,
  shardings_like_params,
)

NS_STEPS = 5
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
MIB = 2 ** 20
LAYER_NAMES = {"wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
               "wo": ("heads", "embed"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"), "ln1": ("norm",),
               "ln2": ("norm",)}


def _model(name: str, mesh):
  """(params created sharded, their shardings, the model constructor or None) for "43m" or a preset name."""
  if name == "43m":
    abstract = jax.eval_shape(param_tree)
    names = {"embed": ("vocab", "embed"), "final_norm": ("norm",),
             "layers": [dict(LAYER_NAMES) for _ in abstract["layers"]]}
    shardings = param_shardings(abstract, names, mesh)
    with jax.set_mesh(mesh):
      return jax.jit(param_tree, out_shardings=shardings)(), shardings, None
  cfg = preset(name)
  model_fn = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
  _, params, shardings = init_params(model_fn, mesh)
  return params, shardings, model_fn


def _optimizers() -> dict[str, optax.GradientTransformation]:
  def optax_dims(params):
    return jax.tree.map(lambda p, lab: optax.contrib.MuonDimensionNumbers(p.ndim - 2, p.ndim - 1)
                        if lab == "muon" else None, params, optim.muon_labels(params))
  common = dict(weight_decay=0.0, adam_learning_rate=1e-3)
  return {
      "(a) adamw": optax.adamw(1e-3),
      "(b) optax.contrib.muon": optax.contrib.muon(1e-3, muon_weight_dimension_numbers=optax_dims, **common),
      "(c) optim.muon": optim.muon(1e-3, **common),
      "(d) optim.muon distributed": optim.muon(1e-3, distributed=True, **common),
  }


def _ns_total(params) -> float:
  """Standard Newton–Schulz FLOPs of one step over every Muon matrix (each matrix once)."""
  labels = jax.tree.leaves(optim.muon_labels(params))
  return sum(np.prod(p.shape[:-2]) * optim.ns_flops(*p.shape[-2:], NS_STEPS)
             for p, lab in zip(jax.tree.leaves(params), labels) if lab == "muon")


def _run(compiled, args, repeats, advance=None, slow_s=5.0):
  """Median wall time of `repeats` calls after one warm-up call; a first call slower than `slow_s` is itself
  the measurement (warm-up effects are small against it, and repeating minutes-long steps buys little).
  `advance(out, args)` gives the next call's args (a donated state)."""
  times = []
  for i in range(repeats + 1):
    t = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
    if advance:
      args = advance(out, args)
    if i == 0 and times[0] > slow_s:
      return times[0]
  return statistics.median(times[1:])


def _guard(compiled, mesh, audit, budget_gib) -> str | None:
  """Why a compiled program must not be executed here, or None."""
  loops = [op for op in audit.ops if op.in_loop]
  if loops:
    return f"not run: {len(loops)} collectives inside while loops ({loops[0].kind}; XLA:CPU can deadlock)"
  mem = compiled.memory_analysis()
  need = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) * mesh.size
  if need > budget_gib * 2 ** 30:
    return f"not run: needs {need / 2 ** 30:.1f} GiB on the simulated mesh (> --memory-budget-gib {budget_gib})"
  return None


def _measure_opt(tx, params, p_sh, mesh, repeats, budget_gib) -> dict:
  grads = jax.tree.map(lambda p: jnp.sin(p * 7.0 + 1.0) * 0.01, params)
  abstract_state = jax.eval_shape(tx.init, params)
  o_sh = shardings_like_params(abstract_state, params, p_sh, mesh)

  def step(state, params, grads):
    u, state = tx.update(grads, state, params)
    return state, optax.apply_updates(params, u)

  with jax.set_mesh(mesh):
    state = jax.jit(tx.init, out_shardings=o_sh)(params)
    compiled = jax.jit(step, in_shardings=(o_sh, p_sh, p_sh), out_shardings=(o_sh, p_sh)).lower(
        state, params, grads).compile()
    audit = collectives(compiled)
    row = {"audit": audit, "ns_flops": matmul_flops(compiled), "why": _guard(compiled, mesh, audit, budget_gib)}
    if row["why"] is None:
      row["step_s"] = _run(compiled, (state, params, grads), repeats)
  return row


def _measure_train(tx, model_fn, mesh, repeats, budget_gib, zero1=False, batch=16, seq=128) -> dict:
  kw = {"zero1": True} if zero1 else {}
  graphdef, state, shardings = train_state.create(model_fn, tx, mesh, **kw)
  batch_sh = batch_sharding(mesh, (batch, seq))
  train_step, _ = make_steps(graphdef, tx, shardings, batch_sh)
  tokens = np.random.default_rng(0).integers(0, 256, (batch, seq + 1)).astype(np.int32)
  x, y = (jax.device_put(a, batch_sh) for a in (tokens[:, :-1], tokens[:, 1:]))
  with jax.set_mesh(mesh):
    compiled = train_step.lower(state, x, y).compile()
    audit = collectives(compiled)
    row = {"audit": audit, "why": None}  # the model's scanned blocks gather weights inside a (counted) loop: runs
    mem = compiled.memory_analysis()
    if (mem.temp_size_in_bytes + mem.argument_size_in_bytes) * mesh.size > budget_gib * 2 ** 30:
      row["why"] = "not run: over the memory budget"
    else:
      row["step_s"] = _run(compiled, (state, x, y), repeats, advance=lambda out, a: (out[0],) + a[1:])
  return row


def _update_gather_bytes(audit, mesh) -> float:
  """Wire bytes of the all-gathers whose groups run along the `data` axis alone: with parameters replicated over
  `data`, the gather of updates computed on a 1/data share, which a ZeRO-1 step does as its all-gather of params."""
  if mesh.shape[DATA] == 1:
    return 0.0
  ids = np.moveaxis(np.arange(mesh.size).reshape(mesh.devices.shape), mesh.axis_names.index(DATA), -1)
  data_groups = {tuple(g) for g in ids.reshape(-1, mesh.shape[DATA]).tolist()}
  return sum(op.count * op.wire_bytes for op in audit.ops
             if op.kind == "all-gather" and {tuple(sorted(g)) for g in op.groups} == data_groups)


def _bytes_cells(audit) -> list[str]:
  s = audit.summary(fold_scatter=True)
  return [f"{s[k].count} / {s[k].wire_bytes / MIB:.1f}" if k in s else "–" for k in KINDS]


MODELS = flags.Rule(choices=lambda: ("43m", *flags.presets()))  # research/bench/optim.py's tree, or presets


def comm(models: Annotated[tuple[str, ...], MODELS] = ("43m", "small"),
         meshes: tuple[str, ...] = ("fsdp=8", "data=2,fsdp=4"),
         repeats: int = 2, train_step: bool = True, memory_budget_gib: float = 8.0, out: str | None = None) -> str:
  """Collective bytes by kind and Newton–Schulz FLOPs per device of one optimizer step on a sharded model.

  Args:
    models: "43m" (research/bench/optim.py's tree) and/or model presets.
    meshes: mesh specs (each uses the first prod(sizes) devices).
    repeats: timed calls per case (median reported) after one warm-up call.
    train_step: also compile, audit and time the whole train step of preset models.
    memory_budget_gib: do not execute a program whose memory on the simulated mesh would exceed this.
    out: also write the tables (markdown) to this file.
  """
  t_start, load_start = time.perf_counter(), os.getloadavg()[0]
  dev = jax.devices()[0]
  report = Progress(f"python -m research.bench comm --out {out}", out, [
      f"git {git_commit()}; jax {jax.__version__}, {dev.platform} ({dev.device_kind}), {jax.device_count()} "
      f"simulated devices on {os.cpu_count()} cores, fp32; "
      f"bytes are ring wire bytes per device per step (XLA:CPU all-reduce + dynamic-slice counted as "
      f"reduce-scatter); cells `count / MiB`; NS = Newton–Schulz, {NS_STEPS} steps", ""])
  lines, emit = report.lines, report.emit  # each finished section at once, and the file so far

  for model in models:
    for spec in meshes:
      mesh = make_mesh(spec, devices=devices_for(spec))
      params, p_sh, model_fn = _model(model, mesh)
      n_params = sum(x.size for x in jax.tree.leaves(params))
      ns_total = _ns_total(params)
      zero1 = analytic_bytes(n_params, {DATA: mesh.size}, zero1=True)["total"]
      lines += [f"### {model} ({n_params / 1e6:.1f}M params) on {mesh_spec(mesh)}: optimizer step", "",
                "| optimizer | " + " | ".join(KINDS) + " | total MiB | NS GFLOP/device | step ms | note |",
                "|---|" + "---|" * (len(KINDS) + 4)]
      rows = {}
      for name, tx in _optimizers().items():
        print(f"  {model} {spec} {name} ...", file=sys.stderr, flush=True)
        try:
          r = _measure_opt(tx, params, p_sh, mesh, repeats, memory_budget_gib)
        except Exception as e:  # (b) may not survive the partitioner: say how it failed
          rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"}
          lines.append(f"| {name} | " + " | ".join("–" for _ in KINDS) + f" | – | – | – | failed: "
                       f"{rows[name]['error']} |")
          continue
        rows[name] = r
        a = r["audit"]
        step = f"{r['step_s'] * 1e3:.0f}" if "step_s" in r else "–"
        lines.append(f"| {name} | " + " | ".join(_bytes_cells(a)) + f" | {a.wire_bytes(True) / MIB:.1f} | "
                     f"{r['ns_flops'] / 1e9:.1f} | {step} | {r['why'] or ''} |")
      lines += ["", f"Analytic: ZeRO-1 AdamW over {mesh.size} devices (reduce-scatter grads + all-gather params, fp32) "
                f"= {zero1 / MIB:.1f} MiB/device; NS total (every Muon matrix once) = {ns_total / 1e9:.1f} GFLOP, "
                f"/ {mesh.size} devices = {ns_total / mesh.size / 1e9:.1f} GFLOP."]
      for name in ("(c) optim.muon", "(d) optim.muon distributed", "(b) optax.contrib.muon"):
        r = rows.get(name, {})
        if "audit" not in r:
          continue
        b = (zero1 + r["audit"].wire_bytes(True)) / zero1
        f = r["ns_flops"] / (ns_total / mesh.size)
        mark = lambda v: "met" if v <= 1.25 else "missed"
        own = _update_gather_bytes(r["audit"], mesh)
        lines.append(f"- {name}: bytes (ZeRO-1 + optimizer) / ZeRO-1 AdamW = {b:.3f} (target ≤ 1.25: {mark(b)})"
                     + (f", {b - own / zero1:.3f} without the all-gathers over `data` alone ({own / MIB:.1f} MiB: "
                        f"the update gather ZeRO-1's baseline already counts)" if own else "")
                     + f"; NS FLOPs per device / (total / devices) = {f:.2f} (target ≤ 1.25: {mark(f)})")
      lines.append("")
      emit()
      if train_step and model_fn is not None:
        lines += [f"### {model} on {mesh_spec(mesh)}: whole train step (batch 16 x 128)", "",
                  "| optimizer | " + " | ".join(KINDS) + " | total MiB | in loops | step ms |",
                  "|---|" + "---|" * (len(KINDS) + 3)]
        base, totals = None, {}
        cases = [(name, tx, False) for name, tx in _optimizers().items() if "error" not in rows.get(name, {})]
        if mesh.shape[DATA] > 1 and "zero1" in inspect.signature(init_train_state).parameters:
          cases += [(name + " + ZeRO-1 state", tx, True) for name, tx, _ in cases if name[:3] in ("(a)", "(d)")]
        for name, tx, zero1_state in cases:
          print(f"  {model} {spec} train step {name} ...", file=sys.stderr, flush=True)
          r = _measure_train(tx, model_fn, mesh, repeats, memory_budget_gib, zero1=zero1_state)
          a = r["audit"]
          base = base or a.wire_bytes(True)
          totals[name] = a.wire_bytes(True)
          step = f"{r['step_s'] * 1e3:.0f}" if "step_s" in r else r["why"]
          lines.append(f"| {name} | " + " | ".join(_bytes_cells(a)) + f" | {a.wire_bytes(True) / MIB:.1f} "
                       f"({a.wire_bytes(True) / base:.2f}x (a)) | {sum(op.in_loop for op in a.ops)} | {step} |")
        d, z = "(d) optim.muon distributed", " + ZeRO-1 state"
        pairs = [(d, "(a) adamw", ""), (d + z, "(a) adamw" + z, " with ZeRO-1 state")]
        verdict = lambda m, a: "met" if totals[m] <= 1.25 * totals[a] else "missed"
        lines += ["", "Measured train-step bytes, distributed Muon / AdamW: " + "; ".join(
            f"{totals[m] / totals[a]:.3f}{label} (target ≤ 1.25: {verdict(m, a)})"
            for m, a, label in pairs if m in totals and a in totals) + "."]
        p_model = count_params(preset(model))
        analytic = analytic_bytes(p_model, mesh)["total"]
        lines += ["", f"Analytic train-step bytes for this mesh (sharding.analytic_bytes, fp32): "
                  f"{analytic / MIB:.1f} MiB/device"
                  + (f"; with ZeRO-1 state over data: {analytic_bytes(p_model, mesh, zero1=True)['total'] / MIB:.1f}"
                     if mesh.shape[DATA] > 1 else "") + ".", ""]
        emit()
  lines.append(f"step ms: median of {repeats} calls after a warm-up (a first call over 5 s is the measurement); "
               f"1-minute load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
               f"total wall time {time.perf_counter() - t_start:.0f} s")
  emit()
  return "\n".join(lines)
