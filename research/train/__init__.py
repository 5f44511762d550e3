"""The trainer: `python -m research.train` and `from research.train import TrainConfig, run`.

The loop (`loop.py`: `run`) is a composition of named hooks over one step; every concern it calls is a room:

  config/   TrainConfig in sections (sections.py, prefixed.py; the model's and --moe.*'s from the model's schema:
            derived.py), what trains (trainable.py)
  setup/    a run built before its first step (run.py): the flag checks before anything starts (checks.py), mesh, data
            and pipeline (startup.py), what does not combine (clashes.py), model config and optimizer (build.py), the
            state at step 0 (initial_state.py, init_from.py, adapters.py), the memory pre-flight (memory.py),
            --switch-at's layouts (switch.py), a blockwise optimizer's plan (blockwise.py), the newest readable
            checkpoint (resume.py)
  steps/    the compiled programs and the typed state (train_state.py): the one update path and plain step (step.py),
            the update arguments it supplies (update_args.py), a blockwise optimizer's (blockstep.py, _reachstep.py),
            --freeze-layers' (layerfreeze.py), --freeze's mask (frozen.py), --sync's (sync.py), the non-finite guard
            and the bad-step monitor (health.py)
  hooks/    what the loop calls at a cadence (cadence.py): the metrics processor (metrics.py, with the held-out
            evaluation), trackers (trackers.py, _tbimport.py), dynamic data weights (source_weights.py), the profiler
            (profiler.py), the peer watchdog (watchdog.py), throughput and MFU (throughput.py, peaks.py), the console
            (progress.py)
  store/    the run directory (rundir.py), orbax checkpoints (checkpoint.py) and their checksums (integrity.py), runs
            and Hugging Face directories as models (pretrained.py)
  runtime/  devices, BLAS threads and the compile cache (devices.py), multi-process bring-up (processes.py),
            SIGINT/SIGTERM (signals.py, early.py), XLA options (xla.py)
  feed.py   the training batches: this process's rows, read ahead, the loader state checkpoints keep
  vmapped.py  a sweep's runs that differ only in seed and numeric optimizer values, side by side in one program
  command.py  the CLI: parse, run, one-line errors and exit statuses
"""

from research.train.runtime import early  # noqa: F401  (first: as a command, signals are kept during the imports)

# isort: split
from research.train.command import USER_ERRORS, main
from research.train.config import RunError, TrainConfig
from research.train.loop import run
from research.train.steps.step import make_steps

__all__ = ["main", "make_steps", "run", "RunError", "TrainConfig", "USER_ERRORS"]
