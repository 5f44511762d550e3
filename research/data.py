"""The byte-level training corpus (vocab 256, or a tokenizer's: `research.tokenized`) and its stateless batch
sampler.

`load_corpus()` with no path builds the default corpus from the running interpreter's own
standard library (every `*.py` file, site-packages excluded), so a fresh checkout trains with
no download; the build is cached on disk and memory-mapped afterwards. A user path may be a
directory of text files, one text file, a 1-D integer `.npy`, or a nanoGPT-style uint16 `.bin`.

`get_batch` is a pure function of (seed, step): resuming a run needs no iterator state.
`eval_batches` is seed-independent, so every evaluation sees the same held-out windows.
Pure numpy; imports no jax.
"""

import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import warnings

import numpy as np

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


def load_corpus(path: str | None = None, *, cache_dir: str | None = None, val_fraction: float = 0.05,
                tokenizer: str | None = None) -> Corpus:
  """Loads the default stdlib corpus (path=None) or a user corpus, split into train and val.

  Args:
    path: None for the stdlib corpus; else a directory, a text file, a `.npy` or a `.bin`.
    cache_dir: where the stdlib corpus is cached; default `$OPTLAB_CACHE` or ~/.cache/optlab.
    tokenizer: a Hugging Face tokenizer.json (or a directory with one) to encode the text with instead of bytes;
      the tokens are cached under cache_dir (`research.tokenized`).
    val_fraction: share held out. Multi-file corpora split by document: a file is val iff
      int(sha256(relpath)) % 10_000 < val_fraction * 10_000, so the split does not move when
      files are added. Single arrays/files split by position: the last ceil(n*val_fraction)
      tokens are val.
  """
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
  corpus = _load_stdlib(cache_dir, val_fraction) if path is None else _load_path(path, val_fraction)
  if tokenizer is None:
    return corpus
  from research.tokenized import tokenize_corpus  # imports this module
  return tokenize_corpus(corpus, tokenizer, cache_dir)


def _load_path(path, val_fraction) -> Corpus:
  path = os.path.expanduser(os.fspath(path))
  if not os.path.exists(path):
    raise DataError(f"data path does not exist: {path}")
  source = os.path.realpath(path)
  if os.path.isdir(path):
    relpaths = _walk(path, keep_file=_not_hidden, keep_dir=_not_hidden)
    if not relpaths:
      raise DataError(f"data directory is empty (no non-hidden files): {path}")
    if sum(os.path.getsize(os.path.join(path, r)) for r in relpaths) == 0:
      raise DataError(f"data directory is empty (all files have zero bytes): {path}")
    if len(relpaths) < 2:  # one document cannot be split by document
      train, val = _split_by_position(_read_docs(path, relpaths), val_fraction, path)
    else:
      train, val = _split_by_document(path, relpaths, val_fraction)
    vocab = 256
  elif path.endswith(".npy"):
    try:
      arr = np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as e:  # object arrays (pickles), corrupt or truncated files
      raise DataError(f"cannot read {path} as a numpy token array: {' '.join(str(e).split())}"
                      ) from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise DataError(f"{path} must hold a 1-D integer token array, got shape {arr.shape} "
                      f"dtype {arr.dtype}")
    train, val, vocab = _split_tokens(arr, val_fraction, path)
  elif path.endswith(".bin"):
    size = os.path.getsize(path)
    if size % 2:
      raise DataError(f"{path} has an odd size ({size} bytes); a .bin must be raw uint16 tokens")
    if size == 0:
      raise DataError(f"data file is empty: {path}")
    train, val, vocab = _split_tokens(np.memmap(path, dtype=np.uint16, mode="r"), val_fraction,
                                      path)
  else:
    data = np.fromfile(path, dtype=np.uint8)
    if data.size == 0:
      raise DataError(f"data file is empty: {path}")
    train, val = _split_by_position(data, val_fraction, path)
    vocab = 256
  return Corpus(train, val, vocab, _fingerprint(train, val), source)


def default_cache_dir() -> str:
  """Where built corpora and token caches live: `$OPTLAB_CACHE`, else ~/.cache/optlab."""
  return os.environ.get("OPTLAB_CACHE") or os.path.expanduser("~/.cache/optlab")


ORDERS = ("random", "sequential")


