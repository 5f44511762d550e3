"""Every `python -m ...` command shown in README.md and the site's pages (docs/, without the run records under
docs/results/, which keep the commands their runs were made with) is checked against the real parser: the module
exists, a subcommand it names is one the parser offers, and every flag is one that command's `--help` lists. A
misspelt flag in the documentation fails here (`test_a_misspelt_flag_is_caught` shows the checker catching one).
`make run ARGS="..."` lines count as `python -m research.train` (the Makefile's run target)."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("research", "optim", "models", "sharding")
STOP = {"|", "&&", ";", ">", ">>", "2>&1", "||"}


def documents() -> list[Path]:
  """README.md and every page of the site, without the run records (docs/results/) and rendered notebooks."""
  pages = [p for p in (ROOT / "docs").rglob("*.md") if p.relative_to(ROOT / "docs").parts[0] not in ("results",)]
  return [ROOT / "README.md", *sorted(pages)]


def commands(text: str) -> list[list[str]]:
  """The `python -m MODULE ...` commands of a markdown text, each as its tokens from MODULE on.

  Fenced code lines (with backslash continuations joined and comments dropped) and inline code spans both count.
  `make run ARGS="..."` is read as `python -m research.train ...`.
  """
  found = []
  pieces = []
  for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
    pieces += block.replace("\\\n", " ").splitlines()
  pieces += re.findall(r"`([^`\n]*(?:python -m |make run ARGS=)[^`\n]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
  for line in pieces:
    try:
      tokens = shlex.split(line, comments=True)
    except ValueError:
      tokens = line.split()
    for i, tok in enumerate(tokens):
      if tok == "-m" and i > 0 and tokens[i - 1].endswith("python") and i + 1 < len(tokens):
        rest = tokens[i + 1:]
        end = next((k for k, t in enumerate(rest) if t in STOP), len(rest))
        found.append(rest[:end])
      elif tok == "make" and i + 2 < len(tokens) + 1 and tokens[i + 1:i + 2] == ["run"]:
        args = next((t[5:] for t in tokens[i + 2:] if t.startswith("ARGS=")), None)
        if args is not None:
          found.append(["research.train", *shlex.split(args)])
  return found


HELPS: dict[tuple[str, str | None], tuple[int, str, str]] = {}  # (module, sub) -> (exit status, stdout, stderr)


def run_helps(pairs) -> None:
  """Runs `python -m MODULE [SUB] --help` for every new pair at 120 columns, all in one child process
  (tests/docs/help_texts.py: one start-up and one import of JAX in all, where a process each cost ~100 s of the
  suite), into HELPS."""
  todo = sorted({p for p in pairs if p not in HELPS}, key=str)
  if todo:
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("help_texts.py"))], input=json.dumps(todo),
                           capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "120"}, check=True)
    got = json.loads(child.stdout)
    HELPS.update({(m, s): tuple(got[f"{m} {s or ''}"]) for m, s in todo})


def help_text(module: str, sub: str | None) -> str:
  """`python -m MODULE [SUB] --help` at 120 columns (raises if it fails)."""
  run_helps([(module, sub)])
  code, out, err = HELPS[module, sub]
  assert code == 0, f"-m {module}{' ' + sub if sub else ''} --help exits {code}: {err.strip()[-300:]}"
  return out


def subcommands(module: str) -> set[str]:
  """The subcommands a module's parser offers (its usage line's positional {a,b,...}), or an empty set."""
  usage = help_text(module, None).split("\n\n")[0]
  m = re.search(r"\[-h\] \{([\w,-]+)\}", usage)  # not a flag's choices (`--out {None}|STR`)
  return set(m.group(1).split(",")) if m else set()


def is_placeholder(token: str) -> bool:
  """A documentation placeholder rather than a literal (NAME, <name>, ...)."""
  return token in ("...", "…") or "<" in token or (token.isupper() and token.isalpha())


def problems(command: list[str]) -> list[str]:
  """What is wrong with one documented command (tokens from the module on); empty if it parses."""
  module, args = command[0], command[1:]
  if is_placeholder(module) or module.endswith("."):
    return []
  if importlib.util.find_spec(module) is None:
    return [f"python -m {module}: no such module"]
  if not module.startswith(OURS):
    return []
  sub = None
  offered = subcommands(module)
  if offered and args and not args[0].startswith("-"):
    sub = args[0]
    if is_placeholder(sub):
      return []
    if sub not in offered:
      return [f"python -m {module} {sub}: no such subcommand (offered: {', '.join(sorted(offered))})"]
  listed = set(re.findall(r"(--[a-z][\w.-]*)", help_text(module, sub)))
  wrong = []
  for tok in args:
    if tok.startswith("--") and not is_placeholder(tok[2:]):
      flag = tok.split("=")[0]
      if flag not in listed and not (flag.startswith("--no-") and "--" + flag[5:] in listed) and flag != "--help":
        wrong.append(f"python -m {module}{' ' + sub if sub else ''}: {flag} is not a flag its --help lists")
  return wrong


def all_commands() -> list[tuple[str, list[str]]]:
  """(document, command) for every command in the README and the site's pages."""
  return [(str(p.relative_to(ROOT)), c) for p in documents() for c in commands(p.read_text())]


def test_every_documented_command_parses():
  found = all_commands()
  assert len(found) > 60, f"only {len(found)} commands found: the extraction is broken"
  ours = [c for _, c in found if c[0].startswith(OURS) and not is_placeholder(c[0]) and not c[0].endswith(".")
          and importlib.util.find_spec(c[0]) is not None]
  run_helps((c[0], None) for c in ours)  # the modules' own --help first: they name the subcommands
  run_helps((c[0], c[1]) for c in ours if len(c) > 1 and c[1] in subcommands(c[0]))
  wrong = [f"{doc}: {p}" for doc, c in found for p in problems(c)]
  assert wrong == []


def test_a_misspelt_flag_is_caught():
  text = ("```bash\npython -m research.train --stepz 10 --model tiny\n```\n"
          "and `python -m research.bench optm --out x.md`, `make run ARGS=\"--amend --lrr 3e-3\"`")
  found = commands(text)
  assert found == [["research.train", "--stepz", "10", "--model", "tiny"], ["research.bench", "optm", "--out", "x.md"],
                   ["research.train", "--amend", "--lrr", "3e-3"]]
  assert [p for c in found for p in problems(c)] == [
      "python -m research.train: --stepz is not a flag its --help lists",
      "python -m research.bench optm: no such subcommand (offered: attention, cache, ckpt, comm, coordcheck, data, "
      "dion, finetune, finetune-3b, hf, moe, optim, peer, preflight, quant, reshard, sample, train, vmap)",
      "python -m research.train: --lrr is not a flag its --help lists"]
