"""The experiments: `python -m research.experiments.NAME`, each a module here (or a package with a `__main__.py`) whose
`Config` extends `base.Base`, with its notebook at notebooks/NAME.py and its record under research/results/NAME/.

`NAMES` is read from the files, not kept by hand: the flag tests, the entry checks and the notebook tests take every
experiment from it, so a new one is covered with no edit of a list (tests/research/test_flags.py).
"""

from __future__ import annotations

import pathlib

_HERE = pathlib.Path(__file__).parent


def _names() -> tuple[str, ...]:
  """Every module of this package that runs as a command, and every subpackage with a `__main__.py`."""
  modules = [p.stem for p in _HERE.glob("*.py") if '\nif __name__ == "__main__":' in p.read_text()]
  packages = [p.parent.name for p in _HERE.glob("*/__main__.py")]
  return tuple(sorted(modules + packages))


NAMES = _names()
