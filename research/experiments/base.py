"""The flags every experiment shares: each experiment's `Config` extends `Base`, and its own fields follow these.

Only what every experiment means the same way lives here: --smoke and --out. Seeds, steps, batch and sequence sizes,
lrs and evaluation sizes recur too, but with an experiment's own default, meaning and place in --help (a base
field comes first in every subclass, and `dataclasses.asdict(cfg)`, which results record, keeps that order), so
each experiment declares them. An experiment redeclares `out` with its own default, keeping the doc given here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Base:
  """An experiment's command line: `python -m research.experiments.NAME [--smoke] [--out DIR] ...`."""
  smoke: bool = False
  """Tiny sizes on the same code path, in seconds (what the tests and the notebook run); writes nothing."""
  out: str = "research/results"
  """Where a full run writes results.md, results.json and its plots."""
