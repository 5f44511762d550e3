"""The trainer's loader: each step's batch as a `grain` pipeline over a (memory-mapped) token array.

  loader = Loader(corpus.train, batch_size=16, seq_len=128, seed=0, rows=range(16))
  it = loader.iterator(start=0)   # prefetching on background threads
  x, y = next(it)                 # this process's rows of step 0's batch, int32 (len(rows), seq_len) each
  it.get_state()                  # {"next_index": 1}: what a checkpoint stores; `iterator(state=...)` resumes it

What a row holds is the `layout`'s record (research/data/records.py): a window of the token stream (windows), a row
of the documents joined (pack), or one document padded (pad). Step t's batch is records t·B .. t·B + B − 1 of the
run's record order, which `sampling` picks:
  shuffle     epochs over the records, each epoch in its own order: grain's index shuffle from (seed, epoch); the
              windows' grid and the documents' order are drawn per epoch from (seed, epoch) too. Each record once per
              epoch.
  random      records drawn uniformly at random, with replacement, from (seed, step) (windows: `get_batch`'s starts,
              the sampler before the grain loader; runs saved with it resume with it).
  sequential  records in order (windows: the data read as a stream from a seed-chosen offset, `get_batch`'s).
The order is a pure function of (seed, record index), so any process can compute any step's batch; each process
reads the tokens of its own rows only (`rows`: the rows of the global batch its devices hold). grain runs the reads
on `workers` threads with batches prefetched ahead of the step, and its iterator state — the next step — is saved in
every checkpoint, so a resumed run reads exactly the batches the uninterrupted one would have.
Pure numpy and grain; imports no jax.
"""

from __future__ import annotations

import grain
import numpy as np

from research.data.batches import ORDERS, check_windows, window_starts
from research.data.corpus import DataError
from research.data.records import LAYOUTS, Packed, Padded, Windows, document_starts

SAMPLINGS = ("shuffle", *ORDERS)


class Loader:
  """Step t -> this process's rows of the batch of step t (see the module docstring). `docs` and `eos` (the
  corpus's document starts and end-of-text token) are what the pack and pad layouts read documents by."""

  def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int, sampling: str = "shuffle",
               rows=None, workers: int = 2, layout: str = "windows", docs: np.ndarray | None = None,
               eos: int | None = None):
    if sampling not in SAMPLINGS:
      raise DataError(f"sampling order must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if layout not in LAYOUTS:
      raise DataError(f"data layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    check_windows(tokens, batch_size, seq_len)
    self.tokens, self.B, self.L, self.seed, self.sampling = tokens, batch_size, seq_len, seed, sampling
    self.rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
    self.workers = workers
    self.source: Windows | Packed | Padded
    if layout == "windows":
      self.source = Windows(tokens, seq_len, seed, grid=sampling == "shuffle")
    else:
      docs = document_starts(tokens, docs, eos, "the data")
      self.source = (Packed(tokens, docs, seq_len, seed, shuffled=sampling == "shuffle") if layout == "pack"
                     else Padded(tokens, docs, seq_len, eos))
    self.count = self.source.count  # records per epoch
    self.layout = layout
    self.records = self._steps()  # step -> (epochs, ids) of its B records, all rows (research/data/mixture.py reads it)
    self.dataset = self.records.map(self._read)

  def _steps(self) -> grain.MapDataset:
    """Step t -> (epoch, id) of each of its B records (all rows: cheap, ints only)."""
    count, B = self.source.count, self.B
    if self.sampling == "shuffle":  # ids epoch after epoch, each epoch in its own order
      # a finite number of epochs (len() must fit an index; an endless repeat() overflows it): ~2^62 records
      ids = grain.MapDataset.range(count).shuffle(seed=self.seed).repeat(max(1, 2 ** 62 // count)).batch(B)
      return ids.map_with_index(lambda t, i: ((t * B + np.arange(B, dtype=np.int64)) // count, i))
    return grain.MapDataset.range(2 ** 62).map(self._unshuffled)

  def _unshuffled(self, t: int):
    zeros = np.zeros(self.B, np.int64)
    if isinstance(self.source, Windows):  # layout "windows": `get_batch`'s starts
      return zeros, window_starts(self.source.span, self.seed, t, self.B, self.L, self.sampling)
    if self.sampling == "random":
      return zeros, np.random.default_rng([self.seed, t]).integers(0, self.source.count, size=self.B)
    k = t * self.B + np.arange(self.B, dtype=np.int64)
    return k // self.source.count, k % self.source.count

  def _read(self, records) -> tuple[np.ndarray, np.ndarray]:
    epochs, ids = records
    return self.source.read(np.asarray(epochs)[self.rows], np.asarray(ids)[self.rows])

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of step `step`'s batch, read now (no threads)."""
    return self.dataset[step]

  def iterator(self, state: dict | None = None, start: int = 0):
    """A grain iterator from step `start` (or a saved iterator `state`), reading ahead on `workers` threads."""
    options = grain.ReadOptions(num_threads=self.workers, prefetch_buffer_size=2 * self.workers)
    it = iter(self.dataset.to_iter_dataset(options))
    it.set_state(state if state is not None else {"next_index": start})
    return it
