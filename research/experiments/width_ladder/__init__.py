"""The width ladder ("does the win survive scale?"): `study.py` runs it (its docstring is the protocol), `report.py`
turns what finished into verdicts with `research.verdicts`, `tables.py` and `plots.py` show them, `papers.py` reads
them against the papers the ladder answers.

  python -m research.experiments.width_ladder            # full size: writes research/results/width_ladder/
  python -m research.experiments.width_ladder --smoke    # a minute; writes nothing (the tests run this)
"""

from research.experiments.width_ladder.study import CONTENDERS, NAME, SMOKE, Config, Ladder, main

__all__ = ["CONTENDERS", "Config", "Ladder", "NAME", "SMOKE", "main"]
