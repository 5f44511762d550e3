"""XLA compiler options for the programs that read a whole model (the train and eval steps, the checksums), and a
compiled program's bytes per device as XLA reports them (`StepBytes`, read by the memory pre-flight and the observed
steps)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# XLA:CPU's YNNPACK fusions off: the small model's train step ran 8-10% faster without them on this machine (issue
# 50; docs/benchmarks.md, "XLA's CPU options"), the JAX floor's likewise
NO_YNN_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def _knows(options: tuple[tuple[str, str], ...]) -> bool:
  """Whether this jaxlib's CPU compiler accepts the options (an option it does not know fails the compile)."""
  try:
    jax.jit(lambda x: x + 1).lower(jnp.zeros(2)).compile(compiler_options=dict(options))
    return True
  except Exception:  # any refusal means: do not use them
    return False


def compiler_options() -> dict[str, str]:
  """On the CPU, no while-loop invariant code motion. XLA:CPU computes a bfloat16 matmul in float32 (and widens an
  array to 32 bits to hash it), and that pass hoists the conversion of a loop's sliced input out of the loop, so a
  loop over a model's layers (or over the pieces of an array) got a float32 copy of the whole thing as a temporary:
  12 GiB of the 3B LoRA step's 12.4 GiB (research/results/finetune_3b.md), 2.8 GiB of the checksums of one 3B weight
  stack. The losses are bit-identical without the pass and the default run's speed is unchanged (2,262 vs 2,335
  tokens/s over 60 steps). XLA:GPU computes bfloat16 natively and makes no such copy (measured on an H100:
  research/results/finetune_3b_gpu.md), so accelerators keep the pass. Also on the CPU, YNNPACK's fusions off
  (`NO_YNN_FUSIONS`), where this jaxlib knows the option: faster for the steps measured."""
  if jax.default_backend() != "cpu":
    return {}
  ynn = NO_YNN_FUSIONS if _knows(tuple(NO_YNN_FUSIONS.items())) else {}
  return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion", **ynn}


GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class StepBytes:
  """One device's bytes while the compiled step runs (XLA's memory_analysis)."""
  argument: int
  output: int
  alias: int
  temp: int

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  @classmethod
  def of(cls, compiled) -> StepBytes:
    m = compiled.memory_analysis()
    return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
               int(m.temp_size_in_bytes))


def size(n: int | None) -> str:
  """Bytes for a reader: GiB, or MiB below a tenth of one."""
  if n is None:
    return "an unknown amount"
  return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"
