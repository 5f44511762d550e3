"""Post-training quantization of models trained here: four algorithms at two budgets, CALM's CKA-guided choice per
layer against the MSE choice and an oracle, and loss-aware mixed precision against HAWQ and uniform widths.

Claims (shared/reference/methods.md). §5 CALM (arXiv 2512.16282): choosing per layer the algorithm whose output keeps
the highest CKA with full precision beats every uniform algorithm. §6 (Cheng & Chen, arXiv 2207.10083): a per-layer
bit layout chosen by the first-order effect of quantization noise can have a *lower* loss than full precision, and
the first-order criterion beats Hessian-based layouts (HAWQ).

Setup. Each model (`small`, d 256 × 4 layers; `base`, d 768 × 12 layers) is pretrained here with AdamW on the default
corpus (the standard library's Python source, bytes) by the train CLI, one run. Calibration: `calib` training windows
of `seq_len` bytes drawn with seed s ∈ `seeds` (3 calibration sets); everything is judged on the same held-out
windows of the corpus' val split (files never trained on), and on the calibration windows themselves where the claim
is about them. Targets: the 7 attention and MLP projections of every layer (embeddings, head, norms stay float32).
`--models` also takes a model directory (a Hugging Face model, with its tokenizer if it has one, or an optlab run):
the tests run a random tiny Llama built by `transformers` through the whole study at smoke size.

  uniform      every layer by one algorithm: rtn, gptq, awq, smoothquant (models/quant.py) at the budget's width
  calm         per layer, the candidate whose block update keeps the highest linear CKA with full precision
  mse          per layer, the candidate whose block update has the least mean squared error
  oracle       per layer, the candidate with the least held-out loss when that layer alone is quantized (the
               others float32): what the held-out loss itself would choose, one layer at a time
Budgets: W3 with groups of 64 inputs (weights only) and W8A8 (per-channel int8 weights, per-token int8 activations),
all symmetric. CALM's diagnostics: its agreement with the oracle (share of layers choosing the same algorithm), the
MSE choice's, and Spearman's ρ between a (layer, algorithm)'s CKA and the held-out loss change of quantizing that
layer alone (over all pairs; CKA is measured after the already-chosen layers, the oracle's change with the others
float32).

Mixed precision (RTN, per output channel): a width per (layer, projection) from {2, 3, 4, 8, 16} within the bytes of
uniform b-bit RTN, b ∈ `mixed_bits`, by the first-order term ⟨∂L/∂W, ΔW⟩ on the calibration windows (exact knapsack
and greedy), by HAWQ's ½·Tr(H)/n·‖ΔW‖² (exact; Hutchinson with `hessian_samples` probes), by their sum (the
second-order expansion: §6 asks for a negative first-order term *and* a small second-order one), and uniform b.
Reported: the held-out and calibration ΔL of each layout, its predicted ΔL, the share of layouts whose held-out ΔL < 0,
and the correlation between predicted and measured ΔL.

Speed: held-out evaluation (jitted forward and loss, after compilation, median of 3) of the float32 model, uniform
W3 RTN and W8A8 SmoothQuant, as a ratio to float32, on this CPU. Quantized weights are dequantized inside the forward
and activations fake-quantized (the arithmetic qwix's int8 dot_general equals, tested); no integer kernels.

  python -m research.experiments.quantization           # full size: writes research/results/quantization/
  python -m research.experiments.quantization --smoke   # a minute; writes nothing (the tests run this)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from typing import Annotated

import jax
import numpy as np
from flax import nnx
from scipy.stats import pearsonr, spearmanr

from models import cross_entropy, quant, quant_mixed, quant_select, quant_store
from research import flags
from research.data import eval_batches, get_batch, load_corpus
from research.data.tokenized import tokenize_corpus
from research.experiments import common
from research.train.config import TrainConfig
from research.train.hooks.throughput import median_seconds
from research.train.store import integrity
from research.train.store.pretrained import LOAD_ERRORS, load_model

NAME = "quantization"
QUESTION = ("Post-training quantization of models trained here: how do RTN, GPTQ, AWQ and SmoothQuant compare at W3 "
            "and W8A8; does CALM's per-layer choice by CKA beat every uniform algorithm and agree with what the "
            "held-out loss would choose; and can a loss-aware mixed-precision layout beat HAWQ's, uniform widths, "
            "or even full precision on held-out data?")
ALGORITHMS = ("rtn", "gptq", "awq", "smoothquant")
BUDGETS = {"w3g64": quant.Spec(bits=3, group=64), "w8a8": quant.Spec(bits=8, act_bits=8)}
PRETRAIN_LR = {"tiny": 3e-3, "small": 3e-3, "base": 1e-3}


def _model(name: str):
  """A --models entry: a preset, or a directory (an HF model or an optlab run) that exists."""
  if name not in flags.presets() and not os.path.isdir(name):
    raise ValueError(f"neither a preset ({', '.join(flags.presets())}) nor a directory")


MODEL = flags.Rule(parse=_model)


@dataclasses.dataclass
class Config(common.Base):
  """Pretrain each model; quantize it every way, on 3 calibration sets."""
  smoke: bool = False
  """Two layers of `tiny`, a few steps and windows, one seed, in a temporary directory: nothing written to `out`."""
  out: str = "research/results/quantization"
  work: str = "runs/experiments/quantization"
  """Pretraining run directories (a finished run is reused)."""
  models: Annotated[tuple[str, ...], MODEL] = ("small", "base")
  """Presets (tiny, small, base) are pretrained here; anything else is a directory taken as it is: a Hugging Face
  model (its tokenizer.json, if any, re-encodes the corpus; else bytes) or an optlab run."""
  n_layers: int | None = None
  pretrain_steps: int = 600
  pretrain_batch: int = 16
  seq_len: int = 128
  calib: int = 32
  """Calibration windows (of seq_len bytes)."""
  seeds: tuple[int, ...] = (0, 1, 2)
  """Calibration seeds: which training windows calibrate."""
  eval_batches: int = 16
  batch_size: int = 8
  budgets: Annotated[tuple[str, ...], flags.one_of(*BUDGETS)] = tuple(BUDGETS)
  mixed_bits: tuple[int, ...] = (3, 4, 8)
  """Mixed-precision budgets: the bytes of uniform b-bit RTN."""
  hessian_samples: int = 16


SMOKE = dict(models=("tiny",), n_layers=2, pretrain_steps=4, pretrain_batch=8, seq_len=32, calib=4, seeds=(0,),
             eval_batches=2, batch_size=4, mixed_bits=(4,), hessian_samples=2)


def _spec(budget: str, algorithm: str) -> quant.Spec:
  return dataclasses.replace(BUDGETS[budget], algorithm=algorithm)


def pretrain(cfg: Config, model: str, work: str) -> str:
  over = {} if cfg.n_layers is None else {"n_layers": cfg.n_layers}
  tc = TrainConfig(model=model, steps=cfg.pretrain_steps, batch_size=cfg.pretrain_batch, seq_len=cfg.seq_len,
                   eval_every=cfg.pretrain_steps, log_every=max(1, cfg.pretrain_steps // 10), eval_batches=4,
                   ckpt_every=min(100, cfg.pretrain_steps), devices=1, mesh="data=-1", progress=False, keep=1,
                   **over)  # a checkpoint every 100 steps: an interrupted pretraining (base: most of an hour) resumes
  return common.pretrained_run(os.path.join(work, model), tc, PRETRAIN_LR[model])


class Evaluator:
  """Mean cross entropy of a model on fixed batches, compiled once for every model of one structure: the programs of
  two quantized models differ only in static bookkeeping (their specs), so the first one's graphdef serves all."""

  def __init__(self):
    self.compiled = {}

  def __call__(self, model, batches) -> float:
    graphdef, state = nnx.split(model)
    key = jax.tree.structure(state)
    if key not in self.compiled:
      self.compiled[key] = jax.jit(lambda s, x, y, g=graphdef: cross_entropy(nnx.merge(g, s)(x), y))
    f = self.compiled[key]
    return float(np.mean([float(f(state, x, y)) for x, y in batches]))

  def seconds(self, model, batches, repeats: int = 3) -> float:
    """Median wall time of one pass over `batches` after a compiling pass."""
    return median_seconds(lambda: self(model, batches), repeats)


