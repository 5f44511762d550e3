"""orbax CheckpointManager around the train state: async saves, keep-last-N, restore onto any mesh.

A checkpoint holds the state (`step`, `params`, `opt_state`) and a JSON `meta` with the run's
shape-determining config, which resume compares before touching any array.

Crash safety (orbax 0.12, local or shared filesystem): a step is written into `<step>.orbax-checkpoint-tmp`,
ends with `commit_success.txt`, and only then is renamed to `<step>`; a process killed before the rename leaves
just the temporary directory, which orbax never lists and this class removes when it opens the directory again.
A step that is listed but cannot be read (damaged later: truncated or garbled files) is moved whole, by one
rename, to `<directory>.corrupt/<step>` (`quarantine`), so it is never overwritten, deleted or counted by keep-N
garbage collection, and stays there for inspection.

Integrity: each step's meta holds a content checksum of every array of the state (`research.train.store.integrity`: two
32-bit words per array, the same on any sharding), computed on the devices when the save starts; `restore` and
`restore_params` recompute them for what they read and refuse (CheckpointError) a step whose bytes changed since
(a flipped bit that still decodes, a truncated shard, a file swapped with another step's), so the caller can fall
back to an older step. Checkpoints written before checksums existed restore unverified.

A background (async) save that fails (a full disk, a lost mount) raises `CheckpointSaveError` from the next
`check`, `save` or `close`, with the error's first line: the run stops there, and the steps committed before it
are untouched (orbax deletes old steps only after a new one is committed).
"""

from __future__ import annotations

import logging
import os
import re
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from research.train.store import integrity

CHUNK_BYTES = 2 ** 26
"""A bounded checkpointer (the trainer's on the CPU) stores each array as zarr chunks of at most this many bytes, a
file each (orbax's `SaveArgs.chunk_byte_size`, `use_ocdbt=False`), so tensorstore encodes and writes it a chunk at a
time and the writer's memory is a few chunks, whatever the arrays. Measured on this machine's CPU with three random
bfloat16 arrays of 2.1 GB (4 GB in flight), resident memory above the state while saving: 0.23 GiB with 64 MiB chunks,
0.99 GiB with 256 MiB chunks; orbax's OCDBT format holds the encoded arrays in flight until they are committed (2.98 GiB
chunked, 5.32 GiB stored whole). Restoring reads either format and any chunking (older checkpoints are OCDBT)."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be used for this run."""


class CheckpointSaveError(CheckpointError):
  """A checkpoint could not be written (in the background or not)."""


class Checkpointer:
  def __init__(self, directory: str, *, keep: int = 3, every: int = 100, save_concurrent_gb: int | None = None):
    """`save_concurrent_gb`: at most this many GB (10^9 bytes) of the state being written at once (orbax's; the
    trainer bounds it on the CPU, where the writer's buffers share the devices' memory: research/train/setup/memory.py);
    None: orbax's default. A bounded checkpointer saves and restores whole states (`save`, `restore`), each array in
    chunks of `CHUNK_BYTES` outside OCDBT (its memory stays a few chunks)."""
    self.directory = os.path.abspath(directory)
    handlers = None
    if save_concurrent_gb is not None:
      _add_filter(_OcdbtMergeNotice, ("absl",))  # its notice after every save without OCDBT
      handlers = {"state": ocp.StandardCheckpointHandler(save_concurrent_gb=save_concurrent_gb, use_ocdbt=False),
                  "meta": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=None if handlers else ("state", "meta"), item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                             enable_async_checkpointing=True, create=True,
                                             cleanup_tmp_directories=True))  # drops saves a crash cut short

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
    """Starts an async save if `step` is due (or `force`), with the state's checksums in its meta; returns whether
    it saved."""
    state = _without_empty(state)
    meta = {**meta, "checksums": integrity.fingerprints(state)}
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
    try:
      return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state, save_args=chunked),
                                                             meta=ocp.args.JsonSave(meta)), force=force)
    except Exception as e:  # a failed earlier background save surfaces here, or this one fails to start
      raise self._save_error(e) from None

  def check(self):
    """Raises CheckpointSaveError if a background save has failed (cheap: call it every step)."""
    try:
      self.manager.check_for_errors()
    except Exception as e:
      raise self._save_error(e) from None

  def _save_error(self, e: Exception) -> CheckpointSaveError:
    os_error = re.search(r"([^:\"]+?) \[os_error_code='?(\d+)", str(e))  # tensorstore's: the cause comes last
    why = f"{os_error[1].strip()} [errno {os_error[2]}]" if os_error else _line(e)
    return self._stopped(f"saving a checkpoint in {self.directory}", why)

  def write_error(self, path: str, e: OSError) -> CheckpointSaveError:
    """The run directory's disk refused a write of `path` (metrics, event files): the same one-line stop as a failed
    save, naming the newest checkpoint to resume from."""
    return self._stopped(f"writing {path}", f"{e.strerror} [errno {e.errno}]")

  def _stopped(self, doing: str, why: str) -> CheckpointSaveError:
    last = self.manager.latest_step()
    kept = "no checkpoint was committed" if last is None else f"step {last} is the newest intact checkpoint"
    return CheckpointSaveError(f"{doing} failed: {why}; {kept} (free space or fix the directory, then rerun the same "
                               f"command to resume)")

  def read_meta(self, step: int) -> dict:
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many types for a damaged directory
      raise CheckpointError(f"checkpoint {self.directory}/{step} has unreadable metadata: {_line(e)}") from None

  def restore(self, step: int, abstract_state, shardings):
    """The state at `step`, each array created with the given sharding (so any mesh works)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    try:
      state = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_without_empty(target))))["state"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.directory}/{step} could not be restored: {_line(e)}") from None
    self._verify(step, state)
    empty = lambda t: jax.device_put(jnp.zeros(t.shape, t.dtype), t.sharding)
    return jax.tree.map(lambda t, x: empty(t) if t.size == 0 else x, target, state)

  def _verify(self, step: int, state):
    """Refuses `state` (read from `step`) unless every array's checksum equals the one saved with it."""
    saved = self.read_meta(step).get("checksums")
    if saved is None:  # written before checksums existed
      return
    now = integrity.fingerprints(state)
    bad = integrity.mismatches({k: v for k, v in saved.items() if k.split("/")[0] in state}, now)
    if bad:
      more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
      raise CheckpointError(f"checkpoint {self.directory}/{step} changed since it was saved: the checksum of "
                            f"{bad[0]}{more} differs")

  def restore_params(self, step: int, abstract_params, shardings, abstract_buffers=None, buffer_shardings=None):
    """Only the parameters of the state at `step` (the optimizer state is not read), each array created with the
    given sharding: how a model is loaded for sampling, export or fine-tuning. With `abstract_buffers`, (params,
    buffers): a PEFT run's frozen base is there."""
    spec = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    item = {"params": jax.tree.map(spec, abstract_params, shardings)}
    if abstract_buffers is not None:
      item["buffers"] = jax.tree.map(spec, abstract_buffers, buffer_shardings)
    try:
      args = ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                    restore_args=ocp.checkpoint_utils.construct_restore_args(item))
      got = self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.directory}/{step}: parameters could not be restored: {_line(e)}") \
          from None
    self._verify(step, got)
    return got["params"] if abstract_buffers is None else (got["params"], got["buffers"])

  def quarantine(self, step: int) -> str:
    """Moves the step's directory, untouched, to `<directory>.corrupt/<step>` (`-2`, `-3`, ... if taken) out of
    the manager's sight; returns the new path. Process 0 renames, every process waits for it."""
    src = os.path.join(self.directory, str(step))
    dst = os.path.join(self.directory + ".corrupt", str(step))
    n = 1
    while os.path.exists(dst):
      n += 1
      dst = os.path.join(self.directory + ".corrupt", f"{step}-{n}")
    if jax.process_count() > 1:  # every process has picked the same name before it is taken
      ocp.multihost.sync_global_processes(f"optlab_quarantine_{step}_named")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      os.rename(src, dst)
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes(f"optlab_quarantine_{step}_moved")
    self.manager.reload()
    return dst

  def close(self):
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._save_error(e) from None
    finally:
      self.manager.close()


