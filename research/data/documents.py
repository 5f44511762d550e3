"""Documents in the formats training data comes in: which files a list of paths and globs names (`expand`) and the
text of their documents, streamed a batch at a time (`read_documents`).

A file's format is its name: Parquet (`.parquet`), JSON Lines (`.jsonl`, `.json`, gzipped `.jsonl.gz` / `.json.gz`:
one JSON object per line), Arrow (`.arrow`, the IPC file or stream format), and any other file is plain text, one
document per file. A directory holding `state.json` / `dataset_info.json` is a `datasets` `save_to_disk` directory
(its `.arrow` files, in the order `state.json` lists them; a `DatasetDict` directory, marked by
`dataset_dict.json`, gives its "train" split); any other directory stands for the files under it, but for what a
text directory skips (`research.data.corpus`: hidden files, hidden and cache folders, files that are not text), said
in one line on stderr. In the structured formats `field` names the column or key that holds each document's text (a
null is an empty document).

Reading goes by record batches (Parquet, Arrow) or lines (JSON Lines), so memory holds one batch of documents and
never a whole file. Every bad input is a one-line `DataError` naming the file. Pure Python and pyarrow; no jax.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys
import zlib
from collections.abc import Iterator, Sequence

from research.data.corpus import DataError, is_text, not_hidden, source_dir

BATCH = 1024  # documents per batch: what one read, one encode_batch call and one write hold
SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl",
            ".json.gz": "jsonl"}  # the structured formats; any other file is text
_DATASET_MARKS = ("state.json", "dataset_info.json", "dataset_dict.json")
_ARRAYS = (".npy", ".bin")  # token arrays: never documents, never skipped in silence


def expand(paths: Sequence[str]) -> list[str]:
  """The inputs that `paths` name, in order, without opening any file and without the stderr line: `expand_named`'s,
  but for the files that are not text, which only reading tells apart (what `research.data.load_corpus` needs to pick
  a reader)."""
  return [path for path, _ in expand_named(paths, read=False)]


def expand_named(paths: Sequence[str], read: bool = True) -> list[tuple[str, str]]:
  """(path, name) of each input that `paths` (files, directories, globs) name, in argument order, each directory's
  and glob's matches sorted by name; a file named twice is read once (the first time).

  The name is the path relative to the root of the argument that named it: the directory given, a glob's leading
  directories (the part without wildcards), or a file's own directory. It identifies a document for the train/val
  split (`research.data.shards`), so it does not change when other paths are added or the data moves. A directory
  or glob skips what a text directory skips (`research.data.corpus`): hidden files, hidden and cache folders
  (`__pycache__`, `node_modules`, `site-packages`, ...; not walked) and, with `read`, a file of the text format that
  is not text (UTF-8 without NUL bytes: an image, bytecode); what was skipped is said in one line on stderr per
  argument. A file named by its own path is read as it is, and a `datasets` directory is one input, not its files.
  """
  out: list[tuple[str, str]] = []
  seen: set[str] = set()
  for arg in paths:
    arg = os.path.expanduser(os.fspath(arg))
    if os.path.exists(arg):
      matches, root = [arg], arg if _is_folder(arg) else os.path.dirname(os.path.abspath(arg))
    elif glob.has_magic(arg):
      matches, root = sorted(glob.glob(arg, recursive=True)), _glob_root(arg)
      if not matches:
        raise DataError(f"no file matches {arg}")
    else:
      raise DataError(f"data path does not exist: {arg}")
    skipped, before = _Skipped(), len(out)
    found = [path for match in matches for path in _inputs(match, root, match != arg, read, skipped)]
    for path in found:
      real = os.path.realpath(path)
      if real not in seen:
        seen.add(real)
        out.append((path, os.path.relpath(path, root).replace(os.sep, "/")))
    if not found:
      raise DataError(f"{arg} holds no data files (hidden files, cache folders and files that are not text are "
                      f"skipped{': ' + skipped.line() if skipped else ''})")
    if skipped and read:
      n = len(out) - before
      print(f"data: {arg}: read {n} {_plural(n, 'input')}, skipped {skipped.line()}", file=sys.stderr, flush=True)
  return out


class _Skipped:
  """What an argument's directories and glob skipped: files that are not text by suffix, hidden files, folders."""

  def __init__(self):
    self.not_text: dict[str, int] = {}
    self.hidden = 0
    self.folders: dict[str, int] = {}
    self.seen: set[str] = set()  # a glob's overlapping matches (`**`) reach a path more than once

  def add(self, path: str, not_text: bool = False):
    path = os.path.normpath(path)
    if path in self.seen:
      return
    self.seen.add(path)
    name = os.path.basename(path)
    if not_text:
      suffix = os.path.splitext(name)[1] or "(no suffix)"
      self.not_text[suffix] = self.not_text.get(suffix, 0) + 1
    elif os.path.isdir(path):
      self.folders[name + "/"] = self.folders.get(name + "/", 0) + 1
    else:
      self.hidden += 1

  def __bool__(self):
    return bool(self.not_text or self.hidden or self.folders)

  def line(self) -> str:
    """'3 not text (2 .png, 1 .pyc), 1 hidden file, 2 folders (1 .git/, 1 __pycache__/)'."""
    parts = []
    if self.not_text:
      parts.append(f"{sum(self.not_text.values())} not text ({_counts(self.not_text)})")
    if self.hidden:
      parts.append(f"{self.hidden} hidden {_plural(self.hidden, 'file')}")
    if self.folders:
      n = sum(self.folders.values())
      parts.append(f"{n} {_plural(n, 'folder')} ({_counts(self.folders)})")
    return ", ".join(parts)