def quantized(fp, plan, x) -> nnx.Module:
  return quant.quantize(nnx.clone(fp), plan, x)


class Judged:
  """`measure(fp quantized by plan)` for each plan, calibrated on `x`; a plan met before is neither quantized nor
  measured again (CALM's choice is often one algorithm in every layer, i.e. a uniform plan; a greedy knapsack layout
  often equals the exact one): quantizing and evaluating are deterministic, so the numbers are the same."""

  def __init__(self, fp, x, measure):
    self.fp, self.x, self.measure, self.memo = fp, x, measure, {}

  def __call__(self, plan: quant.Plan) -> dict:
    key = tuple((p, tuple(specs)) for p, specs in sorted(plan.items()))
    if key not in self.memo:
      self.memo[key] = self.measure(quantized(self.fp, plan, self.x))
    return dict(self.memo[key])


def size(model) -> int:
  with tempfile.TemporaryDirectory() as tmp:
    return quant_store.stored_bytes(quant_store.save(model, os.path.join(tmp, "q")))


def _say(cfg: Config, text: str):
  if not cfg.smoke:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def model_id(model) -> str:
  """16 hex digits of the parameters' bits (research/integrity's checksums, hashed together)."""
  sums = integrity.fingerprints(nnx.state(model, nnx.Param))
  return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def seed_record(unfinished: dict, seed: int, ident: str, start) -> tuple[dict, str | None]:
  """The half-done record of `seed` if it was measured on model `ident`, else a new one, `start()`; and the id of
  the model a dropped record was measured on (None if nothing was dropped)."""
  dropped = None
  if str(seed) in unfinished and unfinished[str(seed)].get("model_id") != ident:
    dropped = str(unfinished.pop(str(seed)).get("model_id"))
  if str(seed) not in unfinished:
    unfinished[str(seed)] = start()
  return unfinished[str(seed)], dropped


