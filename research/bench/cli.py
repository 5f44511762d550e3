"""`python -m research.bench NAME [FLAGS]`: the benchmark registry and its command line
(bad input: one line, exit 2)."""

from __future__ import annotations

import functools
import inspect
import sys
import typing

import jax
import tyro

from research import entry, flags
from research.bench.attention import attention
from research.bench.cache import cache
from research.bench.ckpt import ckpt_bench
from research.bench.comm import comm
from research.bench.coordcheck import coordcheck
from research.bench.data import data
from research.bench.dion import dion_comm
from research.bench.finetune import finetune
from research.bench.finetune_3b import finetune_3b
from research.bench.hf import hf
from research.bench.moe import moe
from research.bench.optim import optim_step
from research.bench.peer import peer
from research.bench.preflight import preflight
from research.bench.quant import quant
from research.bench.reshard import reshard_bench
from research.bench.sample import sample
from research.bench.train import train
from research.bench.vmap import vmap

NUM_CPU_DEVICES = 8


def checked_first(bench):
  """`bench` with every flag checked against its rule (`research.flags`: counts, ranges, choices, mesh specs, an
  --out that can be written) before it runs: a bad value is one line and exit 2, not a traceback minutes in."""
  hints = typing.get_type_hints(bench, include_extras=True)

  @functools.wraps(bench)
  def checked(*args, **kwargs):
    bound = inspect.signature(bench).bind(*args, **kwargs)
    bound.apply_defaults()  # a default --out (dion's) is checked too
    flags.check(dict(bound.arguments), hints)  # an Args dataclass (hf, quant, sample): its fields
    return bench(*args, **kwargs)
  return checked


BENCHMARKS = {name: checked_first(bench) for name, bench in {
  "train": train, "optim": optim_step, "comm": comm, "reshard": reshard_bench, "moe": moe, "ckpt": ckpt_bench,
  "dion": dion_comm, "attention": attention, "hf": hf, "quant": quant, "sample": sample, "finetune": finetune,
  "finetune-3b": finetune_3b, "data": data, "peer": peer, "preflight": preflight, "cache": cache,
  "coordcheck": coordcheck, "vmap": vmap}.items()}


def main(argv=None):
  try:
    jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)  # before any device use
  except RuntimeError:  # backend already up (a test or notebook set it): keep what is there
    pass
  with entry.one_line_errors(library=True):  # a benchmark's refusals and the library's of its values
    args = sys.argv[1:] if argv is None else list(argv)
    if args and not args[0].startswith("-") and args[0] not in BENCHMARKS:  # tyro's answer is a 9-line box
      raise entry.UsageError(f"no benchmark {args[0]!r}; choose from {', '.join(BENCHMARKS)}")
    tyro.extras.subcommand_cli_from_dict(BENCHMARKS, args=args, prog="python -m research.bench")