def _counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _inputs(match, root, globbed, read, skipped):
  """The inputs one match of an argument stands for: a folder's files (`_walk`), or the match itself; a glob's match
  that is hidden or under a hidden or cache folder is skipped, as a folder's file would be."""
  folder = _is_folder(match)
  if globbed:
    rel = os.path.relpath(match, root).split(os.sep)
    parts = rel if folder else rel[:-1]
    bad = next((i for i, p in enumerate(parts) if p not in (".", "..") and not source_dir(p)), None)
    if bad is not None:  # the hidden or cache folder it is in (or is)
      skipped.add(os.path.join(root, *rel[:bad + 1]))
      return []
    if not folder and not not_hidden(rel[-1]):
      skipped.add(match)
      return []
  if folder:
    return _walk(match, read, skipped)
  return _text_only([match], read, skipped) if globbed else [match]


def _text_only(files, read, skipped):
  """`files` but, with `read`, those of the text format that are not text (`research.data.corpus`'s rule, on a file's
  first `TEXT_PROBE` bytes: every start reads this list, cache hit or not); a token array (.npy, .bin) stays, for
  `research.data.shards` to refuse in one line (it must be the only data path)."""
  out = []
  for f in files:
    if read and data_format(f) == "text" and not f.lower().endswith(_ARRAYS) and not _starts_as_text(f):
      skipped.add(f, not_text=True)
    else:
      out.append(f)
  return out


def _plural(n, word):
  return word if n == 1 else word + "s"


TEXT_PROBE = 1 << 16


def _starts_as_text(path) -> bool:
  """`is_text` of the file's first `TEXT_PROBE` bytes (a character cut there allowed)."""
  with open(path, "rb") as f:
    head = f.read(TEXT_PROBE)
  return is_text(head, whole=len(head) < TEXT_PROBE)


def data_format(path: str) -> str:
  """"datasets", "parquet", "arrow", "jsonl" or "text"."""
  if os.path.isdir(path):
    return "datasets"
  return next((kind for suffix, kind in sorted(SUFFIXES.items(), key=lambda s: -len(s[0]))
               if path.lower().endswith(suffix)), "text")


def structured_name(name: str) -> str:
  """`name` without its format suffix: a dataset converted between the structured formats keeps its name."""
  for suffix in sorted(SUFFIXES, key=len, reverse=True):
    if name.lower().endswith(suffix):
      return name[:-len(suffix)]
  return name


def is_dataset_dir(path: str) -> bool:
  """A `datasets` `save_to_disk` directory (a Dataset or a DatasetDict)."""
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _DATASET_MARKS)


def read_documents(path: str, field: str = "text", batch: int = BATCH) -> Iterator[list[str]]:
  """The documents of one input (a file or a `datasets` directory) as lists of at most `batch` strings, in row order.

  A text file is one document, decoded as UTF-8 with undecodable bytes kept as surrogate escapes (so its bytes
  come back exactly with `encode("utf-8", "surrogateescape")`). `field` is the column or key of the structured
  formats.
  """
  kind = data_format(path)
  if kind == "datasets":
    yield from _datasets(path, field, batch)
  elif kind == "parquet":
    yield from _parquet(path, field, batch)
  elif kind == "arrow":
    yield from _arrow(path, field, batch)
  elif kind == "jsonl":
    yield from _jsonl(path, field, batch)
  else:
    with open(path, "rb") as f:
      yield [f.read().decode("utf-8", "surrogateescape")]


def _is_folder(path):  # a directory that stands for the files under it
  return os.path.isdir(path) and not is_dataset_dir(path)


def _glob_root(pattern):
  parts = pattern.split("/")[:-1]
  head = []
  for part in parts:
    if glob.has_magic(part):
      break
    head.append(part)
  return "/".join(head) or ("/" if pattern.startswith("/") else ".")