def source_of(cfg: Config, model: str, work: str) -> str:
  """The directory holding `model`: a preset pretrained here (a finished run reused), else `model` itself."""
  if model in PRETRAIN_LR:
    return pretrain(cfg, model, work)
  if not os.path.exists(os.path.join(model, "config.json")):
    raise SystemExit(f"error: --models {model}: neither a preset ({', '.join(PRETRAIN_LR)}) nor a model directory "
                     "(no config.json)")
  return model


def corpus_for(source: str, corpus):
  """The byte corpus, or its re-encoding by the model's own tokenizer when the directory has one."""
  tok = os.path.join(source, "tokenizer.json")
  return tokenize_corpus(corpus, tok) if os.path.exists(tok) else corpus


def study_model(cfg: Config, name: str, source: str, val, corpus, done: dict, save) -> dict:
  """A pretrained model's seeds, resumed from `done`. The pretraining is rerun on a machine without its run directory:
  another CPU's arithmetic can give other bits, so each seed records the model it measured (`model_id`) and its own
  float32 losses, and a half-done seed whose model differs from today's starts over instead of mixing two models."""
  try:
    fp, config, _ = load_model(source)
  except LOAD_ERRORS as e:
    raise SystemExit(f"error: {source}: {e}") from None
  ev = Evaluator()
  paths = list(quant.targets(fp))
  fp_val, ident = ev(fp, val), model_id(fp)
  rec = done.setdefault(name, {"fp_val": fp_val, "params": int(sum(x.size for x in jax.tree.leaves(
      nnx.state(fp, nnx.Param)))), "float32_bytes": quant_store.full_bytes(config), "seeds": {}})
  rec.setdefault("corpus_fingerprint", corpus.fingerprint)
  for seed in cfg.seeds:
    if str(seed) in rec["seeds"]:
      continue
    x, y = get_batch(corpus.train, seed, 0, cfg.calib, cfg.seq_len)
    calib = [(x[i:i + cfg.batch_size], y[i:i + cfg.batch_size]) for i in range(0, len(x), cfg.batch_size)]
    # a seed of `base` takes hours: its finished budgets persist (partial.json) before the seed does
    out, dropped = seed_record(rec.setdefault("unfinished", {}), seed, ident, lambda: {
        "model_id": ident, "fp_val": fp_val, "fp_calib": ev(fp, calib), "budgets": {}, "mixed": {}})
    if dropped:
      _say(cfg, f"{name} seed {seed}: its saved budgets were measured on another pretraining of {name} (model "
                f"{dropped}, now {ident}); the seed starts over")
    judged = Judged(fp, x, lambda m: {"val": ev(m, val), "calib": ev(m, calib), "bytes": size(m)})
    for budget in cfg.budgets:
      if budget in out["budgets"]:
        continue
      cands = {a: _spec(budget, a) for a in ALGORITHMS}
      b = {"uniform": {a: judged(quant.uniform_plan(fp, s)) for a, s in cands.items()}}
      for by in ("cka", "mse"):
        plan, table = quant_select.choose(fp, cands, x, by=by)
        b[by] = {**judged(plan), "chosen": [s.algorithm for s in plan[paths[0]]], "scores": table}
      full, one_layer = quant_select.one_layer_losses(fp, cands, x, val)  # the prefix once per layer, not per candidate
      delta = [{a: loss - full for a, loss in row.items()} for row in one_layer]
      chosen = [min(d, key=d.get) for d in delta]
      plan = {p: [cands[a] for a in chosen] for p in paths}
      b["oracle"] = {**judged(plan), "chosen": chosen, "one_layer_delta": delta}
      cka = [b["cka"]["scores"][layer][a] for layer in range(config.n_layers) for a in ALGORITHMS]
      dl = [delta[layer][a] for layer in range(config.n_layers) for a in ALGORITHMS]
      b["diagnostics"] = {
          "cka_vs_oracle": float(np.mean([c == o for c, o in zip(b["cka"]["chosen"], chosen)])),
          "mse_vs_oracle": float(np.mean([c == o for c, o in zip(b["mse"]["chosen"], chosen)])),
          "spearman_cka_delta": float(spearmanr(cka, dl)[0]) if len(set(cka)) > 1 and len(set(dl)) > 1 else None}
      out["budgets"][budget] = b
      save()
      _say(cfg, f"{name} seed {seed} {budget}: " + ", ".join(f"{k} {b[k]['val'] - out['fp_val']:+.4f}"
                                                          for k in ("cka", "mse", "oracle")))
    sens = quant_mixed.sensitivity(fp, x, y)
    quant_mixed.add_hessian(sens, fp, x, y, samples=cfg.hessian_samples, seed=seed)
    for bits in cfg.mixed_bits:
      budget = int(sens.bytes[:, sens.bits.index(bits)].sum())
      layouts = {"first_order exact": quant_mixed.exact(sens.first_order, sens.bytes, budget),
                 "first_order greedy": quant_mixed.greedy(sens.first_order, sens.bytes, budget),
                 "hessian exact": quant_mixed.exact(sens.hessian, sens.bytes, budget),
                 "first+hessian exact": quant_mixed.exact(sens.cost("first_plus_hessian"), sens.bytes, budget),
                 f"uniform {bits}": np.full(len(sens.units), sens.bits.index(bits))}
      out["mixed"][str(bits)] = {
          layout: {**judged(quant_mixed.plan_of(sens, choice)),
                   "predicted_first_order": quant_mixed.predicted(sens, choice, "first_order"),
                   "predicted_hessian": quant_mixed.predicted(sens, choice, "hessian"),
                   "layout_bytes": quant_mixed.layout_bytes(sens, choice), "budget_bytes": budget,
                   "bits": [sens.bits[k] for k in choice]}
          for layout, choice in layouts.items()}
    rec["seeds"][str(seed)] = rec["unfinished"].pop(str(seed))
    save()
    _say(cfg, f"{name} seed {seed}: mixed precision done")
  if not rec.get("unfinished", True):
    del rec["unfinished"]
  if "speed" not in rec:
    x = get_batch(corpus.train, cfg.seeds[0], 0, cfg.calib, cfg.seq_len)[0]
    t_fp = ev.seconds(fp, val)
    rec["speed"] = {"float32_s": t_fp, "tokens": len(val) * cfg.batch_size * cfg.seq_len}
    for label, spec in (("w3g64 rtn", _spec("w3g64", "rtn")), ("w8a8 smoothquant", _spec("w8a8", "smoothquant"))):
      rec["speed"][label] = ev.seconds(quantized(fp, quant.uniform_plan(fp, spec), x), val) / t_fp
    save()
  return rec