def _without_empty(tree):
  """The tree with each zero-size array (an optimizer's placeholder, as SOAP's for a side it does not rotate) replaced
  by None: orbax cannot save one, and `restore` rebuilds it from the abstract state's shape, dtype and sharding."""
  return jax.tree.map(lambda x: None if getattr(x, "size", 1) == 0 else x, tree)


class _OcdbtMergeNotice(logging.Filter):
  """Orbax's notice, at the end of every save without OCDBT, that it found no OCDBT files to merge: there are none."""

  def filter(self, record):
    return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def _add_filter(kind: type[logging.Filter], loggers: tuple[str, ...]):
  """A `kind` filter on each of the named loggers, once (installing it again adds nothing)."""
  for logger in map(logging.getLogger, loggers):
    if not any(isinstance(f, kind) for f in logger.filters):
      logger.addFilter(kind())


class _OrbaxErrors(logging.Filter):
  """Orbax's error records, and asyncio's reports of orbax write tasks that failed after the save was abandoned."""

  def filter(self, record):
    return not (record.levelno >= logging.ERROR and (f"{os.sep}orbax{os.sep}" in record.pathname or (
        record.name == "asyncio" and "orbax" in record.getMessage())))


def quiet_orbax_errors():
  """Drops orbax's own error logs (a failed background save logs each failing thread's traceback): the failure
  reaches the caller as one CheckpointSaveError line instead. For CLIs; the library leaves logging alone."""
  _add_filter(_OrbaxErrors, ("absl", "asyncio"))
  if not getattr(sys.excepthook, "_optlab", False):  # nor the callbacks of its cancelled writes, which tensorstore
    hook, unraisable = sys.excepthook, sys.unraisablehook  # reports once orbax's loop is closed: through
                                                           # sys.excepthook, or as unraisable with no object

    closed, orbax = _loop_closed, _orbax_coroutine  # bound now: at interpreter exit the module's globals may be None

    def excepthook(kind, value, tb):
      if not closed(value):
        hook(kind, value, tb)

    def unraisablehook(report):  # and the reads of a damaged checkpoint still in flight when the first one failed
      if not (closed(report.exc_value) or orbax(report.object)):
        unraisable(report)
    excepthook._optlab = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


def _orbax_coroutine(obj, marker: str = f"{os.sep}orbax{os.sep}") -> bool:
  """Whether `obj` is one of orbax's coroutines (an array read abandoned with the restore whose first failure the
  caller reports: its own error says the same of another chunk). Reads no module global (`marker` is bound at
  import): a coroutine collected while the interpreter exits reaches the hook after the module is cleared."""
  code = getattr(obj, "cr_code", None)
  return code is not None and marker in code.co_filename


def _loop_closed(e) -> bool:
  return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _line(e: Exception) -> str:
  """The first line of an orbax/tensorstore error (some span dozens), so errors stay one line."""
  text = re.sub(r"<bound method [^>]*>|<[\w.]+ object at 0x[0-9a-f]+>", "…", str(e)).strip() or type(e).__name__
  return text.splitlines()[0][:300]
