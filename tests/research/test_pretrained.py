"""Runs and Hugging Face directories as models: parameters-only restore, export to the HF format (transformers
loads it with our logits), sampling from either, tokenizers, and one-line errors."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import models
from research import export, sample
from research.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError
from research.train import TrainConfig, run
from research.train.store.checkpoint import CheckpointError
from research.train.store.pretrained import load_model, load_run

TINY = dict(model="tiny", steps=4, batch_size=8, seq_len=32, log_every=1, eval_every=4, ckpt_every=4,
            warmup_steps=1, eval_batches=1, progress=False, mesh="data=-1")
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 9))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  out = tmp_path_factory.mktemp("run")
  run(TrainConfig(out=str(out), **TINY))
  return str(out)


def test_a_run_exports_and_transformers_gives_its_logits(trained, tmp_path, capsys):
  model, config, step = load_run(trained)
  assert step == 4 and config == models.preset("tiny")
  export.main([trained, str(tmp_path / "hf")])
  assert "step 4" in capsys.readouterr().out
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  with torch.no_grad():
    want = hf(torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), want, rtol=1e-4, atol=1e-5)
  with pytest.raises(SystemExit) as e:  # never into a non-empty directory
    export.main([trained, str(tmp_path / "hf")])
  assert e.value.code == 2 and "exists and is not empty" in capsys.readouterr().err


def test_sampling_a_run_and_its_export_gives_the_same_text(trained, tmp_path, capsys):
  export.main([trained, str(tmp_path / "hf")])
  capsys.readouterr()
  texts = []
  for path in (trained, str(tmp_path / "hf"), trained):
    sample.main([path, "--prompt", "import ", "--max-new-tokens", "24", "--seed", "7"])
    texts.append(capsys.readouterr().out)
  assert texts[0] == texts[1] == texts[2] and texts[0].startswith("import ") and len(texts[0]) > len("import ")
  model, _, tok = load_model(trained)
  greedy = models.generate(model, tok.encode("import "), 24)
  sample.main([trained, "--prompt", "import ", "--max-new-tokens", "24", "--temperature", "0"])
  assert capsys.readouterr().out == "import " + tok.decode(np.asarray(greedy)[7:]) + "\n"


def test_a_tokenizer_json_is_used_and_checked(tmp_path, capsys):
  from tokenizers import Tokenizer, pre_tokenizers
  from tokenizers import models as tmodels
  vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"])}
  tok = Tokenizer(tmodels.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  hf_dir = tmp_path / "hf"
  models.to_hf(models.Transformer(models.preset("tiny", vocab_size=16), rngs=nnx.Rngs(0)), str(hf_dir))
  tok.save(str(hf_dir / "tokenizer.json"))
  model, _, loaded = load_model(str(hf_dir))
  assert isinstance(loaded, HFTokenizer) and loaded.encode("the cat sat") == [1, 2, 3]
  sample.main([str(hf_dir), "--prompt", "the cat", "--max-new-tokens", "5", "--temperature", "0"])
  ids = np.asarray(models.generate(model, [1, 2], 5))[2:]
  assert capsys.readouterr().out == "the cat" + loaded.decode(ids) + "\n"
  small = tmp_path / "small"
  models.to_hf(models.Transformer(models.preset("tiny", vocab_size=4), rngs=nnx.Rngs(0)), str(small))
  with pytest.raises(TokenizerError, match="8 ids but the model's vocab_size is 4"):
    load_model(str(small), tokenizer=str(hf_dir / "tokenizer.json"))
  assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"


def test_a_run_trained_with_a_tokenizer_samples_and_exports_with_it(tmp_path, capsys):
  """The run directory knows its tokenizer: research.sample uses it without --tokenizer, research.export writes it
  beside the weights, and a tokenizer that has gone away is one error line, not bytes in and out."""
  from tiny_text import byte_bpe
  docs = [f"def f{i}(x):\n    return x * {i} + 1\n" * 20 for i in range(30)]
  data = tmp_path / "data"
  data.mkdir()
  for i, d in enumerate(docs):
    (data / f"d{i}.py").write_text(d)
  tok_path = tmp_path / "tok.json"
  byte_bpe(tok_path, docs, 200)
  out = tmp_path / "run"
  run(TrainConfig(out=str(out), data=(str(data),), tokenizer=str(tok_path), **{**TINY, "mesh": "data=-1"}))
  model, _, loaded = load_model(str(out))
  assert isinstance(loaded, HFTokenizer) and loaded.name == str(tok_path)
  capsys.readouterr()
  sample.main([str(out), "--prompt", "def f", "--max-new-tokens", "6", "--temperature", "0"])
  ids = np.asarray(models.generate(model, loaded.encode("def f"), 6))[len(loaded.encode("def f")):]
  assert capsys.readouterr().out == "def f" + loaded.decode(ids) + "\n"
  export.main([str(out), str(tmp_path / "hf")])
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
  tok_path.rename(tmp_path / "moved.json")
  for main, argv in ((sample.main, [str(out)]), (export.main, [str(out), str(tmp_path / "hf2")])):
    with pytest.raises(SystemExit) as e:
      main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "trained with --tokenizer" in err, err
  assert not (tmp_path / "hf2").exists()


def test_bad_paths_are_one_line_errors(tmp_path, capsys):
  for argv in ([str(tmp_path / "nowhere")], [str(tmp_path), "--tokenizer", str(tmp_path / "no.json")]):
    with pytest.raises(SystemExit) as e:
      sample.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
  (tmp_path / "config.json").write_text(json.dumps({"model_config": models.preset("tiny").__dict__ | {"moe": None}}))
  with pytest.raises(CheckpointError, match="no ckpt/ directory"):
    load_run(str(tmp_path))
  assert not os.path.exists(tmp_path / "ckpt")  # reading never creates anything


def test_an_empty_ckpt_directory_is_refused_before_orbax_starts(tmp_path, monkeypatch):
  """sample/export/quantize on a run whose ckpt/ is empty: refused before a CheckpointManager exists (its background
  cleanup thread, racing the interpreter's exit, printed a 43-line traceback in some of the runs)."""
  (tmp_path / "config.json").write_text(json.dumps({"model_config": models.preset("tiny").__dict__ | {"moe": None}}))
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1").mkdir()  # an uncommitted save is not a checkpoint either
  import research.train.store.pretrained as pretrained

  def no_manager(*a, **k):
    raise AssertionError("a CheckpointManager was created for an empty ckpt/")

  monkeypatch.setattr(pretrained, "Checkpointer", no_manager)
  with pytest.raises(CheckpointError, match="ckpt: no checkpoint to read"):
    load_run(str(tmp_path))