@common.smoke_compiles_quickly
def main(cfg: Config) -> dict:
  if cfg.smoke:  # smoke sizes; models named on the command line are kept (`--smoke --models DIR`)
    cfg = dataclasses.replace(cfg, **{**SMOKE, **({"models": cfg.models} if cfg.models != Config.models else {})})
  unknown = set(cfg.budgets) - set(BUDGETS)
  if unknown or not cfg.seeds:
    raise SystemExit(f"error: budgets come from {', '.join(BUDGETS)} and --seeds needs a value")
  t0, cpu0 = time.perf_counter(), time.process_time()
  done = common.load_partial(cfg) or {}
  resumed = bool(done)
  with tempfile.TemporaryDirectory(prefix="optlab-quant-") as tmp:
    work = tmp if cfg.smoke else cfg.work
    corpus = load_corpus()
    save = (lambda: None) if cfg.smoke else (lambda: common.save_partial(cfg, **done))
    models = {}
    for m in cfg.models:
      source = source_of(cfg, m, work)
      data = corpus_for(source, corpus)
      val = eval_batches(data.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
      models[m] = study_model(cfg, m, source, val, data, done, save)
  result = {"settings": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "work")},
                         "budgets_specs": {b: dataclasses.asdict(BUDGETS[b]) for b in cfg.budgets},
                         "corpus_fingerprint": corpus.fingerprint},
            "models": models, "summary": summarize(models)}
  result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
  result["resumed"] = resumed
  if not cfg.smoke:
    write(cfg, result)
    common.drop_partial(cfg)
  return result


