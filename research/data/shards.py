"""Training data in the formats it comes in, tokenized once into cached, memory-mapped token shards.

`build_shards(paths, field=..., tokenizer=...)` reads every document of every input once (`research.data.documents`:
Parquet, JSON Lines, Arrow, `datasets` directories and text files, named by paths, directories and globs), encodes
it — its UTF-8 bytes then `SEPARATOR` (vocab 256, uint8), or a Hugging Face tokenizer's ids (`encode_batch` over a
batch of documents, in the library's threads) then its end-of-text token (uint16, or uint32 past 65,536 ids) — and
appends the tokens to `train.bin` or `val.bin` and the document's start offset to `train_docs.npy` / `val_docs.npy`
(int64) in `<cache_dir>/shards-<key>/`. Memory holds one batch of documents, so a corpus larger than RAM builds.
Empty (or null) documents are skipped.

The split is by document and deterministic. A record of a structured file is val iff
`int(sha256(f"{name}:{row}")) % 10_000 < val_fraction * 10_000`, where `name` is the file's path relative to the
root of the argument that named it (`documents.expand_named`) without its format suffix and `row` counts its
records from 0 (across a `datasets` directory's files). A text file, one document, is val iff
`int(sha256(name)) % 10_000 < val_fraction * 10_000`: `read_corpus`'s rule for a directory of text files, so
`--data docs/` and `--data 'docs/*'` hold out the same files. Adding inputs, moving the data or converting it
between the structured formats moves no document between train and val.

The key of the cache hashes a version, each input's name, realpath, size and mtime_ns (every file of a `datasets`
directory), the field, the tokenizer file's bytes and val_fraction: touching an input builds a new cache, and the
same inputs map the old one without encoding anything. Files are written under temporary names and renamed,
`meta.json` last (its presence marks the cache valid), and an fcntl lock on the cache folder makes a second process
(a multi-host run starts one per host) wait for the first's build and then read it. The fingerprint, computed as
the files are written, is `corpus_fingerprint`'s: sha256 of the train bytes then the val bytes; meta.json records it
with the sha256 of each document-starts file, and a process checks the files against them the first time it maps them
(`cache.checked_meta`): a cache whose files are not what its meta.json records is built again (one warning line).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

from research.data import documents
from research.data.cache import checked_meta, default_cache_dir, file_sha256, hashes_to, warn_rebuild, write_atomic
from research.data.corpus import SEPARATOR, Corpus, DataError
from research.data.tokenized import end_of_text, open_tokenizer, token_dtype

_VERSION = 1  # bump when the layout of the cache or the rule that builds it changes
_SPLITS = ("train", "val")
_CHUNK = 1 << 24  # bytes per read when files are copied or hashed back


def build_shards(paths: str | Sequence[str], *, field: str = "text", tokenizer: str | None = None,
                 cache_dir: str | None = None, val_fraction: float = 0.05) -> Corpus:
  """The documents of `paths`, encoded once into a cached train/val token corpus with document starts.

  Args:
    paths: files, directories and globs (`documents.expand_named`); a str is one path.
    field: the column (Parquet, Arrow) or key (JSON Lines) holding each document's text; text files ignore it.
    tokenizer: a Hugging Face tokenizer.json (or a directory with one); None encodes UTF-8 bytes.
    cache_dir: where `shards-<key>/` goes; default `$OPTLAB_CACHE` or ~/.cache/optlab.
    val_fraction: the expected share of documents held out (the split rule is in the module docstring).

  Returns a `Corpus` whose train/val/train_docs/val_docs are memory maps of the cache.
  """
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
  inputs = documents.expand_named([paths] if isinstance(paths, (str, os.PathLike)) else list(paths))
  arrays = [path for path, _ in inputs if path.lower().endswith((".npy", ".bin"))]
  if arrays:  # they are tokens already; read as text they would be garbage
    raise DataError(f"{arrays[0]} is a token array; pass it as the only data path (it is read as it is)")
  if tokenizer is None:
    tok, raw, file, vocab, dtype = None, b"", None, 256, np.uint8
    eos: int | None = SEPARATOR
  else:
    tok, raw, file = open_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype, eos = token_dtype(vocab), end_of_text(tok)
  stats = [[name, os.path.realpath(path), _stat(path)] for path, name in inputs]
  key = hashlib.sha256(json.dumps([_VERSION, stats, field, hashlib.sha256(raw).hexdigest(), val_fraction]).encode())
  folder = os.path.join(os.path.expanduser(cache_dir or default_cache_dir()), f"shards-{key.hexdigest()[:24]}")
  source = _describe(inputs, field, file)
  cached, problem = _open(folder)
  if cached is None:
    try:
      os.makedirs(folder, exist_ok=True)
      lock = open(os.path.join(folder, "lock"), "a")
    except OSError as e:
      why = f"{e.strerror}; it must be built again: {problem}" if problem else e.strerror
      raise DataError(f"cannot write the token cache {folder} ({why}); set $OPTLAB_CACHE to a writable "
                      "folder") from None
    with lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # a process building this cache already: wait, then read what it wrote
      cached, problem = _open(folder)
      if cached is None:
        if problem:
          warn_rebuild(folder, problem)
        meta = dict(source=source, field=field, tokenizer=file and os.path.realpath(file), vocab_size=vocab,
                    dtype=np.dtype(dtype).name, eos=eos, val_fraction=val_fraction, n_inputs=len(inputs))
        _build(folder, inputs, field, tok, dtype, eos, val_fraction, meta)
        cached, problem = _open(folder)
        if cached is None:  # its files changed under it (a second writer outside the lock)
          raise DataError(f"the token cache {folder} does not match its meta.json right after its build ({problem})")
  return Corpus(cached["train"], cached["val"], cached["meta"]["vocab_size"], cached["meta"]["fingerprint"], source,
                eos=cached["meta"]["eos"], train_docs=cached["train_docs"], val_docs=cached["val_docs"])


def is_val(key: str, val_fraction: float) -> bool:
  """The split rule on a document's key (`name:row`, or a text file's name)."""
  return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def _stat(path):
  if not os.path.isdir(path):
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]
  out = []  # a datasets directory: every file in it
  for dirpath, _, filenames in sorted(os.walk(path)):
    for f in sorted(filenames):
      st = os.stat(os.path.join(dirpath, f))
      out.append([os.path.relpath(os.path.join(dirpath, f), path), st.st_size, st.st_mtime_ns])
  return out


def _describe(inputs, field, file):
  first = os.path.realpath(inputs[0][0])
  what = first if len(inputs) == 1 else f"{first} and {len(inputs) - 1} more"
  if any(documents.data_format(p) != "text" for p, _ in inputs):
    what += f" (field '{field}')"
  return what if file is None else f"{what} tokenized by {os.path.realpath(file)}"


def _utf8(doc):
  try:
    return doc.encode("utf-8", "surrogateescape")  # a text file's undecodable bytes come back as they were
  except UnicodeEncodeError:  # a lone surrogate from a JSON escape
    return doc.encode("utf-8", "replace")


def _encode(docs, tok, dtype, eos):
  """(the tokens of `docs`, each followed by eos, as one array; each document's length in tokens)."""
  if tok is None:
    raw = [_utf8(d) for d in docs]
    sep = bytes([SEPARATOR])
    return np.frombuffer(sep.join(raw) + sep, np.uint8), np.array([len(r) + 1 for r in raw], np.int64)
  encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # the same ids, without offsets
  try:
    encodings = encode(docs, add_special_tokens=False)
  except TypeError:  # a string the Rust side refuses (a lone surrogate): encode its UTF-8 with replacements
    encodings = encode([_utf8(d).decode("utf-8", "replace") for d in docs], add_special_tokens=False)
  ids, lengths, tail = [], np.empty(len(docs), np.int64), [] if eos is None else [eos]
  for i, enc in enumerate(encodings):
    ids += enc.ids
    ids += tail
    lengths[i] = len(enc.ids) + len(tail)
  return np.array(ids, dtype), lengths


class _Split:
  """One split being written: tokens and document starts appended to temporary files."""

  def __init__(self, folder, name, hasher):
    self.folder, self.name, self.hasher = folder, name, hasher
    self.tokens = open(os.path.join(folder, f".{name}.bin.{os.getpid()}.tmp"), "wb")
    self.starts = open(os.path.join(folder, f".{name}_docs.{os.getpid()}.tmp"), "wb")
    self.n_tokens = self.n_docs = 0

  def append(self, tokens, lengths):
    data = tokens.tobytes()
    self.tokens.write(data)
    if self.hasher is not None:
      self.hasher.update(data)
    self.starts.write((self.n_tokens + np.cumsum(lengths) - lengths).astype(np.int64).tobytes())
    self.n_tokens += len(tokens)
    self.n_docs += len(lengths)

  def finish(self):
    """Flushes the tokens to `<name>.bin` and the starts to a `<name>_docs.npy` (copied in chunks)."""
    for f in (self.tokens, self.starts):
      f.flush()
      os.fsync(f.fileno())
      f.close()
    npy = os.path.join(self.folder, f".{self.name}_docs.npy.{os.getpid()}.tmp")
    out = np.lib.format.open_memmap(npy, mode="w+", dtype=np.int64, shape=(self.n_docs,))
    step = _CHUNK // 8
    for i in range(0, self.n_docs, step):
      out[i:i + step] = np.fromfile(self.starts.name, np.int64, count=step, offset=8 * i)
    out.flush()
    del out
    os.replace(self.tokens.name, os.path.join(self.folder, f"{self.name}.bin"))
    os.replace(npy, os.path.join(self.folder, f"{self.name}_docs.npy"))


def _build(folder, inputs, field, tok, dtype, eos, val_fraction, meta):
  from tqdm import tqdm
  for stale in glob.glob(os.path.join(folder, ".*.tmp")) + glob.glob(os.path.join(folder, "meta.json")):
    os.unlink(stale)  # a killed build's leftovers, and a meta.json its files no longer match; we hold the lock
  hasher = hashlib.sha256()  # the train bytes as they are written; the val bytes are read back at the end
  splits = {name: _Split(folder, name, hasher if name == "train" else None) for name in _SPLITS}
  try:
    with tqdm(desc=f"tokenizing {meta['source']}", unit=" docs", disable=None, file=sys.stderr) as bar:
      for path, name in inputs:
        text = documents.data_format(path) == "text"
        stem, row = documents.structured_name(name), 0
        for docs in documents.read_documents(path, field, documents.BATCH):
          keys = [name] if text else [f"{stem}:{row + i}" for i in range(len(docs))]
          row += len(docs)
          held = np.array([is_val(k, val_fraction) for k, d in zip(keys, docs) if d], bool)
          docs = [d for d in docs if d]
          if not docs:
            continue
          tokens, lengths = _encode(docs, tok, dtype, eos)
          ends = np.cumsum(lengths)
          for split, mask in ((splits["train"], ~held), (splits["val"], held)):
            if mask.all():
              split.append(tokens, lengths)
            elif mask.any():
              split.append(np.concatenate([tokens[e - n:e] for e, n in zip(ends[mask], lengths[mask])]),
                           lengths[mask])
          bar.update(len(docs))
          bar.set_postfix(tokens=f"{splits['train'].n_tokens + splits['val'].n_tokens:,}", refresh=False)
    for split in splits.values():
      if split.n_docs == 0:
        total = sum(s.n_docs for s in splits.values())
        raise DataError(f"the {split.name} split of {meta['source']} is empty ({total} documents, val_fraction "
                        f"{val_fraction}); change val_fraction or add data" if total else
                        f"no documents in {meta['source']}")
      split.finish()
    with open(os.path.join(folder, "val.bin"), "rb") as f:
      while chunk := f.read(_CHUNK):
        hasher.update(chunk)
    meta.update(fingerprint=hasher.hexdigest(), **{f"{s.name}_tokens": s.n_tokens for s in splits.values()},
                **{f"{s.name}_documents": s.n_docs for s in splits.values()},
                sha256={f"{s}_docs.npy": file_sha256([os.path.join(folder, f"{s}_docs.npy")]) for s in _SPLITS})
    write_atomic(folder, "meta.json", json.dumps(meta, indent=1).encode())  # last: marks the cache valid
  finally:
    for split in splits.values():
      for f in (split.tokens, split.starts):
        f.close()
      for stale in glob.glob(os.path.join(folder, f".{split.name}*.{os.getpid()}.tmp")):
        os.unlink(stale)


def _open(folder):
  """(the cache's memory maps and meta, None) when meta.json is there and every file is what it records: the token
  files' sizes and sha256 (the fingerprint: `checked_meta`), the document starts' sha256 and count. Else (None, what
  failed; None when there is no meta.json: a build that never finished)."""
  meta, problem = checked_meta(folder, lambda m: {f"{s}.bin": m[f"{s}_tokens"] * np.dtype(m["dtype"]).itemsize
                                                  for s in _SPLITS})
  if meta is None:
    return None, problem
  out = dict(meta=meta)
  for name in _SPLITS:
    docs, file = os.path.join(folder, f"{name}_docs.npy"), f"{name}_docs.npy"
    want = meta.get("sha256")
    want = want.get(file) if isinstance(want, dict) else None
    try:
      if isinstance(want, str) and not hashes_to([docs], want):
        return None, f"the contents of {file} do not hash to the sha256 meta.json records"
      out[f"{name}_docs"] = starts = np.load(docs, mmap_mode="r")
    except (OSError, ValueError) as e:
      return None, f"{file} is unreadable ({' '.join(str(e).split())})"
    if starts.shape != (count := meta.get(f"{name}_documents"),):
      return None, f"{file} holds {starts.shape} document starts where meta.json records {count}"
    out[name] = tokens = np.memmap(os.path.join(folder, f"{name}.bin"), dtype=meta["dtype"], mode="r")
    if not isinstance(want, str) and not _ordered(starts, len(tokens)):  # a cache built before the sha256 was
      return None, f"{file}'s document starts are out of order"  # recorded: its starts must at least be in order
  return out, None


def _ordered(starts, n_tokens: int) -> bool:
  """Document starts that can be true: the first at 0, each after the one before, the last within the tokens."""
  return len(starts) == 0 or (starts[0] == 0 and bool(np.all(np.diff(starts) > 0)) and starts[-1] < n_tokens)