def _walk(root, read=True, skipped=None):
  """The files and `datasets` directories under root, sorted by their relative path, but for what a text directory
  skips (`expand_named`), counted in `skipped`."""
  skipped = _Skipped() if skipped is None else skipped
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    keep = []
    for d in dirnames:
      if not source_dir(d):  # hidden or a cache: not walked
        skipped.add(os.path.join(dirpath, d))
        continue
      (out if is_dataset_dir(os.path.join(dirpath, d)) else keep).append(os.path.join(dirpath, d))
    dirnames[:] = [os.path.basename(d) for d in keep]  # prunes the walk: a dataset's own files are not inputs
    files = [os.path.join(dirpath, f) for f in filenames if os.path.isfile(os.path.join(dirpath, f))]
    for f in files:
      if not not_hidden(os.path.basename(f)):
        skipped.add(f)
    out += _text_only([f for f in files if not_hidden(os.path.basename(f))], read, skipped)
  return sorted(out, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def _one_line(e):
  text = " ".join(str(e).split())
  return text if len(text) <= 200 else text[:197] + "..."


def _listing(names):
  names = list(names)
  return ", ".join(names[:20]) + (f", … ({len(names)} in all)" if len(names) > 20 else "")


def _check_column(path, schema, field):
  import pyarrow as pa
  if field not in schema.names:
    raise DataError(f"{path}: no column '{field}' (columns: {_listing(schema.names)}); name the text column with "
                    "--data.field")
  kind = schema.field(field).type
  value = kind.value_type if pa.types.is_dictionary(kind) else kind
  if not (pa.types.is_string(value) or pa.types.is_large_string(value) or pa.types.is_string_view(value)):
    raise DataError(f"{path}: column '{field}' holds {kind}, not text; name a text column with --data.field")


def _texts(column) -> list[str]:
  return [t if t is not None else "" for t in column.to_pylist()]


def _parquet(path, field, batch):
  import pyarrow as pa
  import pyarrow.parquet as pq
  try:
    with pq.ParquetFile(path) as f:
      _check_column(path, f.schema_arrow, field)
      for records in f.iter_batches(batch_size=batch, columns=[field]):
        yield _texts(records.column(0))
  except (pa.ArrowException, OSError) as e:
    raise DataError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None


def _arrow(path, field, batch):
  import pyarrow as pa
  try:
    with pa.memory_map(path) as source:
      try:  # the IPC file format (pyarrow.ipc.new_file, Feather v2) ...
        reader = pa.ipc.open_file(source)
        records = (reader.get_batch(i) for i in range(reader.num_record_batches))
      except pa.ArrowInvalid:  # ... or the stream format, which `datasets.save_to_disk` writes
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        records = reader
      _check_column(path, reader.schema, field)
      column = reader.schema.get_field_index(field)
      for record in records:
        for i in range(0, record.num_rows, batch):
          yield _texts(record.column(column).slice(i, batch))
  except (pa.ArrowException, OSError) as e:
    raise DataError(f"{path}: not a readable Arrow file ({_one_line(e)})") from None


def _datasets(path, field, batch):
  try:
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
      with open(os.path.join(path, "dataset_dict.json")) as f:
        splits = json.load(f)["splits"]
      if "train" not in splits:
        raise DataError(f"{path} is a DatasetDict without a 'train' split (splits: {_listing(splits)}); pass one "
                        f"of them, e.g. {os.path.join(path, splits[0]) if splits else path}")
      path = os.path.join(path, "train")
    with open(os.path.join(path, "state.json")) as f:
      files = [entry["filename"] for entry in json.load(f)["_data_files"]]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise DataError(f"{path}: not a readable datasets directory ({_one_line(e)})") from None
  for name in files:
    yield from _arrow(os.path.join(path, name), field, batch)


def _jsonl(path, field, batch):
  opener = gzip.open if path.lower().endswith(".gz") else open
  docs = []
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except ValueError as e:
          hint = "; a .json file must be JSON Lines, one object per line" if line.lstrip().startswith("[") else ""
          raise DataError(f"{path}:{number}: not a JSON line ({_one_line(e)}){hint}") from None
        docs.append(_value(record, field, f"{path}:{number}"))
        if len(docs) == batch:
          yield docs
          docs = []
  except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # unreadable, truncated gzip, not UTF-8
    raise DataError(f"{path}: cannot read it as JSON Lines ({_one_line(e)})") from None
  if docs:
    yield docs


def _value(record, field, where):
  if not isinstance(record, dict):
    raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a '{field}' key")
  if field not in record:
    raise DataError(f"{where}: no key '{field}' (keys: {_listing(record)}); name the text key with --data.field")
  value = record[field]
  if value is None:
    return ""
  if not isinstance(value, str):
    raise DataError(f"{where}: '{field}' holds a {type(value).__name__}, not text; name a text key with --data.field")
  return value