def get_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int,
              seq_len: int, order: str = "random") -> tuple[np.ndarray, np.ndarray]:
  """Training windows, a pure function of (seed, step), so a resumed run replays exactly.

  Returns (x, y), int32 of shape (batch_size, seq_len): windows of seq_len + 1 tokens; x is the window's head, y its
  tail (the next token at every position). `order` "random": starts uniform in [0, len - seq_len - 1], rng =
  default_rng([seed, step]). "sequential": the data read as a stream from a seed-chosen offset, window after window
  (row i of step t is window t·batch_size + i, wrapping around): consecutive rows, and the rows of consecutive steps,
  are adjacent text of the same file (the sampling order of an unshuffled, file-ordered dataset).
  """
  _check_windows(tokens, batch_size, seq_len)
  span = len(tokens) - seq_len - 1
  if order == "sequential":
    offset = np.random.default_rng([seed]).integers(0, span, endpoint=True)
    starts = (offset + (step * batch_size + np.arange(batch_size, dtype=np.int64)) * seq_len) % (span + 1)
  elif order == "random":
    starts = np.random.default_rng([seed, step]).integers(0, span, size=batch_size, endpoint=True)
  else:
    raise DataError(f"sampling order must be one of {', '.join(ORDERS)}, got {order!r}")
  return _gather(tokens, starts, seq_len)


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 num_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Fixed held-out batches: num_batches*batch_size windows evenly spaced over the data."""
  _check_windows(tokens, batch_size, seq_len)
  if num_batches < 1:
    raise DataError(f"num_batches must be >= 1, got {num_batches}")
  starts = np.linspace(0, len(tokens) - seq_len - 1, num_batches * batch_size).astype(np.int64)
  x, y = _gather(tokens, starts, seq_len)
  return [(x[i:i + batch_size], y[i:i + batch_size])
          for i in range(0, num_batches * batch_size, batch_size)]


def _check_windows(tokens, batch_size, seq_len):
  if batch_size < 1 or seq_len < 1:
    raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
  if len(tokens) < seq_len + 1:
    raise DataError(f"sequence length {seq_len} is longer than the data ({len(tokens)} tokens)"
                    f"; a window needs seq_len + 1 = {seq_len + 1} tokens")


def _gather(tokens, starts, seq_len):
  # One fancy-index gather (B, L+1): no Python loop per row; works on a memmap too.
  windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
  return windows[:, :-1], windows[:, 1:]


def _split_tokens(arr, val_fraction, path):
  if arr.size == 0:
    raise DataError(f"data file is empty: {path}")
  lo, hi = int(arr.min()), int(arr.max())
  if lo < 0:
    raise DataError(f"{path} contains a negative token id ({lo})")
  train, val = _split_by_position(arr, val_fraction, path)
  return train, val, max(256, hi + 1)


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


def _not_hidden(name):
  return not name.startswith(".")


def _read_docs(root, relpaths):
  sep = bytes([SEPARATOR])
  return np.frombuffer(b"".join(_read(root, r) + sep for r in relpaths), dtype=np.uint8)


def _read(root, relpath):
  with open(os.path.join(root, relpath), "rb") as f:
    return f.read()


def _split_by_document(root, relpaths, val_fraction):
  is_val = [_is_val(r, val_fraction) for r in relpaths]
  train = _read_docs(root, [r for r, v in zip(relpaths, is_val) if not v])
  val = _read_docs(root, [r for r, v in zip(relpaths, is_val) if v])
  _check_split(train, val, root, f"{len(relpaths)} files split by path hash")
  return train, val


def _fingerprint(train, val):
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
  folder = os.path.join(os.path.expanduser(cache_dir or default_cache_dir()), f"stdlib-{key[:24]}")
  source = f"stdlib:{root}"
  cached = _read_cache(folder)
  if cached is not None:
    return Corpus(*cached, source=source)
  train, val = _split_by_document(root, relpaths, val_fraction)
  fingerprint = _fingerprint(train, val)
  meta = dict(fingerprint=fingerprint, train_bytes=len(train), val_bytes=len(val),
              n_files=len(relpaths), n_val_files=sum(_is_val(r, val_fraction) for r in relpaths),
              source=source, python=sys.version)
  try:
    os.makedirs(folder, exist_ok=True)
    _write_atomic(folder, "train.bin", train.tobytes())
    _write_atomic(folder, "val.bin", val.tobytes())
    _write_atomic(folder, "meta.json", json.dumps(meta, indent=1).encode())  # last: marks valid
  except OSError as e:  # a read-only home should not stop training; it only costs a rebuild
    warnings.warn(f"could not cache the stdlib corpus in {folder}: {e}")
    return Corpus(train, val, 256, fingerprint, source)
  cached = _read_cache(folder)  # serve the memmap, so a build and a hit behave alike
  return Corpus(*cached, source=source) if cached else Corpus(train, val, 256, fingerprint, source)


def _read_cache(folder):
  """(train memmap, val memmap, 256, fingerprint), or None unless meta.json and sizes agree."""
  try:
    with open(os.path.join(folder, "meta.json")) as f:
      meta = json.load(f)
    paths = [os.path.join(folder, n) for n in ("train.bin", "val.bin")]
    sizes = [os.path.getsize(p) for p in paths]
    expected, fingerprint = [meta["train_bytes"], meta["val_bytes"]], meta["fingerprint"]
  except (OSError, ValueError, KeyError, TypeError):  # missing, unreadable or foreign meta
    return None
  if sizes != expected or 0 in sizes:
    return None
  return (*(np.memmap(p, dtype=np.uint8, mode="r") for p in paths), 256, fingerprint)


def _write_atomic(folder, name, data: bytes):
  # Temp file in the same folder, then rename: readers see the old file or the whole new one.
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      os.fchmod(fd, 0o644)  # mkstemp makes 0600; a shared cache should be readable by all
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, name))
  except BaseException:
    os.unlink(tmp)
    raise
