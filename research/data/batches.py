"""Batches from a token array: training windows as a pure function of (seed, step), fixed held-out windows.

`get_batch` is a pure function of (seed, step): resuming a run needs no iterator state.
`eval_batches` is seed-independent, so every evaluation sees the same held-out windows.
Pure numpy; imports no jax.
"""

import mmap
import os
import threading
import weakref

import numpy as np

from research.data.corpus import DataError

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
  check_windows(tokens, batch_size, seq_len)
  if order not in ORDERS:
    raise DataError(f"sampling order must be one of {', '.join(ORDERS)}, got {order!r}")
  return gather(tokens, window_starts(len(tokens) - seq_len - 1, seed, step, batch_size, seq_len, order), seq_len)


def window_starts(span: int, seed: int, step: int, batch_size: int, seq_len: int, order: str) -> np.ndarray:
  """The start offsets (int64, in [0, span]) of step `step`'s windows in `order` "random" or "sequential"."""
  if order == "sequential":
    offset = np.random.default_rng([seed]).integers(0, span, endpoint=True)
    return (offset + (step * batch_size + np.arange(batch_size, dtype=np.int64)) * seq_len) % (span + 1)
  return np.random.default_rng([seed, step]).integers(0, span, size=batch_size, endpoint=True)


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 num_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Fixed held-out batches: num_batches*batch_size windows evenly spaced over the data."""
  check_windows(tokens, batch_size, seq_len)
  if num_batches < 1:
    raise DataError(f"num_batches must be >= 1, got {num_batches}")
  starts = np.linspace(0, len(tokens) - seq_len - 1, num_batches * batch_size).astype(np.int64)
  x, y = gather(tokens, starts, seq_len)
  return [(x[i:i + batch_size], y[i:i + batch_size])
          for i in range(0, num_batches * batch_size, batch_size)]


def check_windows(tokens, batch_size, seq_len):
  if batch_size < 1 or seq_len < 1:
    raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
  if len(tokens) < seq_len + 1:
    raise DataError(f"sequence length {seq_len} is longer than the data ({len(tokens)} tokens)"
                    f"; a window needs seq_len + 1 = {seq_len + 1} tokens")


def gather(tokens, starts, seq_len):
  """(x, y) of the windows of seq_len + 1 tokens at `starts`."""
  windows = read_windows(tokens, np.asarray(starts, np.int64), seq_len + 1)
  return windows[:, :-1], windows[:, 1:]


def read_windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
  """int32 (len(starts), length): tokens[s : s + length] for each start s (a window past the end is cut short and
  padded with 0). A memory-mapped array is read with one pread per window instead of through its map: touching a
  mapped page maps its neighbours too (the kernel's fault-around), so random windows over a file larger than RAM
  would make gigabytes of it resident memory of this process (measured: 4.4 GiB for 16,000 windows of an 8 GB file);
  read, it stays in the page cache, which any process may reclaim."""
  source = _file_of(tokens)
  if source is None:
    idx = np.minimum(starts[:, None] + np.arange(length), len(tokens) - 1)
    return np.where(starts[:, None] + np.arange(length) < len(tokens), np.asarray(tokens[idx], np.int32), 0)
  fd, offset = source
  item = tokens.dtype.itemsize
  out = np.zeros((len(starts), length), np.int32)
  for i, s in enumerate(starts.tolist()):
    row = np.frombuffer(os.pread(fd, max(0, min(length, len(tokens) - s)) * item, offset + s * item), tokens.dtype)
    out[i, :len(row)] = row
  return out


# a memory map (by id) -> a read-only descriptor of the file it maps, opened at its first read (pread needs no
# position) and closed with the map: keyed by the map, not the path, so a cache rebuilt under the same path (a new
# file renamed into place) is read from the new file by its new map, never from the old one's descriptor
# (a map first read after its path was replaced by a rebuild would read the new file: the caches open a map right
# before its first read, so that window is one function call)
_FILES: dict[int, int] = {}
_OPENING = threading.Lock()  # the loader's threads read the same map


def _descriptor(mapping, filename: str) -> int:
  key = id(mapping)
  with _OPENING:
    if key not in _FILES:
      _FILES[key] = os.open(filename, os.O_RDONLY)
      weakref.finalize(mapping, _close, key, _FILES[key])
    return _FILES[key]


def _close(key: int, fd: int):
  _FILES.pop(key, None)
  os.close(fd)


def _file_of(tokens):
  """(file descriptor, byte offset of tokens[0] in the file) of a memory-mapped array (a slice of one too), else
  None."""
  if not isinstance(tokens, np.memmap) or getattr(tokens, "_mmap", None) is None or not tokens.filename:
    return None
  base = np.frombuffer(tokens._mmap, np.uint8).ctypes.data  # the mapping's first byte; it maps from `start`
  start = tokens.offset - tokens.offset % mmap.ALLOCATIONGRANULARITY
  return _descriptor(tokens._mmap, tokens.filename), start + tokens.ctypes.data - base
