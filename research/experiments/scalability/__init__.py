"""The scalability study ("Dataset Matters", arXiv 1910.11510): `study.py` runs it (its docstring is the protocol),
`convex.py` is its logistic-regression case, `report.py` its tables, findings and plots.

  python -m research.experiments.scalability            # full size: writes research/results/scalability/
  python -m research.experiments.scalability --smoke    # a minute; writes nothing (the tests run this)
"""

from research.experiments.scalability.study import (
                                                    ALGORITHMS,
                                                    LM_ALGORITHMS,
                                                    LM_DATASETS,
                                                    NAME,
                                                    QUESTION,
                                                    SMOKE,
                                                    Config,
                                                    main,
                                                    predicted_speedup,
                                                    steps_to,
                                                    sync_flag,
)

__all__ = ["ALGORITHMS", "Config", "LM_ALGORITHMS", "LM_DATASETS", "NAME", "QUESTION", "SMOKE", "main",
           "predicted_speedup", "steps_to", "sync_flag"]
