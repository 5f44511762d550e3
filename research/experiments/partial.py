"""A full experiment run's resume file: OUT/partial.json holds the config and what finished, so that a rerun of the
same command skips it (`common.run_seeds`, and the experiments that save their own progress)."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

from research.train.store.rundir import aside_name

PARTIAL = "partial.json"  # in an experiment's OUT while a full run goes on: what it finished, for a rerun to resume


def load_partial(cfg) -> dict | None:
  """What an interrupted full run of the same config (`cfg.out`, `cfg.smoke`, the rest of its fields) saved with
  `save_partial`, without the config; None at smoke size, with no file, or when the file is another config's."""
  path = os.path.join(cfg.out, PARTIAL)
  if cfg.smoke or not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      saved = json.load(f)
    config = saved.pop("config")
  except (ValueError, KeyError, AttributeError, TypeError) as e:  # not what save_partial writes: kept aside
    aside = aside_name(path, ".unreadable")
    os.rename(path, aside)
    warnings.warn(f"{path} is unreadable ({type(e).__name__}); moved to {aside}, starting over", stacklevel=2)
    return None
  return saved if config == _as_saved(cfg) else None


def _as_saved(cfg) -> dict:
  """`cfg` as partial.json holds it (JSON: tuples as lists), to compare with a saved config."""
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def save_partial(cfg, **data):
  """`cfg.out`/partial.json: the config and `data` (JSON, numbers as floats), replaced whole (a run stopped while
  writing keeps the previous file)."""
  os.makedirs(cfg.out, exist_ok=True)
  tmp = os.path.join(cfg.out, f".{PARTIAL}.tmp")
  with open(tmp, "w") as f:
    json.dump({"config": dataclasses.asdict(cfg), **data}, f, default=float)
  os.replace(tmp, os.path.join(cfg.out, PARTIAL))


def kept_after_interrupt(cfg) -> str:
  """What an interrupted full run kept, for its one line: this config's partial.json (what finished), or nothing."""
  path = os.path.join(cfg.out, PARTIAL)
  try:
    with open(path) as f:
      saved = json.load(f)["config"]
  except (OSError, ValueError, KeyError, TypeError):
    saved = None
  if saved == _as_saved(cfg):
    return f"what finished is kept in {path}; rerun the same command to go on"
  return "nothing finished was kept: a rerun starts over"


def drop_partial(cfg):
  """Removes partial.json once the full run's results are written."""
  os.remove(os.path.join(cfg.out, PARTIAL))