def summarize(models: dict) -> dict:
  """Per model: each method's held-out ΔL over the seeds per budget; the mixed layouts' ΔL; the claims' numbers."""
  out = {}
  for name, rec in models.items():
    seeds = list(rec["seeds"].values())
    fp = [sd.get("fp_val", rec["fp_val"]) for sd in seeds]  # each seed's ΔL against the model it quantized
    s = {"budgets": {}, "mixed": {}, "models": len({sd.get("model_id") for sd in seeds})}
    for budget in seeds[0]["budgets"]:
      rows = {f"uniform {a}": [sd["budgets"][budget]["uniform"][a] for sd in seeds] for a in ALGORITHMS}
      rows.update({k: [sd["budgets"][budget][k] for sd in seeds] for k in ("cka", "mse", "oracle")})
      s["budgets"][budget] = {
          k: {"delta_val": [r["val"] - f for r, f in zip(v, fp)], "bytes": v[0]["bytes"]} for k, v in rows.items()}
      diag = [sd["budgets"][budget]["diagnostics"] for sd in seeds]
      s["budgets"][budget]["diagnostics"] = {k: [d[k] for d in diag] for k in diag[0]}
    pred, meas, distinct = [], [], {}
    for bits in seeds[0]["mixed"]:
      s["mixed"][bits] = {}
      for layout in seeds[0]["mixed"][bits]:
        rs = [sd["mixed"][bits][layout] for sd in seeds]
        s["mixed"][bits][layout] = {"delta_val": [r["val"] - f for r, f in zip(rs, fp)],
                                    "delta_calib": [r["calib"] - sd["fp_calib"] for r, sd in zip(rs, seeds)],
                                    "predicted": [r["predicted_first_order"] for r in rs],
                                    "bytes": rs[0]["bytes"]}
        pred += [r["predicted_first_order"] for r in rs]
        meas += [r["val"] - f for r, f in zip(rs, fp)]
        # RTN needs no calibration data: equal widths of one pretrained model are one quantized model, whichever
        # seed or layout chose them
        distinct.update({(sd.get("model_id"), tuple(r["bits"])): r["val"] - f for r, sd, f in zip(rs, seeds, fp)})
    below = [d for d in distinct.values() if d < 0]
    s["claim"] = {"layouts": len(meas), "held_out_below_fp": int(sum(m < 0 for m in meas)),
                  "distinct_models": len(distinct), "distinct_below_fp": len(below),
                  "most_below_fp": float(min(below)) if below else None,
                  "pearson_pred_meas": float(pearsonr(pred, meas)[0]) if len(meas) > 2 else None,
                  "spearman_pred_meas": float(spearmanr(pred, meas)[0]) if len(meas) > 2 else None}
    out[name] = s
  return out


