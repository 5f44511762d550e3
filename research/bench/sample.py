"""Sampling speed: `models.generate` (KV cache) against re-running the whole sequence for every new token.

  python -m research.bench sample --out research/results/bench_sample.md

Both greedy, both one jitted program per run (the peer runs the full padded sequence through the model once per
new token inside a `lax.fori_loop`, its causal attention making the padding harmless), same random model, same
prompt; tokens/s = batch · new tokens / median wall time of `--repeats` runs after a warm-up (compile excluded).
The cached decoder does one token's work per step; the peer does the whole prefix's, so the ratio grows with
the length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import tyro
from flax import nnx

import models
from models.generate import generate
from research.bench.report import command, publish
from research.train.hooks.throughput import median_seconds


@dataclasses.dataclass
class Args:
  """Tokens/s of KV-cache generation vs re-running the prefix."""
  preset: str = "small"
  batch: int = 4
  prompt: int = 32
  new_tokens: tuple[int, ...] = (32, 128)
  repeats: int = 3
  out: str | None = None


@jax.jit
def _rerun(graphdef, state, seq_BS, start):
  model = nnx.merge(graphdef, state)

  def step(t, seq):
    nxt = jnp.argmax(model(seq)[:, t], -1).astype(seq.dtype)
    return jax.lax.dynamic_update_slice_in_dim(seq, nxt[:, None], t + 1, 1)

  return jax.lax.fori_loop(start - 1, seq_BS.shape[1] - 1, step, seq_BS)


def sample(a: tyro.conf.OmitArgPrefixes[Args]):
  """Sampling speed: the KV cache against re-running the prefix (see the module docstring)."""
  config = models.preset(a.preset)
  model = models.Transformer(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  prompt = jax.random.randint(jax.random.key(0), (a.batch, a.prompt), 0, config.vocab_size)
  rows = []
  for n in a.new_tokens:
    cached = median_seconds(lambda: generate(model, prompt, n), a.repeats)
    padded = jnp.pad(prompt, ((0, 0), (0, n)))
    rerun = median_seconds(lambda: _rerun(graphdef, state, padded, a.prompt), a.repeats)
    same = bool((generate(model, prompt, n) == _rerun(graphdef, state, padded, a.prompt)).all())
    rows.append((n, a.batch * n / cached, a.batch * n / rerun, rerun / cached, same))
  lines = [f"`{a.preset}` ({models.count_params(config) / 1e6:.1f}M params), batch {a.batch}, prompt {a.prompt} "
           f"tokens, greedy, {jax.devices()[0].platform} ({len(jax.devices())} device(s) visible, 1 used), median of "
           f"{a.repeats} after a warm-up.", "",
           "| new tokens | KV cache tokens/s | re-run prefix tokens/s | speedup | same tokens |",
           "|---|---|---|---|---|"]
  lines += [f"| {n} | {c:,.0f} | {r:,.0f} | {s:.1f}x | {'yes' if same else 'NO'} |" for n, c, r, s, same in rows]
  cmd = command("sample", a)
  lines += ["", f"Command: `{cmd}`"]
  publish(lines, a.out, preface="# Sampling: KV cache vs re-running the prefix\n\n")

