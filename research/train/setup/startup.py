"""Everything checked and built before the state, from the run's plan (plan.py) and the sections each part reads:
the flags that need the plan (`check`), the data and held-out batches (`data`), the pipeline plan and --switch-at's
meshes (`meshes`) and --sync's mode, each refused in one line when it does not fit; and the run's record of them
(`run_meta`, config.json)."""

from __future__ import annotations

import dataclasses
import math
import sys

import jax

from models.attention import AttentionError, check_attention
from research.data import Corpus
from research.data.mixture import MixedCorpus
from research.train.config import RunError
from research.train.config.observe import ObserveSection
from research.train.config.prefixed import DataFlags
from research.train.config.sections import DataSection, MeshSection, SyncSection, TrainingSection
from research.train.feed import held_out, make_loader
from research.train.hooks import source_weights
from research.train.observers import active
from research.train.setup import clashes
from research.train.setup.plan import Plan
from research.train.setup.switch import switch_plan
from research.train.steps import layerfreeze, sync
from sharding import batch_sharding, global_batch, mesh_spec
from sharding.mesh import CONTEXT, DATA, DATA_AXES, STAGE
from sharding.pipeline import PipelineError, bubble_fraction, check_pipeline


def check(plan: Plan, observe: ObserveSection, batch_size: int, preset: str) -> None:
  """Every check of the flags that needs the run's plan, each refused in one line (RunError).

  Args:
    plan: the run's plan.
    observe: the config's observe section (the observers' flags).
    batch_size: --batch-size.
    preset: --model (as the message names it).
  """
  check_sync(plan.sync, plan.mesh)
  clashes.check(plan.features, plan.optimizer, plan.needs)  # what does not combine, one table
  active(observe, batch_size)  # the observers' flags, refused in one line before any work
  layerfreeze.check(plan.trains.layers, plan.model.n_layers)
  for field, why in plan.needs.model_refuses:  # as the optimizer's registry entry declares
    if getattr(plan.model, field):
      raise RunError(f"--optimizer {plan.optimizer} {why}: --model {preset} has {field}; add "
                     f"--{field.replace('_', '-')} False")


def data(plan: Plan, training: TrainingSection, section: DataSection, options: DataFlags, eval_batches: int):
  """The run's data: (corpus, its training batches' loader, a batch's sharding, the held-out batches on the host and
  placed on the mesh).

  Args:
    plan: the run's plan (its mesh and model).
    training: the config's training section (the batch's shape).
    section: its data section (one corpus, or the named --data sources' mixture).
    options: its --data.* section.
    eval_batches: --eval-batches.

  Returns:
    (corpus, loader, batch sharding, held-out batches as host arrays, the same placed on the mesh); RunError for
    data the model cannot read or too short to lay out.
  """
  corpus = source_weights.load_data(section, options)
  source_weights.check(corpus, plan.model, plan.mesh)
  if plan.model.vocab_size < corpus.vocab_size:
    raise RunError(f"the data has {corpus.vocab_size} token ids but the model's vocab_size is {plan.model.vocab_size}")
  batch_sh = batch_sharding(plan.mesh, (training.batch_size, training.seq_len))
  loader = make_loader(corpus, training, section, options)  # fails early: data shorter than a sequence, or no docs
  val_host = held_out(corpus, training, options, eval_batches)
  return corpus, loader, batch_sh, val_host, [global_batch(b, plan.mesh) for b in val_host]


def meshes(plan: Plan, section: MeshSection, training: TrainingSection):
  """--switch-at's (step, mesh) plan and the pipeline plan, every mesh checked against the model and the batch.

  Args:
    plan: the run's plan (its mesh and model).
    section: the config's mesh section (--switch-at).
    training: its training section (the batch size and sequence length each mesh must fit).

  Returns:
    (--switch-at's [(step, mesh)], the GPipe pipeline plan or None).
  """
  switches = switch_plan(section, training)
  pipe = pipeline_plan(plan.mesh, plan.model, training.batch_size)
  for m in [plan.mesh] + [m for _, m in switches]:  # a switch to a pipeline or context mesh must fit model and batch
    if m is not plan.mesh:
      pipeline_plan(m, plan.model, training.batch_size)
    try:
      check_attention(plan.model.attention, training.seq_len, m.shape[CONTEXT])
    except AttentionError as e:
      raise RunError(f"--mesh {mesh_spec(m)}: {e}") from None
  return switches, pipe


def pipeline_plan(mesh, mcfg, batch_size: int) -> dict | None:
  """The GPipe pipeline a mesh with stage > 1 runs (printed, and saved in config.json); None without one."""
  S = mesh.shape[STAGE]
  if S == 1:
    return None
  M = mcfg.microbatches or S
  try:
    check_pipeline(mcfg.n_layers, batch_size, S, M, math.prod(mesh.shape[a] for a in DATA_AXES))
  except PipelineError as e:
    raise RunError(f"--mesh {mesh_spec(mesh)}: {e}") from None
  plan = {"schedule": "gpipe", "stages": S, "layers_per_stage": mcfg.n_layers // S, "microbatches": M,
          "bubble_fraction": bubble_fraction(S, M)}
  print(f"pipeline: {S} stages x {mcfg.n_layers // S} layers, {M} microbatches of {batch_size // M} sequences, "
        f"GPipe bubble (S-1)/(M+S-1) = {plan['bubble_fraction']:.1%}", file=sys.stderr)
  return plan


def check_sync(section: SyncSection, mesh):
  """--sync (the config's sync section) parsed and checked (RunError); what it does not combine with is
  research/train/setup/clashes.py's."""
  try:
    mode = sync.parse(section.mode)
    if mode.kind == "gossip":
      sync.mixing_matrix(mode, mesh.shape[DATA])
    sync.outer_optimizer(section.outer_lr, section.outer_momentum)
  except sync.SyncError as e:
    raise RunError(str(e)) from None
  if mode.kind != "allreduce" and mesh.shape[DATA] == 1:
    print(f"warning: --sync {section.mode} on a mesh with data=1 has a single replica (add data=R to --mesh for R)",
          file=sys.stderr)


def run_meta(train: dict, mcfg, mesh, corpus: Corpus, pipe: dict | None, report: dict, files: dict) -> dict:
  """What config.json records.

  Args:
    train: the resolved flags by section (their paths absolute: `dataclasses.asdict` of the config).
    mcfg: the model config.
    mesh: the mesh.
    corpus: the corpus (or mixture) trained on.
    pipe: the pipeline plan, or None.
    report: what the state's construction reports (--peft's sizes, ...).
    files: the sha256 of the tokenizer and of an `hf:` source's config.json (`paths.fingerprints`), which
      research.sample, export and quantize check.

  Returns:
    The record: flags, model config, mesh, corpus, files, versions and devices.
  """
  meta = {"train": train, "model_config": dataclasses.asdict(mcfg), "mesh": mesh_spec(mesh),
          "corpus": corpus.record() if isinstance(corpus, MixedCorpus) else {
              "source": corpus.source, "fingerprint": corpus.fingerprint, "train_tokens": int(len(corpus.train)),
              "val_tokens": int(len(corpus.val))},
          "files": files, "jax": jax.__version__, "devices": [str(d) for d in mesh.devices.flat]}
  if pipe:
    meta["pipeline"] = pipe
  meta.update(report)
  return meta
