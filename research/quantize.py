"""Post-training quantization of an optlab run or a Hugging Face model (models/quant.py), evaluated on held-out data.

  python -m research.quantize runs/default runs/default_w4 --method gptq --bits 4
  python -m research.quantize runs/default runs/default_calm --method calm --bits 4   # CALM: per layer, by CKA
  python -m research.quantize runs/default runs/default_mp --method mixed --bits 4    # widths at W4's size
  python -m research.quantize runs/default runs/default_w8a8 --method smoothquant --bits 8 --act-bits 8
  python -m research.quantize runs/default plan.json --write-plan          # the plan of these flags, to edit
  python -m research.quantize runs/default runs/default_mixed --plan plan.json   # a plan applied as given
  python -m research.sample runs/default_w4                               # a quantized model samples like any

Calibration: --calib sequences of --calib-len tokens drawn from the training split (seed --calib-seed); evaluation:
--eval-batches fixed windows of the held-out split, the same for the full-precision and the quantized model. The data
is the run's own (its --data and --tokenizer) unless --data is given; an HF model's is the built-in corpus encoded
with its tokenizer.json. OUT gets the quantized model (models/quant_store.py: codes packed at their widths), its
plan.json and eval.json (losses, bytes on disk against the unquantized float32/bfloat16 parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import sys
import time
from typing import Annotated

import jax
import numpy as np
import tyro
from flax import nnx

from models import cross_entropy, quant, quant_mixed, quant_select, quant_store
from research import entry, flags
from research.data import DataError, eval_batches, get_batch, load_corpus
from research.train.store.pretrained import LOAD_ERRORS, load_model, run_data, run_tokenizer
from sharding.mesh import make_mesh
from sharding.state import place_variables


def _algorithms(text: str):
  """--candidates: comma-separated algorithms of `quant.ALGORITHMS`."""
  unknown = [a for a in text.split(",") if a and a not in quant.ALGORITHMS]  # empty parts are skipped, as run's
  if unknown:
    raise ValueError(f"{', '.join(map(repr, unknown))} not among {', '.join(quant.ALGORITHMS)}")


def _data_path(text: str):
  """--data: a path that exists (`~` expanded) or a glob that matches something, as `load_corpus` reads them."""
  path = os.path.expanduser(text)
  if not (os.path.exists(path) or glob.has_magic(path) and glob.glob(path, recursive=True)):
    raise ValueError("no such file or directory, and no glob match")


def _pattern(text: str):
  """--targets: a regular expression."""
  try:
    re.compile(text)
  except re.error as e:
    raise ValueError(f"not a regular expression ({e})") from None


@dataclasses.dataclass
class QuantizeConfig:
  """Quantize a model's projections after training and compare its held-out loss and size with full precision."""
  source: tyro.conf.Positional[Annotated[str, flags.EXISTING]]
  """An optlab run directory (its newest checkpoint) or a Hugging Face model directory."""
  out: tyro.conf.Positional[Annotated[str, flags.OUT_DIR]]
  """Created for the quantized model (an existing non-empty directory is refused); with --write-plan, the plan file."""
  method: Annotated[str, flags.one_of(*quant.ALGORITHMS, "calm", "mixed")] = "gptq"
  """One algorithm for every layer: rtn, gptq, awq or smoothquant; or calm: per layer, the --candidates algorithm
  whose layer output keeps the highest CKA with full precision; or mixed: RTN at a width per layer and projection
  from {2, 3, 4, 8, 16}, within the size of uniform --bits, by --sensitivity (ignored with --plan)."""
  candidates: Annotated[str, flags.Rule(parse=_algorithms)] = "rtn,gptq,awq,smoothquant"
  """--method calm: the algorithms to choose from, each at the same --bits, --group, --act-bits."""
  select_by: Annotated[str, flags.one_of(*quant_select.SCORES)] = "cka"
  """--method calm: cka (CALM) or mse (the layer output's mean squared error)."""
  sensitivity: Annotated[str, flags.one_of(*quant_mixed.SENSITIVITIES)] = "first_order"
  """--method mixed: first_order (⟨∂L/∂W, ΔW⟩, the loss-aware layout), hessian (HAWQ's ½Tr(H)/n‖ΔW‖²) or
  first_plus_hessian (their sum)."""
  search: Annotated[str, flags.one_of("exact", "greedy")] = "exact"
  """--method mixed: exact (dynamic programming) or greedy."""
  hessian_samples: int = 16
  """--method mixed --sensitivity hessian: Hutchinson probes."""
  bits: Annotated[int, flags.Rule(choices=quant.BITS)] = 4
  """Weight bits: 2, 3, 4, 8, 16 (rounded to bfloat16) or 32 (left as it is)."""
  group: Annotated[int, flags.NONNEGATIVE] = 0
  """Inputs sharing a scale; 0: one scale per output channel."""
  asymmetric: bool = False
  """Zero points (min/max calibration; 4 or 8 bits) instead of symmetric absmax."""
  act_bits: Annotated[int, flags.Rule(choices=quant.ACT_BITS)] = 0
  """8: quantize the projections' inputs per token (W8A8); 0: activations in full precision."""
  alpha: float = 0.5
  """SmoothQuant's migration strength."""
  targets: Annotated[str, flags.Rule(parse=_pattern)] = quant.DEFAULT_TARGETS
  """A regular expression over weight paths (blocks/wq_DQ, blocks/moe/w_up_EDF, ...) to quantize."""
  plan: Annotated[str | None, flags.Rule(path="file")] = None
  """A plan file (JSON: one spec per layer of each projection) applied as given, instead of the flags above."""
  write_plan: bool = False
  """Write the plan the flags give to OUT (a .json file) and stop: a starting point to edit."""
  data: Annotated[str | None, flags.Rule(parse=_data_path)] = None
  """The corpus (default: the run's own; an HF model: the built-in corpus)."""
  tokenizer: Annotated[str | None, flags.EXISTING] = None
  """A tokenizer.json for the corpus (default: the run's, or the HF directory's)."""
  calib: int = 32
  """Calibration sequences."""
  calib_len: int = 128
  """Tokens per calibration sequence (and per evaluation window)."""
  calib_seed: int = 0
  """Which training windows calibrate."""
  eval_batches: int = 8
  """Held-out batches of --batch-size windows."""
  batch_size: int = 8
  mesh: str | None = None
  """Evaluate on this mesh (e.g. fsdp=4,tensor=2); default one device."""


