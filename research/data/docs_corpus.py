"""A second text corpus for fine-tuning, built from packages the project already installs: the long descriptions
(README and changelog prose, Markdown or reStructuredText) in the metadata of optlab's runtime dependencies.

Why this one: every machine that can run optlab has it (`make run` installs these packages; nothing is downloaded),
and it is a domain shift from the default corpus (`research.data`, the standard library's Python source): English
prose with Markdown/reST markup, install commands, changelog entries and URLs, against indented code. A model
pretrained on the standard library starts it at a clearly higher loss (research/results/badam_finetune/).

    python -m research.data.docs_corpus             # builds it (once) and prints the directory to pass to --data

One file per distribution, `<name>.md`, holding "name version: summary" and the description; distributions whose
description is shorter than `MIN_CHARS` (a one-line placeholder) are left out. The set is the transitive closure of
`optlab`'s requirements without extras, so it is the same in a run-only and a test environment; the directory name
carries a hash of the (name, version) list, so a changed environment builds a new corpus instead of mixing two. The
texts are made anew at every `build` (reading the installed metadata), and a directory that does not hold exactly them
(a file edited, zeroed, missing or added) is built again, with one warning line: it is never served as it is.
`research.data.load_corpus(path)` splits it by document (a held-out package is never seen in training).
Pure Python; imports no jax.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import sys
import tempfile

from packaging.requirements import Requirement

from research import entry
from research.data.cache import default_cache_dir
from research.data.corpus import DataError

ROOT = "optlab"
MIN_CHARS = 500


def _key(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions(root: str = ROOT) -> list[md.Distribution]:
  """`root`'s installed distribution and every runtime requirement below it (markers evaluated without extras),
  sorted by normalised name; `root` itself is not included."""
  try:
    md.distribution(root)
  except md.PackageNotFoundError:
    raise DataError(f"{root} is not installed as a package (pip install -e .); its requirements list the corpus") \
        from None
  seen, todo = {}, [root]
  while todo:
    name = todo.pop()
    if _key(name) in seen:
      continue
    try:
      dist = md.distribution(name)
    except md.PackageNotFoundError:  # an optional requirement of a dependency that is not installed
      continue
    seen[_key(name)] = dist
    for line in dist.requires or []:
      req = Requirement(line)
      if req.marker is None or req.marker.evaluate({"extra": ""}):
        todo.append(req.name)
  return [seen[k] for k in sorted(seen) if k != _key(root)]


def document(dist: md.Distribution) -> str | None:
  """"name version: summary", a blank line and the long description; None if the description is a placeholder."""
  meta = dist.metadata
  body = meta.get_payload() or meta.get("Description") or ""
  if len(body.strip()) < MIN_CHARS:
    return None
  return f"{meta['Name']} {dist.version}: {meta.get('Summary') or ''}".rstrip() + "\n\n" + body.strip() + "\n"


LICENSE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE)", re.I)


def license_document(dist: md.Distribution) -> str | None:
  """"name version license", a blank line and the distribution's license files (LICENSE*, COPYING*, NOTICE*: each
  text once); None when it ships none of at least MIN_CHARS."""
  texts = []
  for f in dist.files or []:
    if LICENSE_FILE.match(os.path.basename(str(f))):
      try:
        text = f.read_text(encoding="utf-8").strip()
      except (OSError, UnicodeDecodeError):
        continue
      if text and text not in texts:
        texts.append(text)
  body = "\n\n".join(texts)
  if len(body) < MIN_CHARS:
    return None
  return f"{dist.metadata['Name']} {dist.version} license\n\n{body}\n"


KINDS = {"descriptions": ("docs", document), "licenses": ("licenses", license_document)}


def build(cache_dir: str | None = None, kind: str = "descriptions") -> str:
  """The corpus directory under `cache_dir` (default: the data cache), written once and atomically: the
  distributions' long descriptions (`docs-<id>`), or their license texts (`licenses-<id>`: a third corpus, legal
  prose that repeats itself across packages)."""
  prefix, make = KINDS[kind]
  docs = {_key(d.metadata["Name"]): (d.version, make(d)) for d in runtime_distributions()}
  docs = {k: v for k, v in docs.items() if v[1] is not None}
  ident = hashlib.sha256("\n".join(f"{k}=={v}" for k, (v, _) in sorted(docs.items())).encode()).hexdigest()[:16]
  cache_dir = cache_dir or default_cache_dir()
  out = os.path.join(cache_dir, f"{prefix}-{ident}")
  want = {f"{k}.md": text.encode("utf-8") for k, (_, text) in docs.items()}
  if os.path.isdir(out):
    problem = _differs(out, want)
    if problem is None:
      return out
    print(f"warning: the corpus {out} is not the installed packages' {kind} ({problem}); building it again",
          file=sys.stderr, flush=True)
  os.makedirs(cache_dir, exist_ok=True)
  tmp, aside = tempfile.mkdtemp(prefix=f".{prefix}-", dir=cache_dir), None
  try:
    for name, data in want.items():
      with open(os.path.join(tmp, name), "wb") as f:
        f.write(data)
    if os.path.isdir(out):  # the damaged copy: moved aside in one rename, then deleted
      aside = tempfile.mkdtemp(prefix=f".{prefix}-damaged-", dir=cache_dir)
      os.rename(out, os.path.join(aside, "old"))
    os.rename(tmp, out)  # a concurrent builder may have won: its copy is identical
  except OSError:
    shutil.rmtree(tmp, ignore_errors=True)
    if not os.path.isdir(out):
      raise
  finally:
    if aside:
      shutil.rmtree(aside, ignore_errors=True)
  return out


def _differs(folder: str, want: dict[str, bytes]) -> str | None:
  """What keeps the corpus `folder` from being the files `want` ({name: bytes}) and nothing else, or None."""
  have = sorted(f for f in os.listdir(folder) if not f.startswith("."))  # hidden files are not read as documents
  if have != sorted(want):
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    return ", ".join(f"{len(names)} {what} ({names[0]}{', ...' if len(names) > 1 else ''})"
                     for what, names in (("missing", missing), ("not its own", extra)) if names)
  for name in sorted(want):
    try:
      with open(os.path.join(folder, name), "rb") as f:
        if f.read() != want[name]:
          return f"{name} differs from the installed package's metadata"
    except OSError as e:
      return f"{name} is unreadable ({e.strerror})"
  return None


def main(argv=None) -> int:
  from research.data import load_corpus
  args = sys.argv[1:] if argv is None else argv
  if args in (["-h"], ["--help"]):
    print("usage: python -m research.data.docs_corpus [CACHE_DIR]\n\n" + (__doc__ or "").split("\n\n")[0])
    return 0
  with entry.one_line_errors(OSError):
    if len(args) > 1 or (args and args[0].startswith("-")):
      raise entry.UsageError("usage: python -m research.data.docs_corpus [CACHE_DIR]")
    path = build(args[0] if args else None)
  corpus = load_corpus(path)
  docs = sorted(os.listdir(path))
  print(f"{path}\n{len(docs)} documents, {len(corpus.train):,} train bytes, {len(corpus.val):,} val bytes",
        file=sys.stderr)
  print(path)
  return 0


if __name__ == "__main__":
  entry.command(main)
