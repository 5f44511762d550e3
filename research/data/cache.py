"""The on-disk caches' machinery, shared by the byte corpus (corpus.py), the tokenized caches (tokenized.py) and the
token shards (shards.py): where caches live (`default_cache_dir`, `$OPTLAB_CACHE`), whether a cache root can be
written (one warning, then the run goes on uncached), files written whole or not at all (`write_atomic`), and a cache
folder checked against its meta.json before it is served (`checked_meta`; a cache that fails is rebuilt, said in one
line: `warn_rebuild`). Pure Python; imports no jax.
"""

import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence


def default_cache_dir() -> str:
  """Where built corpora, token caches and compiled programs live: `$OPTLAB_CACHE`, else ~/.cache/optlab."""
  return os.environ.get("OPTLAB_CACHE") or os.path.expanduser("~/.cache/optlab")


_UNWRITABLE: set[str] = set()  # cache roots this process has already warned about


def cache_writable(root: str, error: OSError | None = None) -> bool:
  """Whether the cache folder `root` can be written (created if missing); when not (or when `error` says a write
  there failed), one warning per root and process: the run goes on and caches nothing there."""
  reason = None if error is None else error.strerror or str(error)
  if os.path.exists(root) and not os.path.isdir(root):
    reason = "a file, not a directory"
  elif error is None:
    try:
      os.makedirs(root, exist_ok=True)
      if os.access(root, os.W_OK | os.X_OK):
        return True
      reason = "not writable"
    except OSError as e:
      reason = e.strerror or str(e)
  if root not in _UNWRITABLE:
    _UNWRITABLE.add(root)
    warnings.warn(f"the cache {root} cannot be written ({reason}): nothing is cached there this run (built corpora, "
                  f"compiled programs); set $OPTLAB_CACHE to a writable directory", stacklevel=2)
  return False


# ---- checking a cache against its meta.json ------------------------------------------------------------------------
# A cache folder's meta.json (written last) records each file's size and the sha256 of its token files (the corpus
# fingerprint, which config.json records too). Sizes are checked at every load; contents the first time a process
# maps them as they are (path, inode, size, mtime, ctime), in bounded reads: one sha256 pass, whose start-up cost
# research/results/cache_verify.md measures. A cache that fails is rebuilt from its sources, never served.
FOREIGN = "its meta.json is unreadable or of another layout"
_VERIFIED: set[tuple] = set()  # (the files as they were, sha256) that this process hashed and found true
_RACY_NS = 2 * 10 ** 9  # a file changed this recently may be written again within its timestamps' resolution


def checked_meta(folder: str, files: Callable[[dict], Mapping[str, int]]) -> tuple[dict | None, str | None]:
  """(meta.json of the cache `folder`, None) when the files `files(meta)` names ({name: bytes}, in the order the
  fingerprint hashes them) have those sizes, none empty, and contents whose sha256 is meta.json's fingerprint; else
  (None, what failed in a few words), or (None, None) when there is no meta.json (a build that never finished)."""
  try:
    with open(os.path.join(folder, "meta.json"), "rb") as f:
      meta = json.loads(f.read())
    sizes, fingerprint = dict(files(meta)), meta["fingerprint"]
    if not isinstance(fingerprint, str) or not all(type(n) is int for n in sizes.values()):
      raise TypeError(fingerprint)
  except FileNotFoundError:
    return None, None
  except (OSError, ValueError, KeyError, TypeError):  # unreadable, or another layout's meta.json
    return None, FOREIGN
  paths = [os.path.join(folder, name) for name in sizes]
  try:
    for (name, want), size in zip(sizes.items(), map(os.path.getsize, paths)):
      if size != want or size == 0:
        return None, f"{name} has {size:,} bytes where meta.json records {want:,}"
    if not hashes_to(paths, fingerprint):
      return None, f"the contents of {' + '.join(sizes)} do not hash to the fingerprint {fingerprint[:16]} it records"
  except OSError as e:
    return None, f"{os.path.basename(e.filename or folder)} is unreadable ({e.strerror})"
  return meta, None


def file_sha256(paths: Sequence[str], chunk: int = 1 << 22) -> str:
  """sha256 hex of the files at `paths`, one after another, read in `chunk`-byte pieces (bounded memory)."""
  h, buf = hashlib.sha256(), bytearray(chunk)
  view = memoryview(buf)
  for path in paths:
    with open(path, "rb", buffering=0) as f:
      while n := f.readinto(buf):
        h.update(view[:n])
  return h.hexdigest()


def hashes_to(paths: Sequence[str], sha256: str) -> bool:
  """Whether the files at `paths` hash to `sha256` (`file_sha256`). Memoised per process by each file's identity
  (path, inode, size, mtime, ctime), except for a file changed in the last two seconds (a write then may leave its
  timestamps as they were)."""
  now, stats = time.time_ns(), [os.stat(p) for p in paths]
  key = (tuple((os.path.realpath(p), s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
               for p, s in zip(paths, stats)), sha256)
  if key in _VERIFIED:
    return True
  if file_sha256(paths) != sha256:
    return False
  if all(now - s.st_ctime_ns > _RACY_NS for s in stats):
    _VERIFIED.add(key)
  return True


def warn_rebuild(folder: str, problem: str):
  """The one stderr line of a cache that failed its check and is rebuilt (what failed: `problem`)."""
  print(f"warning: the cache {folder} does not match its meta.json ({problem}); rebuilding it", file=sys.stderr,
        flush=True)


def write_atomic(folder, name, data: bytes):
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
