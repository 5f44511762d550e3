"""Where names appear in the code: the scan behind the tests that the trainer and the library act on declarations,
never on an optimizer's, update argument's or PEFT method's name."""

import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_tokens(path: str):
  """(line, text) of every name, string and comment token of a file, but attribute names (`optax.sgd` is optax's)."""
  previous = None
  for tok in tokenize.generate_tokens(io.StringIO(open(path).read()).readline):
    kinds = (tokenize.NAME, tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1))
    if tok.type in kinds and not (tok.type == tokenize.NAME and previous == "."):
      yield tok.start[0], tok.string
    previous = tok.string


def names_in(folder: str, names, skip: str | None = None) -> list[str]:
  """Every occurrence of one of `names` as a name, string or comment in the Python files under `folder`.

  Args:
    folder: relative to the repository's root (or absolute).
    names: the names looked for (whole words).
    skip: one file left out (the declarations' own module), relative to the root.

  Returns:
    "path:line: name" for each occurrence.
  """
  pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?!\w)")
  found = []
  for sub, _, files in os.walk(os.path.join(ROOT, folder)):
    for f in sorted(files):
      path = os.path.join(sub, f)
      if f.endswith(".py") and os.path.relpath(path, ROOT) != skip:
        found += [f"{os.path.relpath(path, ROOT)}:{line}: {m}" for line, text in code_tokens(path)
                  for m in pattern.findall(text)]
  return found
