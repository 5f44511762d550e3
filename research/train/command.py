"""`python -m research.train`: the flags parsed, the run, and the failures the CLI reports in one line.

Every such failure is one line with its exit status (2 bad input, 3 non-finite steps, 4 a dead peer) instead of a
traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator

import jax
import tyro

from models import HFError, peft
from models.attention import AttentionError
from models.config import ConfigError
from optim import UnknownOptimizerError
from research import entry
from research.data import DataError
from research.train.config import RunError, TrainConfig
from research.train.hooks.progress import summary
from research.train.hooks.watchdog import EXIT_STATUS as WATCHDOG_EXIT
from research.train.loop import run
from research.train.runtime.processes import DistributedError, is_primary
from research.train.setup import checks, init_from
from research.train.steps import frozen
from research.train.steps.health import BadStepsError
from research.train.store import rundir
from research.train.store.checkpoint import CheckpointError, quiet_orbax_errors
from sharding import MeshError, ShardingError
from sharding.pipeline import PipelineError

USER_ERRORS = (RunError, checks.PreflightError, rundir.RunDirError, ConfigError, UnknownOptimizerError,
               CheckpointError, DataError, MeshError, ShardingError, DistributedError, PipelineError,
               init_from.InitError, frozen.FreezeError, HFError, peft.PEFTError, AttentionError)


def optimizer_help() -> str:
  """Every registered optimizer with its hyperparameters and defaults (shown by --help).

  Returns:
    The help text, one line per optimizer.
  """
  from optim import OPTIMIZERS, hyperparameters
  lines = ["optimizers (--optimizer NAME; any hyperparameter below by --opt KEY=VALUE, or --weight-decay/--b1/--b2):"]
  for name in sorted(OPTIMIZERS):
    hp = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in hyperparameters(name).items())
    lines.append(f"  {name}: {hp}")
  return "\n".join(lines)


COLLECTIVE_FAILED = r"Gloo|NCCL|[Cc]onnection (reset|closed) by peer|heartbeat"


OOM_FIX = ("lower --batch-size or --seq-len, add --remat, use an attention that keeps no T·T scores (--attention "
           "flash; cudnn on an NVIDIA GPU in bfloat16), or shard over more devices")


def failure(e: Exception) -> tuple[int, str] | None:
  """How the CLI reports a run's failure: in one line with an exit status, or with the traceback (a bug).

  Args:
    e: what the run raised.

  Returns:
    (exit status, error line): 2 bad input (`USER_ERRORS`, an OSError of the run directory, out of memory), 3
    non-finite steps, 4 a collective that failed in a multi-process run (a dead peer); None for a bug (the traceback
    is shown).
  """
  text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
  peers = jax.distributed.is_initialized() and jax.process_count() > 1
  if peers and (isinstance(e, jax.errors.JaxRuntimeError) or re.search(COLLECTIVE_FAILED, str(e))):
    # a collective failed (in a step, or in a checkpoint save's own collectives): a peer is gone
    return WATCHDOG_EXIT, (f"a collective failed in a {jax.process_count()}-process run ({text}): a peer process "
                           f"probably died; restart every process with the same command to resume")
  if isinstance(e, USER_ERRORS) or isinstance(e, OSError):  # bad input; the run directory's disk or permissions
    return 2, str(e)
  if isinstance(e, ValueError) and type(e).__module__.startswith("optim."):  # an optimizer's own refusal, at init
    return 2, f"--optimizer/--opt: {text}"  # of the model's parameters (BAdam's start_block past the last block)
  if isinstance(e, BadStepsError):
    return 3, str(e)
  oom = entry.out_of_memory(e, OOM_FIX)  # any XLA status code (RESOURCE_EXHAUSTED, INTERNAL "Out of memory ...")
  return None if oom is None else (2, oom)


@contextlib.contextmanager
def failures_in_one_line() -> Iterator[None]:
  """Ends the process on a failure `failure` knows: its error line on stderr, then its exit status.

  Yields:
    Nothing: the block runs as it is.

  Raises:
    SystemExit: with the failure's exit status (a multi-process run exits at once instead: `os._exit`).
    Exception: what the block raised when `failure` does not know it (a bug: the traceback is shown).
  """
  try:
    yield
  except Exception as e:
    failed = failure(e)
    if failed is None:
      raise
    print(f"error: {failed[1]}", file=sys.stderr, flush=True)
    if jax.distributed.is_initialized() and jax.process_count() > 1:
      sys.stdout.flush()  # and not through jax.distributed's shutdown barrier: a dead peer would hold it until JAX's
      os._exit(failed[0])  # heartbeat timeout, then abort this process with a stack trace
    raise SystemExit(failed[0]) from None


def main(argv: list[str] | None = None) -> None:
  """`python -m research.train`: parses the flags and trains; the failures `failure` knows end in one line.

  Such a failure ends the process with its exit status (`failures_in_one_line`); any other shows its traceback.

  Args:
    argv: the command line's arguments (None: `sys.argv[1:]`).
  """
  cfg = tyro.cli(TrainConfig, args=argv, prog="python -m research.train",
                 description=f"{TrainConfig.__doc__}\n\n{optimizer_help()}")
  quiet_orbax_errors()  # a failed save is reported in one line of ours
  with failures_in_one_line():
    records = run(cfg)
  if records and is_primary():
    print(summary(records, cfg.checkpoint.out))
