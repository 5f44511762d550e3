"""What the flags build: the model config (a preset or --init-from's, with single fields overridden) and the optimizer
(the registry's, with the schedule, clipping and --freeze)."""

from __future__ import annotations

import dataclasses
import json

import optax

from models import PRESETS, MoEConfig, preset
from optim import Needs, UnknownOptimizerError, get_optimizer, make_schedule, needs, with_global_norm_clip
from research.train.config import RunError, TrainConfig
from research.train.config.sections import OptimSection
from research.train.setup import init_from
from research.train.steps import frozen, update_args


def model_config(cfg: TrainConfig, needs: Needs | None = None):
  """The preset (or --init-from's config) with every given flag overriding its one field (--moe.* fields of the
  MoE included). `needs`: the run's optimizer needs when computed already (`needs_of`)."""
  over = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "preset" and v is not None}
  over.update(update_args.model_settings(needs_of(cfg.optim, needs).update_args))  # what its update arguments read
  moe = cfg.moe.model_fields()
  if cfg.finetune.init_from:
    return init_from.model_config(cfg.finetune.init_from, {**over, "moe": moe})
  if moe:
    base = PRESETS[cfg.model.preset].moe if cfg.model.preset in PRESETS else None
    if base is None and "num_experts" not in moe:
      raise RunError(f"--model {cfg.model.preset} is dense: give --moe.num-experts to make it a mixture of experts")
    over["moe"] = dataclasses.replace(base or MoEConfig(), **moe)
  return preset(cfg.model.preset, **over)


def opt_hparams(optim: OptimSection) -> dict:
  """The optimizer's hyperparameters the flags give: --weight-decay, --b1, --b2 when set, and every --opt KEY=VALUE
  (VALUE read as JSON, else as a string)."""
  hp = {k: getattr(optim, k) for k in ("weight_decay", "b1", "b2") if getattr(optim, k) is not None}
  for item in optim.opt:
    key, sep, value = item.partition("=")
    if not sep:
      raise RunError(f"--opt {item!r} is not KEY=VALUE")
    try:
      hp[key] = json.loads(value)
    except json.JSONDecodeError:
      hp[key] = value
  return hp


def optimizer_needs(optim: OptimSection) -> Needs:
  """What --optimizer with these hyperparameters asks of the trainer, as its registry entry declares it
  (`optim.needs.Needs`: extra update arguments, a blockwise step, model settings it refuses); RunError for an update
  argument no registration supplies (research/train/steps/update_args.py)."""
  declared = needs(optim.optimizer, opt_hparams(optim))
  try:
    update_args.declared(declared.update_args)
  except update_args.UpdateArgError as e:
    raise RunError(f"--optimizer {optim.optimizer}: {e}") from None
  return declared


def needs_of(optim: OptimSection, needs: Needs | None = None) -> Needs:
  """`needs` when the run has computed them (once, where its programs are built: research/train/setup/run.py), else
  the optimizer section's (`optimizer_needs`: a caller outside a run, a bench or a test)."""
  return needs if needs is not None else optimizer_needs(optim)


def make_optimizer(cfg: TrainConfig, values: dict | None = None, needs: Needs | None = None):
  """(the optimizer with --grad-clip and --freeze applied, its learning-rate schedule).

  `values` replaces the peak lr ("lr") and optimizer hyperparameters by name with values that may be traced (one
  member of a vmapped group: research/train/vmapped.py); `needs`: the run's optimizer needs (`needs_of`)."""
  values = dict(values or {})
  hp = {**opt_hparams(cfg.optim), **values}
  lr = hp.pop("lr", cfg.optim.lr)
  warmup = min(100, cfg.training.steps // 10) if cfg.optim.warmup_steps is None else cfg.optim.warmup_steps
  shaped = lambda peak: make_schedule(cfg.optim.schedule, peak, cfg.training.steps, warmup=warmup,
                                      min_ratio=cfg.optim.min_lr_ratio)
  schedule = shaped(lr)
  for key, value in hp.items():  # a second lr (Muon's AdamW group: --opt adam_learning_rate=X) on the same schedule
    if key.endswith("learning_rate") and not isinstance(value, (bool, str)) and value is not None:
      hp[key] = shaped(value)
  try:
    tx = get_optimizer(cfg.optim.optimizer, schedule, **hp)
  except ValueError as e:  # the registry's refusals, or a factory's own (MGUP's AlignmentError, BAdamError)
    raise e if isinstance(e, UnknownOptimizerError) else RunError(f"--optimizer {cfg.optim.optimizer}: {e}") from None
  clipped = update_args.clipped(needs_of(cfg.optim, needs).update_args)
  if cfg.optim.grad_clip > 0 and clipped:  # the clip also applies to these update arguments, each by its own norm
    tx = with_global_norm_clip(tx, cfg.optim.grad_clip, args=clipped)
  elif cfg.optim.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.optim.grad_clip), tx)
  return frozen.freeze(tx, cfg.finetune.freeze)[0], schedule


def step_options(cfg: TrainConfig, needs: Needs | None = None) -> dict:
  """`make_steps`' keyword arguments the flags decide: the optimizer's declared update arguments, --freeze's mask;
  `needs`: the run's optimizer needs (`needs_of`)."""
  return {"update_args": needs_of(cfg.optim, needs).update_args, "frozen": frozen.frozen_mask(cfg.finetune.freeze)}


def resolved(cfg):
  """`cfg` with the dtypes it leaves to the run filled in, as config.json records them: --peft.base-dtype unset is
  the frozen dtype (`frozen_dtype`: bfloat16 when fine-tuning, else float32), so a PEFT run's frozen base is stored
  like --freeze's and BAdam's (a recorded run resumes and loads in the dtype it was written in)."""
  if not cfg.finetune.peft or cfg.peft_options.base_dtype is not None:
    return cfg
  return dataclasses.replace(cfg, peft_options=dataclasses.replace(cfg.peft_options,
                                                                   base_dtype=str(frozen.frozen_dtype(cfg.finetune))))
