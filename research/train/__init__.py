"""The trainer: `python -m research.train` and everything a step of it needs, one concern per module.

  config.py     TrainConfig: every flag, with its help            cli.py       the CLI: parse, run, one-line errors
  loop.py       run(): the loop, one screen                       step.py      loss, grads, update (make_steps)
  startup.py    mesh, model config, data, pipeline, checks        build.py     model config and optimizer from flags
  state.py      the state at step 0 (init-from, adapters, sync)   resume.py    the newest readable checkpoint
  switch.py     --switch-at: layouts compiled ahead of time       signals.py   SIGINT/SIGTERM as a stop flag
  runtime.py    devices, BLAS threads, compile cache              preflight.py flag checks before anything starts
  checkpoint.py orbax checkpoints   integrity.py their checksums  rundir.py    run directory: lock, metrics, config
  health.py     non-finite steps, spikes   watchdog.py dead peers distributed.py multi-process bring-up
  progress.py   console output    throughput.py tokens/s, MFU     sync.py      --sync: allreduce, local SGD, gossip, stale
  init_from.py  --init-from, --freeze   adapters.py --peft        pretrained.py runs and HF directories as models

`from research.train import TrainConfig, run` is the API for notebooks and experiments. The names are resolved on
first use, so that `python -m research.train` can set its signal handlers before the seconds of imports.
"""

import importlib

_EXPORTS = {"TrainConfig": "config", "RunError": "config", "run": "loop", "main": "cli", "USER_ERRORS": "cli",
            "make_steps": "step"}


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"research.train.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'research.train' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_EXPORTS))
