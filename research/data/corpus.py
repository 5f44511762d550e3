"""The byte-level corpus: files, token arrays or the standard library read into a train/val `Corpus`.

`read_corpus()` with no path builds the default corpus from the running interpreter's own
standard library (every `*.py` file, site-packages excluded), so a fresh checkout trains with
no download; the build is cached on disk and memory-mapped afterwards (its contents checked against meta.json's
fingerprint the first time a process maps it: `checked_meta`; a cache that fails is rebuilt). A user path here may be a
directory of text files (only its text files are read — UTF-8 without NUL bytes — through folders that are not
hidden, caches or installed packages; what is skipped is said in one line on stderr, and a directory without any
text is refused), one text file, a 1-D integer `.npy`, or a nanoGPT-style uint16 `.bin`;
Parquet, JSON Lines, Arrow and `datasets` directories, globs and several paths are read by
`research.data.shards` instead (`research.data.load_corpus` picks).

Tokenizing it is `research.data.tokenized`; `research.data.load_corpus` does both. Pure numpy; imports no jax.
"""

import codecs
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig

import numpy as np

from research.data.cache import cache_writable, checked_meta, default_cache_dir, warn_rebuild, write_atomic

SEPARATOR = 0  # byte appended after every document: a boundary the model can learn
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_CACHE_VERSION = 1  # bump when the on-disk layout or the build rule changes


class DataError(ValueError):
  """Bad data input; the message is one line naming the offending path or value."""


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: fields are arrays, compare by identity
class Corpus:
  train: np.ndarray  # 1-D tokens: uint8 bytes, or the dtype of a pre-tokenized array
  val: np.ndarray  # 1-D, same dtype as train
  vocab_size: int
  fingerprint: str  # sha256 hex of train bytes then val bytes: identifies the data in run records
  source: str  # "stdlib:<dir>" or the resolved user path
  eos: int | None = None  # the token that ends every document (SEPARATOR on bytes, the tokenizer's end-of-text)
  train_docs: np.ndarray | None = None  # int64 start offset of each document in `train` (None: not recorded)
  val_docs: np.ndarray | None = None  # the same for `val`


def read_corpus(path: str | None = None, *, cache_dir: str | None = None, val_fraction: float = 0.05) -> Corpus:
  """The byte corpus `load_corpus` starts from (no tokenizer): the stdlib corpus (path=None) or a user path, split
  into train and val; the arguments are `load_corpus`'s."""
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
  return _load_stdlib(cache_dir, val_fraction) if path is None else _load_path(path, val_fraction)


def _load_path(path, val_fraction) -> Corpus:
  path = os.path.expanduser(os.fspath(path))
  if not os.path.exists(path):
    raise DataError(f"data path does not exist: {path}")
  source = os.path.realpath(path)
  if os.path.isdir(path):
    relpaths = _walk(path, keep_file=not_hidden, keep_dir=source_dir)
    if not relpaths:
      raise DataError(f"data directory is empty (no non-hidden files): {path}")
    if sum(os.path.getsize(os.path.join(path, r)) for r in relpaths) == 0:
      raise DataError(f"data directory is empty (all files have zero bytes): {path}")
    texts = _text_files(path, relpaths)  # each file read once: checked here, joined below
    relpaths = list(texts)
    if len(relpaths) < 2:  # one document cannot be split by document
      train, val = _split_by_position(_read_docs(path, relpaths, texts.get), val_fraction, path)
    else:
      train, val = _split_by_document(path, relpaths, val_fraction, texts.get)
    vocab, eos = 256, SEPARATOR
  elif path.endswith(".npy"):
    try:
      arr = np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as e:  # object arrays (pickles), corrupt or truncated files
      raise DataError(f"cannot read {path} as a numpy token array: {' '.join(str(e).split())}"
                      ) from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise DataError(f"{path} must hold a 1-D integer token array, got shape {arr.shape} "
                      f"dtype {arr.dtype}")
    return _token_file(arr, val_fraction, path, source)  # a token array's document boundaries are unknown: no eos
  elif path.endswith(".bin"):
    size = os.path.getsize(path)
    if size % 2:
      raise DataError(f"{path} has an odd size ({size} bytes); a .bin must be raw uint16 tokens")
    if size == 0:
      raise DataError(f"data file is empty: {path}")
    return _token_file(np.memmap(path, dtype=np.uint16, mode="r"), val_fraction, path, source)
  else:
    data = np.fromfile(path, dtype=np.uint8)
    if data.size == 0:
      raise DataError(f"data file is empty: {path}")
    train, val = _split_by_position(data, val_fraction, path)
    vocab, eos = 256, SEPARATOR
  return Corpus(train, val, vocab, corpus_fingerprint(train, val), source, eos=eos)


