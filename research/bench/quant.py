"""Evaluation speed of quantized models against float32, side by side in one run.

  python -m research.bench quant --out research/results/bench_quant.md

Model level: the held-out loss's forward (logits and cross entropy, jitted, compile excluded) of a random `small` and
`base`, float32 against the same model quantized by `models/quant.py`: weights-only W4 and W3g64 (RTN; the weight is
dequantized inside the forward) and W8A8 (int8 weights, per-token int8 activations, fake-quantized: the arithmetic
qwix's integer dot_general equals). Matmul level, one (tokens × D) × (D × F) product of the model's MLP shape: float32,
qwix's int8 × int8 `dot_general` on quantized operands (real integer arithmetic), and dequantize-then-float32 (what
the quantized forward does). Median wall time of --repeats after a warm-up; ratios are to float32 (below 1: faster).
The weight bytes a forward reads are the floor a memory-bound kernel could approach: 1/8 (W4) or 1/4 (W8) of
float32's; XLA on CPU has no low-bit kernels, so this measures what the code does here, not what hardware could.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import qwix
import tyro
from flax import nnx

import models
from models import quant
from models.transformer import cross_entropy
from research.bench.report import command, publish
from research.train.hooks.throughput import median_seconds


@dataclasses.dataclass
class Args:
  """Quantized evaluation speed vs float32."""
  presets: tuple[str, ...] = ("small", "base")
  batch: int = 8
  seq: int = 256
  repeats: int = 5
  out: str | None = None


def _forward_seconds(model, x, y, repeats: int) -> float:
  graphdef, state = nnx.split(model)
  f = jax.jit(lambda s: cross_entropy(nnx.merge(graphdef, s)(x), y))
  return median_seconds(lambda: f(state), repeats)


SPECS = {"W4 (RTN, per channel)": quant.Spec("rtn", 4), "W3g64 (RTN)": quant.Spec("rtn", 3, group=64),
         "W8A8 (SmoothQuant)": quant.Spec("smoothquant", 8, act_bits=8)}


def quant(a: tyro.conf.OmitArgPrefixes[Args]):
  """Evaluation speed of quantized models against float32, side by side in one run (see the module docstring)."""
  lines = [f"{jax.devices()[0].platform} ({len(jax.devices())} device(s) visible, 1 used), batch {a.batch} × "
           f"{a.seq} tokens, median of {a.repeats} after a warm-up; time relative to float32 (below 1: faster).", "",
           "| model | float32 ms | " + " | ".join(SPECS) + " |", "|---|---:|" + "---:|" * len(SPECS)]
  tokens = np.random.default_rng(0).integers(0, 256, (a.batch, a.seq + 1))
  x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
  for name in a.presets:
    config = models.preset(name)
    fp = models.Transformer(config, rngs=nnx.Rngs(0))
    t_fp = _forward_seconds(fp, x, y, a.repeats)
    ratios = []
    for spec in SPECS.values():
      q = quant.quantize(nnx.clone(fp), quant.uniform_plan(fp, spec), tokens[:2, :-1])
      ratios.append(_forward_seconds(q, x, y, a.repeats) / t_fp)
    lines.append(f"| `{name}` | {1e3 * t_fp:.0f} | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")
  config = models.preset(a.presets[-1])
  n, d, f = a.batch * a.seq, config.d_model, config.d_ff
  rng = np.random.default_rng(1)
  xs, ws = jnp.asarray(rng.normal(size=(n, d)), jnp.float32), jnp.asarray(rng.normal(size=(d, f)), jnp.float32)
  xq, wq = qwix.quantize(xs, jnp.int8, channelwise_axes=(0,)), qwix.quantize(ws, jnp.int8, channelwise_axes=(1,))
  dims = (((1,), (0,)), ((), ()))
  f32, f8 = jax.jit(jnp.matmul), jax.jit(lambda p, q: qwix.dot_general(p, q, dims))
  fdq = jax.jit(lambda p, q: qwix.dequantize(p) @ qwix.dequantize(q))
  t32 = median_seconds(lambda: f32(xs, ws), a.repeats)
  t8 = median_seconds(lambda: f8(xq, wq), a.repeats)
  tdq = median_seconds(lambda: fdq(xq, wq), a.repeats)
  lines += ["", f"One ({n} × {d}) × ({d} × {f}) product (`{a.presets[-1]}`'s MLP shape): float32 {1e3 * t32:.1f} ms; "
            f"qwix int8 × int8 dot_general {t8 / t32:.2f}×; dequantize then float32 {tdq / t32:.2f}×."]
  cmd = command("quant", a)
  lines += ["", f"Command: `{cmd}`"]
  publish(lines, a.out, preface="# Quantized evaluation speed vs float32\n\n" + __doc__.split("\n\n", 2)[2].strip()
          + "\n\n")