# ---- output ------------------------------------------------------------------------------------------------------

def _pm(xs, digits=4) -> str:
  xs = [x for x in xs if x is not None]
  return common.pm(common.mean_std(xs), sign=True, digits=digits) if xs else "—"


def _distinct(claim: dict) -> str:
  """How many different quantized models the layouts below float32 are, and by how much the best one is below."""
  most = "" if claim["most_below_fp"] is None else f", the lowest {claim['most_below_fp']:+.1e}"
  return f"{claim['distinct_below_fp']} of {claim['distinct_models']} distinct models{most}"


def tables(result: dict) -> list[str]:
  st = result["settings"]
  lines = [f"Calibration: {st['calib']} windows × {st['seq_len']} bytes per seed, seeds {list(st['seeds'])}; "
           f"held-out: {st['eval_batches'] * st['batch_size']} windows of the val split. ΔL = loss − the float32 "
           "model's loss (nats/byte), mean ± std over the calibration seeds.", ""]
  for name, rec in result["models"].items():
    s = result["summary"][name]
    lines += [f"### `{name}` ({rec['params']:,} parameters, float32 held-out loss {rec['fp_val']:.4f}, "
              f"{rec['float32_bytes'] / 2**20:.2f} MiB)", ""]
    if s["models"] > 1:  # pretrained again on another machine between seeds (see study_model)
      losses = sorted({f"{sd['fp_val']:.4f}" for sd in rec["seeds"].values() if "fp_val" in sd})
      lines += [f"The seeds quantized {s['models']} bitwise-different pretrainings of `{name}` (the same run on "
                f"different machines; float32 held-out losses {', '.join(losses)}); each seed's ΔL is against its own.",
                ""]
    for budget, rows in s["budgets"].items():
      lines += [f"{budget}:", "", "| method | held-out ΔL | size on disk |", "|---|---:|---:|"]
      for k, v in rows.items():
        if k != "diagnostics":
          lines.append(f"| {k} | {_pm(v['delta_val'])} | {v['bytes'] / 2**20:.2f} MiB |")
      d = rows["diagnostics"]
      share = lambda xs: f"{100 * np.mean(xs):.0f}% (per seed: {', '.join(f'{100 * x:.0f}%' for x in xs)})"
      lines += ["", f"CALM agrees with the oracle on {share(d['cka_vs_oracle'])} of the layers, the MSE choice on "
                f"{share(d['mse_vs_oracle'])}; Spearman ρ(CKA, one-layer held-out ΔL) "
                f"{_pm(d['spearman_cka_delta'], 2)} (a good proxy gives ρ near −1: higher CKA, smaller loss change).",
                ""]
    lines += ["Mixed precision (RTN per channel, widths from {2, 3, 4, 8, 16}):", "",
              "| budget | layout | held-out ΔL | calibration ΔL | predicted ΔL (first order) | size |",
              "|---|---|---:|---:|---:|---:|"]
    for bits, layouts in s["mixed"].items():
      for layout, v in layouts.items():
        lines.append(f"| uniform-{bits} bytes | {layout} | {_pm(v['delta_val'])} | {_pm(v['delta_calib'])} | "
                     f"{_pm(v['predicted'])} | {v['bytes'] / 2**20:.2f} MiB |")
    c = s["claim"]
    r = lambda v: "—" if v is None else f"{v:.2f}"
    lines += ["", f"Layouts with held-out ΔL < 0: {c['held_out_below_fp']} of {c['layouts']} ({_distinct(c)}); "
              "predicted (first order, "
              f"calibration) vs measured held-out ΔL over the layouts and seeds: Pearson {r(c['pearson_pred_meas'])}, "
              f"Spearman {r(c['spearman_pred_meas'])}.", ""]
    sp = rec.get("speed")
    if sp:
      lines += [f"Evaluation time on this CPU, relative to float32 ({sp['float32_s']:.2f} s for {sp['tokens']:,} "
                f"tokens): " + ", ".join(f"{k} {v:.2f}×" for k, v in sp.items() if k not in ("float32_s", "tokens")),
                ""]
  return lines