def _token_file(arr: np.memmap, val_fraction, path, source) -> Corpus:
  """A memory-mapped token array split by position, its ids checked and its fingerprint taken in one read of the
  file in chunks (reads, not the map: a corpus larger than RAM never becomes resident memory of this process)."""
  if arr.size == 0:
    raise DataError(f"data file is empty: {path}")
  lo, hi, fingerprint = _scan(path, arr.offset, arr.dtype, arr.size)
  if lo < 0:
    raise DataError(f"{path} contains a negative token id ({lo})")
  train, val = _split_by_position(arr, val_fraction, path)
  return Corpus(train, val, max(256, hi + 1), fingerprint, source)  # train then val: the file's bytes in order


def _scan(path, offset: int, dtype, count: int, chunk: int = 1 << 26):
  """(min, max, sha256 hex) of `count` items of `dtype` at byte `offset` of `path`."""
  h, lo, hi, itemsize = hashlib.sha256(), None, None, np.dtype(dtype).itemsize
  with open(path, "rb") as f:
    f.seek(offset)
    left = count * itemsize
    while left:
      data = f.read(min(chunk - chunk % itemsize, left))
      if not data:
        raise DataError(f"{path} is shorter than its header says (truncated?)")
      left -= len(data)
      h.update(data)
      part = np.frombuffer(data, dtype)
      lo = int(part.min()) if lo is None else min(lo, int(part.min()))
      hi = int(part.max()) if hi is None else max(hi, int(part.max()))
  return lo, hi, h.hexdigest()


def _split_by_position(arr, val_fraction, path):
  n_val = math.ceil(len(arr) * val_fraction)
  train, val = arr[:len(arr) - n_val], arr[len(arr) - n_val:]
  _check_split(train, val, path, f"{len(arr)} tokens")
  return train, val


def _check_split(train, val, where, what):
  for name, part in (("train", train), ("val", val)):
    if len(part) == 0:
      raise DataError(f"the {name} split of {where} is empty ({what}); change val_fraction "
                      "or add data")


def _is_val(relpath: str, val_fraction: float) -> bool:
  return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def _walk(root, keep_file, keep_dir):
  """Sorted posix relpaths of the regular files under root that pass the name filters."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if keep_dir(d)]  # prunes the walk, not just the output
    rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
    out += [f if rel == "." else f"{rel}/{f}" for f in filenames
            if keep_file(f) and os.path.isfile(os.path.join(dirpath, f))]
  return sorted(out)


def not_hidden(name):
  return not name.startswith(".")


CACHE_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})


def source_dir(name):
  """A folder a text directory is read through: not hidden (.git, .venv, ...) and not a cache or installed packages."""
  return not_hidden(name) and name not in CACHE_DIRS


def is_text(data: bytes, whole: bool = True) -> bool:
  """Text: no NUL byte and valid UTF-8 (ASCII included); what a bytes-level language model should read. `whole`
  False: `data` is a file's first bytes, and a character cut at their end is allowed."""
  if b"\0" in data:
    return False
  try:
    codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
  except UnicodeDecodeError:
    return False
  return True


def _text_files(root, relpaths) -> dict[str, bytes]:
  """{relpath: contents} of the text files among `relpaths` (`is_text`), in order; what was left out is said in one
  line on stderr, and a directory with no text file at all is refused (DataError)."""
  text: dict[str, bytes] = {}
  skipped: dict[str, tuple[int, int]] = {}
  for r in relpaths:
    data = _read(root, r)
    if is_text(data):
      text[r] = data
    else:
      ext = os.path.splitext(r)[1] or "(no suffix)"
      n, size = skipped.get(ext, (0, 0))
      skipped[ext] = (n + 1, size + os.path.getsize(os.path.join(root, r)))
  kinds = ", ".join(f"{n} {ext}" for ext, (n, _) in sorted(skipped.items(), key=lambda kv: -kv[1][0]))
  if not text:
    raise DataError(f"data directory {root} has no text files (UTF-8 without NUL bytes): {kinds}")
  if skipped:
    size = sum(b for _, b in skipped.values())
    print(f"data: {root}: read {len(text)} text files, skipped {sum(n for n, _ in skipped.values())} that are not text "
          f"({kinds}; {size:,} bytes)", file=sys.stderr, flush=True)
  return text


