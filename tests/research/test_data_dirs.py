"""A directory of structured data skips what a directory of text skips (issue 48): hidden files, hidden and cache
folders and files that are not text, said in one stderr line; the token cache's key is over the files read, so a
skipped file never rebuilds it."""

import json
import os

import numpy as np
import pytest

from research.data import DataError, documents, load_corpus, read_corpus

DOCS = [f"document {i}: " + "words of text " * (20 + i) for i in range(40)]


def _mixed(d, first="data.jsonl"):
  """A directory holding one JSON Lines file among what a text directory skips."""
  d.mkdir()
  (d / first).write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
  (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
  (d / ".notes").write_text("a hidden file\n")
  (d / "__pycache__").mkdir()
  (d / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\xa7\r\r\n" + bytes(200))
  return d


def _documents(corpus):
  return sorted(bytes(np.concatenate([corpus.train, corpus.val])).decode().split("\0")[:-1])


def test_a_jsonl_directory_reads_only_its_documents_and_says_what_it_skipped(tmp_path, capsys):
  d = _mixed(tmp_path / "d")
  c = load_corpus(str(d), cache_dir=str(tmp_path / "cache"))
  assert _documents(c) == sorted(DOCS)  # not the image's bytes, not the bytecode, not the hidden file
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"data: {d}: read 1 input, skipped "), err
  assert all(word in err[0] for word in ("1 not text (1 .png)", "1 hidden file", "__pycache__/")), err


def test_a_glob_skips_the_same(tmp_path, capsys):
  d = _mixed(tmp_path / "d")
  (d / "more.txt").write_text("a text file is one document\n")
  got = [name for _, name in documents.expand_named([f"{d}/**"])]
  assert got == ["data.jsonl", "more.txt"]
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "1 not text (1 .png)" in err[0] and "__pycache__/" in err[0], err


def test_a_structured_directory_keeps_the_files_a_text_directory_reads(tmp_path, capsys):
  """The same tree read as text (`read_corpus`) and as documents: the same files, every one of them a document."""
  d = tmp_path / "tree"
  (d / "pkg" / "__pycache__").mkdir(parents=True)
  (d / ".git").mkdir()
  texts = {f"pkg/m{i}.py": f"def f{i}():\n  return {i}\n" * 30 for i in range(12)}
  for name, text in texts.items():
    (d / name).write_text(text)
  (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
  (d / "pkg" / "__pycache__" / "m0.pyc").write_bytes(b"\xa7\r\r\n" + bytes(50))
  (d / "pkg" / "icon.png").write_bytes(bytes(range(256)))
  (d / "pkg" / ".hidden.py").write_text("x = 1\n")
  as_text = read_corpus(str(d), val_fraction=0.5)
  names = [name for _, name in documents.expand_named([str(d)])]
  assert names == sorted(texts)
  assert _documents(as_text) == sorted(texts.values())


def test_a_skipped_file_changed_builds_no_new_cache(tmp_path, capsys):
  """The cache key hashes the files read: editing the image beside the data maps the same cache."""
  d = _mixed(tmp_path / "d")
  cache = tmp_path / "cache"
  first = load_corpus(str(d), cache_dir=str(cache))
  (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 9)
  (d / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\xa7\r\r\n" + bytes(300))
  again = load_corpus(str(d), cache_dir=str(cache))
  assert again.fingerprint == first.fingerprint and len([n for n in os.listdir(cache) if n.startswith("shards-")]) == 1


def test_a_directory_of_nothing_but_skipped_files_is_refused_in_one_line(tmp_path):
  d = tmp_path / "d"
  d.mkdir()
  (d / "a.jsonl.png").write_bytes(bytes(range(256)))
  (d / ".b.jsonl").write_text(json.dumps({"text": "hidden"}) + "\n")
  with pytest.raises(DataError, match=r"holds no data files .*skipped: 1 not text \(1 \.png\), 1 hidden file\)"):
    documents.expand_named([str(d)])
