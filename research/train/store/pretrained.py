"""Models from elsewhere, with the tokenizer that goes with them: a Hugging Face directory (`models.from_hf`), an
optlab run directory (its config.json and the parameters of its newest checkpoint; optimizer state not read) or a
quantized model (`research.quantize`'s output, `models.quant_store`).

The paths a run's config.json records (its tokenizer, data, --init-from) are read as recorded, absolute, whatever the
working directory (research/train/config/paths.py); a run written before recorded them relative to the directory it
started in, which `recorded` finds from the run directory's path and its --out, or refuses in one line. A tokenizer
whose sha256 is not the one recorded is refused in one line naming it; an `hf:` source's changed config.json is one
warning line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import cast

import jax
from flax import nnx

from models import HFError, Transformer, TransformerConfig, from_hf, peft, quant, quant_store
from models.hf import config_from_hf
from research.data.tokenizer import ByteTokenizer, HFTokenizer, check_fits
from research.train.config import flat_record, paths
from research.train.config.prefixed import PeftFlags
from research.train.config.trainable import Trainable
from research.train.store.checkpoint import Checkpointer, CheckpointError
from sharding import logical_names
from sharding.state import param_shardings, variable_shardings


def hf_path(source: str) -> str | None:
  """The directory of an `hf:PATH` source (--init-from), or None for an optlab run directory."""
  return source[3:] if source.startswith("hf:") else None


def _config_json(path: str) -> dict:
  file = os.path.join(path, "config.json")
  try:
    return json.load(open(file))
  except (FileNotFoundError, NotADirectoryError):
    what = "a file, not a directory" if os.path.isfile(path) else "no config.json"
    raise CheckpointError(f"{path}: {what} (expected an optlab run directory or a Hugging Face model "
                          f"directory)") from None
  except IsADirectoryError:
    raise CheckpointError(f"{file} is a directory, not a file") from None
  except ValueError as e:
    raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def load_run(run_dir: str, mesh=None, step: int | None = None, merge: bool = True
             ) -> tuple[Transformer, TransformerConfig, int]:
  """(model, config, step) from an optlab run directory: the parameters of checkpoint `step` (default: the newest),
  each created on its shards of `mesh` (None: one device). A --peft run's model has its adapters merged into plain
  weights (`merge=False`: the adapted model, adapters and frozen base apart)."""
  meta = _config_json(run_dir)
  if "model_config" not in meta:
    raise CheckpointError(f"{run_dir}/config.json is not an optlab run's (no model_config)")
  config = TransformerConfig(**meta["model_config"])
  ckpt_dir = os.path.join(run_dir, "ckpt")
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"{run_dir}: no ckpt/ directory")
  if not any(d.isdigit() for d in os.listdir(ckpt_dir)):  # refused before orbax starts a background thread: one
    raise CheckpointError(f"{ckpt_dir}: no checkpoint to read")  # that outlives a quick exit dies with a traceback
  ckpt = Checkpointer(ckpt_dir)
  try:
    steps = ckpt.all_steps()
    if not steps or (step is not None and step not in steps):
      raise CheckpointError(f"{ckpt_dir}: no checkpoint {'' if step is None else step} to read".replace("  ", " "))
    step = steps[-1] if step is None else step
    settings = peft_settings(meta)
    if settings:
      graphdef, abstract, abstract_buffers = abstract_adapted(config, settings)
      sh = lambda tree: variable_shardings(tree, mesh)
      params, buffers = ckpt.restore_params(step, nnx.to_pure_dict(abstract), sh(abstract),
                                            nnx.to_pure_dict(abstract_buffers), sh(abstract_buffers))
      model = nnx.merge(graphdef, params, buffers)
      return (cast(Transformer, peft.merge(model)) if merge else model), config, step  # merged in place
    graphdef, abstract, names = logical_names(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    shardings = param_shardings(abstract, names, mesh)
    stored = Trainable.of_meta(meta).stored(abstract)
    rest = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Not(nnx.Param))
    extra: tuple = ()
    if jax.tree.leaves(rest):  # the model's other variables (PAD-Net's masks, a router's selection bias)
      params, restored = ckpt.restore_params(step, stored, shardings, nnx.to_pure_dict(rest),
                                             variable_shardings(rest, mesh))
      extra = (restored,)
    else:
      params = ckpt.restore_params(step, stored, shardings)
    params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract)  # stored bfloat16: the model's dtype
  finally:
    ckpt.close()
  return nnx.merge(graphdef, params, *extra), config, step


def peft_settings(meta: dict) -> dict | None:
  """A run's --peft settings from its config.json (None: not a PEFT run)."""
  train = flat_record(meta.get("train") or {})
  return train.get("peft") and {"method": train["peft"], **train["peft_options"]}


