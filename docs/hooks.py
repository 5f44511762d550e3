"""mkdocs hooks: pages that show what the code says, read at build time so they cannot fall behind it.

`<!-- help: python -m MODULE [ARGS] -->` in a page becomes that command's `--help`, as the terminal shows it at 120
columns (tyro's groups, one per config section), in a code block.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP = re.compile(r"<!-- help: python -m ([\w.]+)((?: [\w-]+)*) -->")


def _help(match: re.Match) -> str:
  cmd = [sys.executable, "-m", match.group(1), *match.group(2).split(), "--help"]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "120"})
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd[1:])} failed: {out.stderr.strip().splitlines()[-1:]}")
  return "```text\n" + out.stdout.rstrip() + "\n```"


def on_page_markdown(markdown: str, **kwargs) -> str:
  """Replaces each help placeholder by the command's --help output."""
  return HELP.sub(_help, markdown)