def _read_docs(root, relpaths, read=None):
  """The documents joined, each followed by SEPARATOR; `read(relpath)` gives a document's bytes (default: the file)."""
  read = read or (lambda r: _read(root, r))
  sep = bytes([SEPARATOR])
  return np.frombuffer(b"".join(read(r) + sep for r in relpaths), dtype=np.uint8)


def _read(root, relpath):
  with open(os.path.join(root, relpath), "rb") as f:
    return f.read()


def _split_by_document(root, relpaths, val_fraction, read=None):
  is_val = [_is_val(r, val_fraction) for r in relpaths]
  train = _read_docs(root, [r for r, v in zip(relpaths, is_val) if not v], read)
  val = _read_docs(root, [r for r, v in zip(relpaths, is_val) if v], read)
  _check_split(train, val, root, f"{len(relpaths)} files split by path hash")
  return train, val


def corpus_fingerprint(train, val):
  h = hashlib.sha256()
  for part in (train, val):
    h.update(np.ascontiguousarray(part).data)
  return h.hexdigest()


def _load_stdlib(cache_dir, val_fraction):
  root = sysconfig.get_paths()["stdlib"]
  relpaths = _walk(root, keep_file=lambda f: f.endswith(".py"),
                   keep_dir=lambda d: d not in _EXCLUDED_DIRS)
  if not relpaths:
    raise DataError(f"no *.py files found under the standard library at {root}")
  # Stat-only key: a different Python, an edited stdlib or another split gets its own cache.
  stats = [(r, s.st_size, s.st_mtime_ns)
           for r in relpaths for s in [os.stat(os.path.join(root, r))]]
  key = hashlib.sha256(json.dumps(
      [_CACHE_VERSION, root, sys.version, val_fraction, stats]).encode()).hexdigest()
  cache_root = os.path.expanduser(cache_dir or default_cache_dir())
  folder = os.path.join(cache_root, f"stdlib-{key[:24]}")
  source = f"stdlib:{root}"
  cached, problem = _read_cache(folder)
  if cached is not None:
    return Corpus(*cached, source=source, eos=SEPARATOR)
  if problem:
    warn_rebuild(folder, problem)
  train, val = _split_by_document(root, relpaths, val_fraction)
  fingerprint = corpus_fingerprint(train, val)
  meta = dict(fingerprint=fingerprint, train_bytes=len(train), val_bytes=len(val),
              n_files=len(relpaths), n_val_files=sum(_is_val(r, val_fraction) for r in relpaths),
              source=source, python=sys.version)
  if not write_cache(cache_root, folder, train, val, meta):
    return Corpus(train, val, 256, fingerprint, source, eos=SEPARATOR)
  cached, _ = _read_cache(folder)  # serve the memmap, so a build and a hit behave alike
  return (Corpus(*cached, source=source, eos=SEPARATOR) if cached
          else Corpus(train, val, 256, fingerprint, source, eos=SEPARATOR))


def write_cache(cache_root: str, folder: str, train: np.ndarray, val: np.ndarray, meta: dict) -> bool:
  """Writes a built corpus into its cache `folder` under `cache_root`: train.bin, val.bin, then meta.json (last: it
  marks the folder valid), each whole or not at all. False when the cache cannot be written (`cache_writable`'s one
  warning): a read-only cache costs a rebuild next time, not the run."""
  try:
    os.makedirs(folder, exist_ok=True)
    write_atomic(folder, "train.bin", train.tobytes())
    write_atomic(folder, "val.bin", val.tobytes())
    write_atomic(folder, "meta.json", json.dumps(meta, indent=1).encode())
  except OSError as e:
    cache_writable(cache_root, e)
    return False
  return True


def _read_cache(folder):
  """((train memmap, val memmap, 256, fingerprint), None) when meta.json is there and the files are what it records
  (`checked_meta`), else (None, what failed; None when there is no meta.json: no finished build)."""
  meta, problem = checked_meta(folder, lambda m: {"train.bin": m["train_bytes"], "val.bin": m["val_bytes"]})
  if meta is None:
    return None, problem
  return (*(np.memmap(os.path.join(folder, n), dtype=np.uint8, mode="r") for n in ("train.bin", "val.bin")), 256,
          meta["fingerprint"]), None
