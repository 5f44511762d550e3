"""What one row of a batch holds, by `--data.layout`: the records the loader (research/data/loader.py) orders.

A record source has `count` records per epoch and `read(epochs, ids) -> (x, y)`, int32 (n, seq_len) each, for n
records given by their epoch and their id within it (y is x shifted by one: the next token at every position).
  Windows  windows of seq_len + 1 tokens anywhere in the token stream (documents run into each other across their
           end-of-text tokens). On a grid (shuffle): window i of epoch e starts at offset(e) + i·seq_len, offset(e)
           drawn from (seed, e); off the grid (random, sequential): the id is the start itself.
  Packed   the documents, in an order per epoch (shuffled from (seed, epoch), or as stored), joined with their
           end-of-text tokens and cut into rows at a stride of seq_len: rows start anywhere in a document, none is
           padded, a document longer than a row continues on the next (--data.layout pack).
  Padded   one document per row, from its start: a document longer than a row is split into pieces of seq_len + 1
           tokens (overlapping by one, so each of its tokens is a target once); a shorter one is padded, x with the
           end-of-text token and y with `IGNORE`, which the loss leaves out (--data.layout pad).
Pure numpy; imports no jax.
"""

from __future__ import annotations

import numpy as np

from research.data.batches import gather, read_windows
from research.data.corpus import DataError

IGNORE = int(np.iinfo(np.int32).min)  # a target the loss skips (models.IGNORE_TARGET): padding
LAYOUTS = ("windows", "pack", "pad")


def document_starts(tokens: np.ndarray, docs: np.ndarray | None, eos: int | None, what: str) -> np.ndarray:
  """The int64 start offset of each document of `tokens`: `docs` when the corpus recorded them, else found after each
  end-of-text token (a scan of the tokens)."""
  if docs is not None:
    return np.asarray(docs, np.int64)
  if eos is None:
    raise DataError(f"{what} has no document boundaries (a token array has no end-of-text token): --data.layout pack "
                    f"and pad need documents (text, Parquet, JSON Lines or Arrow data)")
  ends = np.flatnonzero(np.asarray(tokens) == eos) + 1
  return np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)


class Windows:
  def __init__(self, tokens, seq_len: int, seed: int, grid: bool):
    self.tokens, self.L, self.seed, self.grid = tokens, seq_len, seed, grid
    self.span = len(tokens) - seq_len - 1  # the last window start
    self.count = self.span // seq_len + 1 if grid else self.span + 1

  def read(self, epochs: np.ndarray, ids: np.ndarray):
    starts = ids.astype(np.int64)
    if self.grid:
      slack = self.span - (self.count - 1) * self.L  # room to shift an epoch's grid of windows
      offsets = {e: np.random.default_rng([self.seed, e]).integers(0, slack, endpoint=True)
                 for e in set(epochs.tolist())}
      starts = np.array([offsets[e] for e in epochs.tolist()], np.int64) + starts * self.L
    return gather(self.tokens, starts, self.L)


class Packed:
  def __init__(self, tokens, docs: np.ndarray, seq_len: int, seed: int, shuffled: bool):
    self.tokens, self.L, self.seed, self.shuffled = tokens, seq_len, seed, shuffled
    self.starts = docs
    self.lengths = np.diff(np.append(docs, len(tokens)))
    self.count = (int(self.lengths.sum()) - 1) // seq_len
    if self.count < 1:
      raise DataError(f"the documents hold {int(self.lengths.sum())} tokens, fewer than a row of {seq_len + 1}")
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def _order(self, epoch: int):
    """(document order, where each begins in the epoch's joined stream), the last two epochs' kept."""
    if epoch not in self._epochs:
      order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.starts)) if self.shuffled
               else np.arange(len(self.starts)))
      self._epochs = {**{e: v for e, v in self._epochs.items() if e == epoch - 1},
                      epoch: (order, np.concatenate([[0], np.cumsum(self.lengths[order])]))}
    return self._epochs[epoch]

  def read(self, epochs: np.ndarray, ids: np.ndarray):
    rows = np.empty((len(ids), self.L + 1), np.int64)
    for e in set(epochs.tolist()):
      order, begins = self._order(e)
      mine = epochs == e
      pos = ids[mine, None].astype(np.int64) * self.L + np.arange(self.L + 1)  # in the epoch's joined stream
      k = np.searchsorted(begins, pos, side="right") - 1
      rows[mine] = self.starts[order[k]] + pos - begins[k]
    windows = read_runs(self.tokens, rows)
    return windows[:, :-1], windows[:, 1:]


class Padded:
  def __init__(self, tokens, docs: np.ndarray, seq_len: int, eos: int | None):
    self.tokens, self.L, self.pad = tokens, seq_len, 0 if eos is None else eos
    lengths = np.diff(np.append(docs, len(tokens)))
    pieces = np.maximum((lengths - 2) // seq_len + 1, 0)  # a piece needs two tokens: an input and its target
    self.begin = np.repeat(docs, pieces) + seq_len * (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces,
                                                                                           pieces))
    self.size = np.minimum(np.repeat(docs + lengths, pieces) - self.begin, seq_len + 1)
    self.count = len(self.begin)
    if self.count < 1:
      raise DataError("the documents are empty: no document has a token to predict")

  def read(self, epochs: np.ndarray, ids: np.ndarray):
    begin, size = self.begin[ids], self.size[ids]
    valid = np.arange(self.L + 1) < size[:, None]
    windows = read_windows(self.tokens, begin, self.L + 1)
    return (np.where(valid[:, :-1], windows[:, :-1], self.pad).astype(np.int32),
            np.where(valid[:, 1:], windows[:, 1:], IGNORE).astype(np.int32))


def read_runs(tokens, positions: np.ndarray) -> np.ndarray:
  """int32 tokens at `positions` (rows of runs of consecutive offsets), each run one `read_windows` read."""
  out = np.empty(positions.shape, np.int32)
  for i, row in enumerate(positions):
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(row) != 1) + 1, [len(row)]])
    for a, b in zip(cuts[:-1], cuts[1:]):
      out[i, a:b] = read_windows(tokens, row[a:a + 1], b - a)[0]
  return out
