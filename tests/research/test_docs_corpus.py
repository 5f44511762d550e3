"""The fine-tuning corpus built from the runtime dependencies' package descriptions: exactly the runtime closure
(no test-only oracle), each file the package's own metadata text, built once, split by document."""

import importlib.metadata as md
import os

import pytest

from research.data import DataError, docs_corpus, load_corpus
from research.data.corpus import _is_val


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  return docs_corpus.build(str(tmp_path_factory.mktemp("cache")))


def test_runtime_closure_only():
  names = {docs_corpus._key(d.metadata["Name"]) for d in docs_corpus.runtime_distributions()}
  assert {"jax", "flax", "optax", "numpy", "tokenizers", "safetensors"} <= names
  assert "optlab" not in names
  for test_only in ("torch", "transformers", "pytest", "pytorch-optimizer"):  # extras of optlab, installed here
    assert test_only not in names


def test_files_are_the_package_descriptions(built):
  files = sorted(os.listdir(built))
  assert "jax.md" in files and "flax.md" in files
  for f in files:
    dist = md.distribution(f[:-3])
    text = open(os.path.join(built, f), encoding="utf-8").read()
    assert text.startswith(f"{dist.metadata['Name']} {dist.version}:")
    assert dist.metadata.get_payload().strip() in text
    assert len(text) >= docs_corpus.MIN_CHARS


def test_built_once(built):
  before = {f: os.stat(os.path.join(built, f)).st_mtime_ns for f in os.listdir(built)}
  assert docs_corpus.build(os.path.dirname(built)) == built
  assert {f: os.stat(os.path.join(built, f)).st_mtime_ns for f in os.listdir(built)} == before
  assert not [d for d in os.listdir(os.path.dirname(built)) if d.startswith(".docs-")]  # no temporary left


def test_split_by_package(built):
  corpus = load_corpus(built)
  val_files = [f for f in sorted(os.listdir(built)) if _is_val(f, 0.05)]
  assert val_files, "no held-out package: the split would be empty"
  val_bytes = sum(os.path.getsize(os.path.join(built, f)) + 1 for f in val_files)  # + the separator byte
  assert len(corpus.val) == val_bytes and corpus.vocab_size == 256
  assert len(corpus.train) + len(corpus.val) == sum(os.path.getsize(os.path.join(built, f)) + 1
                                                    for f in os.listdir(built))


def test_cli_prints_the_directory(built, capsys):
  assert docs_corpus.main([os.path.dirname(built)]) == 0
  assert capsys.readouterr().out.strip() == built
  capsys.readouterr()
  assert docs_corpus.main(["--help"]) == 0  # the usage, as every command answers --help (the docs' command check asks)
  assert capsys.readouterr().out.startswith("usage: python -m research.data.docs_corpus [CACHE_DIR]\n")
  for argv, says in ((["--bogus"], "usage: python -m research.data.docs_corpus [CACHE_DIR]"),
                     ([__file__], f"{__file__}")):  # a file for the cache directory: one line, not a traceback
    with pytest.raises(SystemExit) as e:
      docs_corpus.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err


def test_not_installed_is_one_clear_error():
  with pytest.raises(DataError, match="not installed as a package"):
    docs_corpus.runtime_distributions("no-such-package-optlab")


def test_the_license_corpus_holds_each_distributions_license_texts(tmp_path):
  """The third corpus (research/experiments/data_mixing.py): one document per runtime distribution that ships a
  license file, headed "name version license", each distinct text once; held-out packages as for the docs corpus."""
  import importlib.metadata as md
  path = docs_corpus.build(str(tmp_path), kind="licenses")
  assert os.path.basename(path).startswith("licenses-") and docs_corpus.build(str(tmp_path), kind="licenses") == path
  files = sorted(os.listdir(path))
  assert len(files) >= 10
  numpy_doc = open(os.path.join(path, "numpy.md"), encoding="utf-8").read()
  assert numpy_doc.startswith(f"numpy {md.version('numpy')} license\n\n") and "Copyright" in numpy_doc
  corpus = load_corpus(path)
  assert len(corpus.train) > 0 and len(corpus.val) > 0