def findings(result: dict) -> list[str]:
  out = []
  for name, s in result["summary"].items():
    for budget, rows in s["budgets"].items():
      mean = {k: float(np.mean(v["delta_val"])) for k, v in rows.items() if k != "diagnostics"}
      best_uniform = min((k for k in mean if k.startswith("uniform")), key=mean.get)
      out.append(f"Reading ({name}, {budget}): best uniform algorithm {best_uniform.removeprefix('uniform ')} "
                 f"{mean[best_uniform]:+.4f}; CALM "
                 f"{mean['cka']:+.4f} ({'better' if mean['cka'] < mean[best_uniform] else 'not better'}); MSE choice "
                 f"{mean['mse']:+.4f}; oracle {mean['oracle']:+.4f}.")
    c = s["claim"]
    out.append(f"Reading ({name}, lower loss than float32): {c['held_out_below_fp']} of {c['layouts']} mixed layouts "
               f"are below float32 on held-out data ({_distinct(c)}).")
  return out


def plot(result: dict):
  """Held-out ΔL against size on disk, per model: every uniform method, CALM, MSE, oracle and mixed layout (colour:
  the method; marker: the budget, or ^ / v for an exact / greedy mixed-precision layout; one legend outside)."""
  from matplotlib.figure import Figure
  names = list(result["summary"])
  fig = Figure(figsize=(5 * len(names) + 2, 4.2), layout="constrained")
  axes = np.atleast_1d(fig.subplots(1, len(names)))
  colours, markers, seen = {}, {}, {}

  def point(ax, x, y, method, marker, label):
    colour = colours.setdefault(method, f"C{len(colours)}" if len(colours) < 10 else "k")  # 10 distinct, then black
    h = ax.scatter(x, y, color=colour, marker=marker, s=28, alpha=0.85, edgecolors="none")
    seen.setdefault(label, h)

  for ax, name in zip(axes, names):
    s = result["summary"][name]
    for budget, rows in s["budgets"].items():
      marker = markers.setdefault(budget, "os"[len(markers) % 2])
      for k, v in rows.items():
        if k != "diagnostics":
          method = k.removeprefix("uniform ")
          point(ax, v["bytes"] / 2**20, np.mean(v["delta_val"]), method, marker, f"{budget}: {k}")
    for layouts in s["mixed"].values():
      for k, v in layouts.items():  # "first_order exact", "hessian greedy", "uniform 4", ...
        criterion, search = k.split(" ")
        method = "rtn" if criterion == "uniform" else f"mixed {criterion}"
        point(ax, v["bytes"] / 2**20, np.mean(v["delta_val"]), method, "v" if search == "greedy" else "^",
              "mixed: uniform RTN" if criterion == "uniform" else f"mixed: {k}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xlabel="size on disk (MiB)", ylabel="held-out ΔL (nats/byte), mean over seeds", title=name)
  fig.legend(list(seen.values()), list(seen), loc="outside right center", fontsize=6, frameon=False)
  return fig


def write(cfg: Config, result: dict, cmd: str | None = None):
  resumed = (" (it resumed what earlier invocations had finished from partial.json: the study took longer)"
             if result.get("resumed") else "")
  table = tables(result) + ["", f"Time of this invocation{resumed}: {result['wall_s']:.0f} s wall on a 2-core "
                            f"machine; {result['cpu_s']:.0f} s of CPU in this process. Plot: `quantization.png`."]
  common.write_results(cfg.out, NAME, QUESTION, table, findings=findings(result), settings=result["settings"],
                       data=result, cmd=cmd)
  plot(result).savefig(os.path.join(cfg.out, "quantization.png"), dpi=120)


if __name__ == "__main__":
  common.cli(main, Config)
