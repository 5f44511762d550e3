"""What the flags build: the model config (a preset or --init-from's, with single fields overridden) and the optimizer
(the registry's, with the schedule, clipping and --freeze)."""

from __future__ import annotations

import dataclasses
import json

import optax

from models import PRESETS, MoEConfig, preset
from optim import Needs, UnknownOptimizerError, get_optimizer, make_schedule, needs, with_global_norm_clip
from research.train.config import RunError
from research.train.config.prefixed import MoEFlags, PeftFlags
from research.train.config.sections import ModelSection, OptimSection, TrainsSection
from research.train.setup import init_from as init_from_source
from research.train.setup.plan import Plan
from research.train.steps import frozen, update_args


def model_config(model: ModelSection, moe: MoEFlags, init_from: str | None, needs: Needs):
  """The model config the flags give.

  Args:
    model: the config's model section (the preset and single fields).
    moe: its --moe.* section.
    init_from: --init-from (the weights section's), or None.
    needs: the optimizer's declared needs (the model settings its update arguments read).

  Returns:
    The preset (or --init-from's config) with every given flag overriding its one field (--moe.* fields of the MoE
    included).
  """
  over = {k: v for k, v in dataclasses.asdict(model).items() if k != "preset" and v is not None}
  over.update(update_args.model_settings(needs.update_args))  # what its update arguments read
  fields = moe.model_fields()
  if init_from:
    return init_from_source.model_config(init_from, {**over, "moe": fields})
  if fields:
    base = PRESETS[model.preset].moe if model.preset in PRESETS else None
    if base is None and "num_experts" not in fields:
      raise RunError(f"--model {model.preset} is dense: give --moe.num-experts to make it a mixture of experts")
    over["moe"] = dataclasses.replace(base or MoEConfig(), **fields)
  return preset(model.preset, **over)


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


def make_optimizer(optim: OptimSection, steps: int, needs: Needs, freeze: str | None = None,
                   values: dict | None = None):
  """The run's optimizer and its learning-rate schedule.

  Args:
    optim: the config's optim section.
    steps: --steps (the schedule's length).
    needs: the optimizer's declared needs (the update arguments --grad-clip clips).
    freeze: --freeze's regex (those leaves get no update), or None.
    values: the peak lr ("lr") and optimizer hyperparameters by name, replacing the flags' with values that may be
      traced (one member of a vmapped group: research/train/vmapped.py), or None.

  Returns:
    (the optimizer with --grad-clip and --freeze applied, its learning-rate schedule).
  """
  values = dict(values or {})
  hp = {**opt_hparams(optim), **values}
  lr = hp.pop("lr", optim.lr)
  warmup = min(100, steps // 10) if optim.warmup_steps is None else optim.warmup_steps
  shaped = lambda peak: make_schedule(optim.schedule, peak, steps, warmup=warmup, min_ratio=optim.min_lr_ratio)
  schedule = shaped(lr)
  for key, value in hp.items():  # a second lr (Muon's AdamW group: --opt adam_learning_rate=X) on the same schedule
    if key.endswith("learning_rate") and not isinstance(value, (bool, str)) and value is not None:
      hp[key] = shaped(value)
  try:
    tx = get_optimizer(optim.optimizer, schedule, **hp)
  except ValueError as e:  # the registry's refusals, or a factory's own (MGUP's AlignmentError, BAdamError)
    raise e if isinstance(e, UnknownOptimizerError) else RunError(f"--optimizer {optim.optimizer}: {e}") from None
  clipped = update_args.clipped(needs.update_args)
  if optim.grad_clip > 0 and clipped:  # the clip also applies to these update arguments, each by its own norm
    tx = with_global_norm_clip(tx, optim.grad_clip, args=clipped)
  elif optim.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(optim.grad_clip), tx)
  return frozen.freeze(tx, freeze)[0], schedule


def step_options(plan: Plan) -> dict:
  """`make_steps`' keyword arguments the run's plan decides: the optimizer's declared update arguments, --freeze's
  mask."""
  return {"update_args": plan.needs.update_args, "frozen": frozen.frozen_mask(plan.trains.freeze)}


def resolved_peft(peft_options: PeftFlags, trains: TrainsSection, init_from: str | None) -> PeftFlags:
  """--peft.* with the dtype it leaves to the run filled in, as config.json records it.

  Args:
    peft_options: the config's --peft.* section.
    trains: its trains section (--peft, --frozen-dtype).
    init_from: --init-from, or None.

  Returns:
    `peft_options` with --peft.base-dtype, when unset, the frozen dtype (`frozen_dtype`: bfloat16 when fine-tuning,
    else float32), so a PEFT run's frozen base is stored like --freeze's and BAdam's (a recorded run resumes and loads
    in the dtype it was written in); as given without --peft or with the dtype set.
  """
  if not trains.peft or peft_options.base_dtype is not None:
    return peft_options
  return dataclasses.replace(peft_options, base_dtype=str(frozen.frozen_dtype(trains, init_from)))
