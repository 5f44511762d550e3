"""The run's training batches: the grain loader (research/data/loader.py) over the corpus's training tokens, read
for this process's rows of each step's global batch on background threads, placed on the mesh one step ahead.

  feed = Feed(corpus, cfg.training, cfg.data, cfg.data_options, mesh, step=start, state=saved.get("loader"))
  x, y = feed.next()        # global arrays of the next step's batch, rows split over the mesh's data axes
  feed.state()              # the loader's iterator state: saved in every checkpoint, handed back on resume
  feed.switched(new_mesh)   # --switch-at: this process's rows may change; the step does not

Double buffering: from the first `next()` on, while step t runs, a feed thread reads batch t+1 from the loader and
puts it on the devices, so the step after it is dispatched without waiting for the host. `state()` is the loader's
state before the batch read ahead, so a checkpoint still names the next step's batch: the read-ahead never changes
which batches a run or a resumed run trains on. (No thread exists before the first `next()`: a run that fails while
starting leaves none behind.)

A saved state must name the step the checkpoint was taken at (the batches are a pure function of the step, so a
mismatch means the checkpoint's metadata and its state disagree): that is refused in one line.
"""

from __future__ import annotations

import concurrent.futures

from research.data import Corpus, DataError, eval_batches
from research.data.loader import Loader
from research.data.mixture import MixedCorpus, MixedLoader, Mixture
from research.train.config import RunError
from research.train.config.prefixed import DataFlags
from research.train.config.sections import DataSection, TrainingSection
from sharding import local_batch, process_rows


def make_loader(corpus: Corpus, training: TrainingSection, data: DataSection, options: DataFlags,
                rows=None) -> Loader | MixedLoader:
  """The run's loader over `corpus.train` (every row of the global batch unless `rows`): the batch, length and seed
  of the config's training section, the order of its data section, the layout and readers of --data.*; for a
  mixture (--mix), one loader per source under the mixture's sampler."""
  if isinstance(corpus, MixedCorpus):
    loaders = {n: make_loader(c, training, data, options, rows) for n, c in corpus.sources.items()}
    return MixedLoader(Mixture(loaders, seed=training.seed, weights=corpus.spec.initial(corpus.sizes())),
                       options.workers)
  try:
    return Loader(corpus.train, batch_size=training.batch_size, seq_len=training.seq_len, seed=training.seed,
                  sampling=data.sampling, rows=rows, workers=options.workers, layout=options.layout,
                  docs=corpus.train_docs, eos=corpus.eos)
  except DataError as e:
    raise RunError(f"--data: {e}") from None


def held_out(corpus: Corpus, training: TrainingSection, options: DataFlags, n: int) -> list[tuple]:
  """The `n` (--eval-batches) fixed held-out batches every evaluation uses: windows evenly spaced over `corpus.val`
  (`eval_batches`), or, for --data.layout pack and pad, the first rows of the held-out documents laid out the same
  way (in their order)."""
  if isinstance(corpus, MixedCorpus):  # each source's, one after the other (research/train/hooks/source_weights.py)
    return [b for c in corpus.sources.values() for b in held_out(c, training, options, n)]
  if options.layout == "windows":
    return eval_batches(corpus.val, training.batch_size, training.seq_len, n)
  try:
    loader = Loader(corpus.val, batch_size=training.batch_size, seq_len=training.seq_len, seed=0,
                    sampling="sequential", workers=0, layout=options.layout, docs=corpus.val_docs, eos=corpus.eos)
  except DataError as e:
    raise RunError(f"--data: the held-out split: {e}") from None
  return [loader.batch(t) for t in range(n)]


class Feed:
  """The iterator of a run's training batches from step `step` (or a saved loader `state`) on `mesh`."""

  def __init__(self, corpus: Corpus, training: TrainingSection, data: DataSection, options: DataFlags, mesh,
               step: int, state: dict | None = None):
    if state is not None and state.get("next_index") != step:
      raise RunError(f"the checkpoint of step {step} holds the loader state of another step ({state}): its metadata "
                     f"is inconsistent; resume from another checkpoint")
    self.corpus, self.training, self.data, self.options, self.step = corpus, training, data, options, step
    self.pool = None  # the feed thread, the only reader of the iterator once `next()` was first called
    self._open(mesh, state)

  def _open(self, mesh, state):
    self.mesh = mesh
    self.rows = process_rows(mesh, (self.training.batch_size, self.training.seq_len))
    self.loader = make_loader(self.corpus, self.training, self.data, self.options, self.rows)
    self._start(state=state, start=self.step)

  def _start(self, **where):
    """Opens the loader's iterator at `where`; nothing is read before the next `next()`."""
    self.iterator = self.loader.iterator(**where)
    self.ahead = None

  def _read(self):
    """On the feed thread: (the loader's state before the batch, the batch on the mesh or the error reading it)."""
    state = None
    try:
      state = self.iterator.get_state()
      return state, local_batch(next(self.iterator), self.mesh, self.rows, self.training.batch_size), None
    except Exception as e:  # raised by `next()`, in the loop; the feed still closes
      return state, None, e

  def _read_ahead(self):
    if self.pool is None:
      self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="optlab-feed")
    self.ahead = self.pool.submit(self._read)

  def next(self):
    """The next step's (x, y) as global arrays on the mesh; the batch after it starts reading."""
    if self.ahead is None:
      self._read_ahead()
    _, batch, error = self.ahead.result()
    if error is not None:
      raise error
    self.step += 1
    self._read_ahead()
    return batch

  def state(self) -> dict:
    return self.iterator.get_state() if self.ahead is None else self.ahead.result()[0]

  def switched(self, mesh):
    """Reads on for `mesh` (--switch-at) from the same step: this process's rows are the new mesh's."""
    mixture = self.state().get("mixture")
    self._stop()
    self._open(mesh, {"next_index": self.step, **({"mixture": mixture} if mixture else {})})

  def weights(self, step: int):
    """A mixture's weights at batch `step` (0-based)."""
    return self.loader.mixture.weights(step)

  def set_weights(self, step: int, weights):
    """A mixture's new weights from batch `step` on; the batches read ahead are read again."""
    self._stop()  # the feed thread is idle while the weights change
    self.loader.mixture.set_weights(step, weights)
    self._start(start=step)

  def _stop(self):
    """Waits for the batch being read ahead (dropped) and closes the loader's iterator."""
    if self.ahead is not None:
      self.ahead.result()
      self.ahead = None
    close = getattr(self.iterator, "close", None)
    if close is not None:
      close()

  def close(self):
    self._stop()
    if self.pool is not None:
      self.pool.shutdown()