def _data(cfg: QuantizeConfig):
  meta = json.load(open(os.path.join(cfg.source, "config.json")))
  hf_tok = os.path.join(cfg.source, "tokenizer.json")  # the run's paths as it recorded them, from any directory
  tokenizer = cfg.tokenizer or run_tokenizer(cfg.source, meta) or (hf_tok if os.path.exists(hf_tok) else None)
  corpus = load_corpus(cfg.data if cfg.data is not None else run_data(cfg.source, meta), tokenizer=tokenizer)
  then = (meta.get("corpus") or {}).get("fingerprint")
  if cfg.data is None and cfg.tokenizer is None and then and then != corpus.fingerprint:  # the run's own data, edited
    print(f"warning: the data {cfg.source} was trained on has changed since (fingerprint {then[:12]}… then, "
          f"{corpus.fingerprint[:12]}… now): both models are measured on it as it is now", file=sys.stderr)
  return corpus, tokenizer


def eval_loss(model, batches, mesh=None) -> float:
  """Mean cross entropy (nats/token) over `batches`, the model placed on `mesh` by its logical names."""
  graphdef, state = nnx.split(model)
  if mesh is not None:
    state = place_variables(state, mesh)
  f = jax.jit(lambda s, x, y: cross_entropy(nnx.merge(graphdef, s)(x), y))
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    return float(np.mean([float(f(state, x, y)) for x, y in batches]))


def _spec(cfg: QuantizeConfig, algorithm: str) -> quant.Spec:
  return quant.Spec(algorithm, cfg.bits, cfg.group, not cfg.asymmetric, cfg.act_bits, cfg.alpha).check()


def plan_of(cfg: QuantizeConfig, model, calib) -> tuple[quant.Plan, dict | None]:
  """(the plan, how it was chosen or None); calm and mixed choose on the calibration windows `calib` = (x, y)."""
  if cfg.plan is not None:
    plan = quant.read_plan(cfg.plan)
    quant.check_plan(model, plan)
    return plan, None
  if cfg.method == "calm":
    candidates = {a: _spec(cfg, a) for a in cfg.candidates.split(",") if a}
    plan, scores = quant_select.choose(model, candidates, calib[0], by=cfg.select_by, pattern=cfg.targets)
    return plan, {"by": cfg.select_by, "per_layer": scores, "chosen": [s.algorithm for s in next(iter(plan.values()))]}
  if cfg.method == "mixed":
    return _mixed_plan(cfg, model, calib)
  plan = quant.uniform_plan(model, _spec(cfg, cfg.method), cfg.targets)
  quant.check_plan(model, plan)
  return plan, None


