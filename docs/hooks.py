"""mkdocs hooks: pages that show what the code says, read at build time so they cannot fall behind it.

`<!-- help: python -m MODULE [ARGS] -->` in a page becomes that command's `--help`, as the terminal shows it at 120
columns (tyro's groups, one per config section), in a code block.

The navigation's lists of records and notebooks are generated from the files (`on_config`), not kept by hand: the
"Benchmarks" section gets every research/results/*.md, "Experiments and results" every experiment folder's
results.md and its other pages, "Notebooks" every docs/notebooks/*.ipynb (the first steps first). A new experiment,
record or notebook appears with no edit of mkdocs.yml.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_NOTEBOOKS = ("quickstart", "pretrained", "optimizers")  # where a reader starts; the rest alphabetical
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


def _title(*parts: str) -> str:
  return " / ".join(p.replace("_", " ") for p in parts)


def _benchmarks(docs: str) -> list[dict]:
  """Every record at the top of research/results (a benchmark's table and the command that made it)."""
  folder = os.path.join(docs, "results")
  return [{_title(f[:-3]): f"results/{f}"} for f in sorted(os.listdir(folder))
          if f.endswith(".md") and os.path.isfile(os.path.join(folder, f))]


def _experiments(docs: str) -> list[dict]:
  """Each experiment folder's results.md, then its other pages (runs/ left out: working files, not records)."""
  folder, out = os.path.join(docs, "results"), []
  for name in sorted(os.listdir(folder)):
    if not os.path.isdir(os.path.join(folder, name)):
      continue
    pages = []
    for sub, dirs, files in os.walk(os.path.join(folder, name)):
      dirs[:] = sorted(d for d in dirs if d != "runs")
      pages += [os.path.relpath(os.path.join(sub, f), folder) for f in files if f.endswith(".md")]
    main = f"{name}/results.md"
    for page in sorted(pages, key=lambda p: (p != main, p)):
      out.append({_title(name) if page == main else _title(*page[:-3].split(os.sep)): f"results/{page}"})
  return out


def _notebooks(docs: str) -> list[dict]:
  names = sorted(f[:-6] for f in os.listdir(os.path.join(docs, "notebooks")) if f.endswith(".ipynb"))
  names = [n for n in FIRST_NOTEBOOKS if n in names] + [n for n in names if n not in FIRST_NOTEBOOKS]
  return [{n: f"notebooks/{n}.ipynb"} for n in names]


GENERATED = {"Benchmarks": _benchmarks, "Experiments and results": _experiments, "Notebooks": _notebooks}


def on_config(config, **kwargs):
  """Appends the generated entries to the navigation's sections named in `GENERATED` (after their index page)."""
  for section in config["nav"]:
    if isinstance(section, dict):
      (title, entries), = section.items()
      if title in GENERATED:
        section[title] = [*(entries or []), *GENERATED[title](config["docs_dir"])]
  return config