def recorded(run_dir: str, meta: dict, flag: str, hint: str = ""):
  """config.json's --`flag` (tokenizer, init_from or data) as the run resolved it: as recorded (absolute), or, when
  recorded relative by a run written before, against the directory that run started in (`paths.start_dir`); a
  CheckpointError when that cannot be told. `hint`: what to pass instead, said in the error."""
  train = flat_record(meta.get("train") or {})
  value = train.get(flag)
  entries = [value] if isinstance(value, str) else list(value or ())
  if not any(paths.is_relative(v, named=flag == "data") for v in entries):
    return (entries or None) if flag == "data" else value
  base = paths.start_dir(run_dir, train.get("out"))
  if base is None:
    name = "--" + flag.replace("_", "-")
    raise CheckpointError(f"{run_dir}/config.json records {name} {' '.join(entries)} relative to the directory the run "
                          f"was started in, which {run_dir} no longer tells (it was moved, or its --out was absolute)"
                          f"{': pass ' + hint if hint else ''}")
  if flag == "data":
    return list(paths.absolute_data(entries, base) or ()) or None
  return paths.absolute_source(value, base) if flag == "init_from" else paths.absolute(value, base)


def init_source(run_dir: str, hint: str = "") -> str | None:
  """The Hugging Face directory a run was fine-tuned from (--init-from hf:PATH, as `recorded`), else None."""
  return hf_path(recorded(run_dir, _config_json(run_dir), "init_from", hint) or "")


def source_dtype(run_dir: str) -> str | None:
  """The parameter dtype of the Hugging Face checkpoint a run was fine-tuned from (its torch_dtype), else None; a
  config.json that has changed since the run read it is one warning line."""
  path = init_source(run_dir, "--dtype")
  if not path:
    return None
  why = paths.changed((_config_json(run_dir).get("files") or {}).get("init_from"), os.path.join(path, "config.json"))
  if why:
    print(f"warning: {path}/config.json, which {run_dir} was fine-tuned from, {why}: its dtype is read as it is now "
          f"(--dtype chooses one)", file=sys.stderr, flush=True)
  return config_from_hf(_config_json(path))[1].param_dtype


def load_model(path: str, mesh=None, tokenizer: str | None = None):
  """(model, config, tokenizer) from an HF directory or an optlab run directory. The tokenizer: `tokenizer` if
  given, else the HF directory's tokenizer.json or the one the run was trained with (`run_tokenizer`), else bytes
  (an optlab run on text without --tokenizer trains on UTF-8 bytes)."""
  meta = _config_json(path)
  if meta.get("format") == quant_store.FORMAT:  # research.quantize's output
    model, config, _ = quant_store.load(path, mesh=mesh)
    own = os.path.join(path, "tokenizer.json")
    tok = HFTokenizer(tokenizer or own) if (tokenizer or os.path.exists(own)) else ByteTokenizer()
  elif "architectures" in meta:
    model, config = from_hf(path, mesh=mesh)
    tok = HFTokenizer(tokenizer or path) if (tokenizer or os.path.exists(os.path.join(path, "tokenizer.json"))) \
        else ByteTokenizer()
  else:
    model, config, _ = load_run(path, mesh=mesh)
    name = tokenizer or (run_tokenizer(path, meta) if tokenizer is None else None)
    tok = HFTokenizer(name) if name else ByteTokenizer()
  check_fits(tok, config.vocab_size)
  return model, config, tok


def run_tokenizer(run_dir: str, meta: dict | None = None) -> str | None:
  """The tokenizer.json a run was trained with (config.json's --tokenizer, as `recorded`), None for a byte-level run;
  a recorded tokenizer that is no longer there, or whose sha256 is not the recorded one, is refused in one line
  (CheckpointError), never replaced by bytes or by another file."""
  meta = _config_json(run_dir) if meta is None else meta
  path = recorded(run_dir, meta, "tokenizer", "--tokenizer with the tokenizer it was trained with")
  if path is None:
    return None
  file = paths.tokenizer_file(path)
  if not os.path.isfile(file):
    raise CheckpointError(f"{run_dir} was trained with --tokenizer {path}, which is not there any more: pass "
                          f"--tokenizer with the same tokenizer")
  why = paths.changed((meta.get("files") or {}).get("tokenizer"), file)
  if why:
    raise CheckpointError(f"{run_dir} was trained with --tokenizer {file}, which {why}: pass --tokenizer with the "
                          f"tokenizer it was trained with")
  return file


def run_data(run_dir: str, meta: dict | None = None) -> list[str] | None:
  """The --data a run was trained on (as `recorded`), None for the built-in corpus."""
  meta = _config_json(run_dir) if meta is None else meta
  return recorded(run_dir, meta, "data", "--data")


LOAD_ERRORS = (CheckpointError, HFError, quant.QuantError, ValueError)


def abstract_adapted(config: TransformerConfig, settings: dict):
  """(graphdef, abstract params, abstract buffers) of the adapted model a PEFT run's checkpoint holds.

  Args:
    config: the base model's config.
    settings: the run's adapters (`peft_settings`): {"method": ..., its --peft.* flags}.

  Returns:
    The adapted model split as `nnx.split(model, nnx.Param, ...)`, shapes only.
  """
  flags = PeftFlags(**{k: v for k, v in settings.items() if k != "method"})
  model = nnx.eval_shape(lambda: flags.adapted(Transformer(config, rngs=nnx.Rngs(0)), settings["method"], 0))
  return nnx.split(model, nnx.Param, ...)