def _mixed_plan(cfg: QuantizeConfig, model, calib) -> tuple[quant.Plan, dict]:
  _spec(cfg, "rtn")
  if cfg.search not in ("exact", "greedy"):
    raise quant.QuantError(f"unknown --search {cfg.search!r}; choose exact or greedy")
  sens = quant_mixed.sensitivity(model, *calib, cfg.targets, group=cfg.group)
  if cfg.sensitivity != "first_order":
    quant_mixed.add_hessian(sens, model, *calib, group=cfg.group, samples=cfg.hessian_samples)
  cost = sens.cost(cfg.sensitivity)
  budget = int(sens.bytes[:, sens.bits.index(cfg.bits)].sum())
  choice = (quant_mixed.exact if cfg.search == "exact" else quant_mixed.greedy)(cost, sens.bytes, budget)
  plan = quant_mixed.plan_of(sens, choice, cfg.group)
  return plan, {"sensitivity": cfg.sensitivity, "search": cfg.search, "budget_bytes": budget,
                "layout_bytes": quant_mixed.layout_bytes(sens, choice),
                "predicted_delta": quant_mixed.predicted(sens, choice, cfg.sensitivity),
                "bits": {f"{p}[{layer}]": sens.bits[k] for (p, layer), k in zip(sens.units, choice)}}


def run(cfg: QuantizeConfig) -> dict:
  if not cfg.write_plan and os.path.exists(cfg.out) and os.listdir(cfg.out):
    raise quant.QuantError(f"{cfg.out}: exists and is not empty; nothing was written")
  model, config, _ = load_model(cfg.source, tokenizer=cfg.tokenizer)
  mesh = make_mesh(cfg.mesh) if cfg.mesh else None
  corpus, tokenizer = _data(cfg)
  if corpus.vocab_size > config.vocab_size:
    raise DataError(f"the data has {corpus.vocab_size} token ids but the model's vocab_size is {config.vocab_size}")
  calib = get_batch(corpus.train, cfg.calib_seed, 0, cfg.calib, cfg.calib_len)
  val = eval_batches(corpus.val, cfg.batch_size, cfg.calib_len, cfg.eval_batches)
  t = time.perf_counter()
  plan, scores = plan_of(cfg, model, calib)
  t_choose = time.perf_counter() - t
  if cfg.write_plan:
    if os.path.exists(cfg.out):
      raise quant.QuantError(f"{cfg.out}: exists; nothing was written")
    quant.write_plan(plan, cfg.out)
    return {"plan": cfg.out}
  t = time.perf_counter()
  full = eval_loss(model, val, mesh)
  t_full = time.perf_counter() - t
  t = time.perf_counter()
  quant.quantize(model, plan, calib[0])
  t_quant = time.perf_counter() - t
  t = time.perf_counter()
  loss = eval_loss(model, val, mesh)
  t_eval = time.perf_counter() - t
  files = {"plan.json": quant.plan_to_json(plan)}
  tok_file = tokenizer and (os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer)
  if tok_file and os.path.isfile(tok_file):
    files["tokenizer.json"] = json.load(open(tok_file))
  quant_store.save(model, cfg.out, source=os.path.abspath(cfg.source), extra=files)
  report = {"source": os.path.abspath(cfg.source), "full_loss": full, "quant_loss": loss, "delta": loss - full,
            "stored_bytes": quant_store.stored_bytes(cfg.out), "float32_bytes": quant_store.full_bytes(config),
            "bfloat16_bytes": quant_store.full_bytes(config, "bfloat16"), "calib": [cfg.calib, cfg.calib_len],
            "eval_windows": cfg.eval_batches * cfg.batch_size, "quantize_s": t_quant, "choose_s": t_choose,
            "selection": scores,
            "eval_s": {"full": t_full, "quantized": t_eval}}
  with open(os.path.join(cfg.out, "eval.json"), "w") as f:
    json.dump(report, f, indent=1)
  return report


def main(argv=None):
  cfg = tyro.cli(QuantizeConfig, args=argv)
  with entry.one_line_errors(*LOAD_ERRORS, quant.QuantError, DataError, OSError):
    flags.check_config(cfg, skip=("out",) if cfg.write_plan else ())  # --write-plan: OUT is the plan file
    report = run(cfg)
  if "plan" in report:
    print(f"wrote the plan to {report['plan']}")
    return
  mib = lambda b: f"{b / 2**20:.2f} MiB"
  chosen = report["selection"] or {}
  if "chosen" in chosen:
    print(f"{chosen['by']} choice per layer: {', '.join(chosen['chosen'])}")
  if "predicted_delta" in chosen:
    print(f"{chosen['sensitivity']} layout ({chosen['search']}): {chosen['layout_bytes']:,} of "
          f"{chosen['budget_bytes']:,} bytes, predicted Δ {chosen['predicted_delta']:+.4f}")
  print(f"held-out loss: full precision {report['full_loss']:.4f}, quantized {report['quant_loss']:.4f} "
        f"(Δ {report['delta']:+.4f})")
  print(f"size on disk: {mib(report['stored_bytes'])} vs {mib(report['float32_bytes'])} float32 "
        f"({report['float32_bytes'] / report['stored_bytes']:.2f}×), {mib(report['bfloat16_bytes'])} bfloat16")
  print(f"wrote {cfg.out}")


if __name__ == "__main__":
  entry.command(main)
