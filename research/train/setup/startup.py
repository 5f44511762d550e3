"""Everything checked and built before the state: the mesh, the model config, the data and held-out batches, the
pipeline plan, --switch-at's meshes and --sync's mode, each refused in one line when it does not fit; and the run's
record of them (`run_meta`, config.json)."""

from __future__ import annotations

import dataclasses
import math
import sys

import jax

from models.attention import AttentionError, check_attention
from optim import Needs
from research.data import Corpus
from research.data.mixture import MixedCorpus
from research.train.config import RunError, TrainConfig, paths
from research.train.config.sections import SyncSection
from research.train.feed import held_out, make_loader
from research.train.hooks import source_weights
from research.train.observers import active
from research.train.setup import clashes
from research.train.setup.build import model_config, needs_of
from research.train.setup.switch import switch_plan
from research.train.steps import layerfreeze, sync
from sharding import batch_sharding, global_batch, make_mesh, mesh_spec
from sharding.mesh import CONTEXT, DATA, DATA_AXES, STAGE
from sharding.pipeline import PipelineError, bubble_fraction, check_pipeline


def setup(cfg: TrainConfig, needs: Needs | None = None):
  """Mesh, model config, data and held-out batches, with every check of the flags that needs them; `needs`: the
  run's optimizer needs (`build.needs_of`)."""
  needs = needs_of(cfg.optim, needs)
  mesh = make_mesh(cfg.mesh.spec)
  mcfg = model_config(cfg, needs)
  check_sync(cfg.sync, mesh)
  clashes.check(cfg, mesh, mcfg, needs)  # what does not combine, one table
  active(cfg.observe, cfg.training.batch_size)  # the observers' flags, refused in one line before any work
  layerfreeze.check(cfg.finetune, mcfg.n_layers)
  for field, why in needs.model_refuses:  # as the optimizer's registry entry declares
    if getattr(mcfg, field):
      raise RunError(f"--optimizer {cfg.optim.optimizer} {why}: --model {cfg.model.preset} has {field}; add "
                     f"--{field.replace('_', '-')} False")
  corpus = source_weights.load_data(cfg.data, cfg.data_options)  # one corpus, or the named --data sources' mixture
  source_weights.check(corpus, mcfg, mesh)
  if mcfg.vocab_size < corpus.vocab_size:
    raise RunError(f"the data has {corpus.vocab_size} token ids but the model's vocab_size is {mcfg.vocab_size}")
  batch_sh = batch_sharding(mesh, (cfg.training.batch_size, cfg.training.seq_len))
  plan = switch_plan(cfg.mesh, cfg.training)
  pipe = pipeline_plan(mesh, mcfg, cfg.training.batch_size)
  for m in [mesh] + [m for _, m in plan]:  # a switch to a pipeline or context mesh must fit the model and batch too
    if m is not mesh:
      pipeline_plan(m, mcfg, cfg.training.batch_size)
    try:
      check_attention(mcfg.attention, cfg.training.seq_len, m.shape[CONTEXT])
    except AttentionError as e:
      raise RunError(f"--mesh {mesh_spec(m)}: {e}") from None
  # fail early if the data is shorter than a sequence or has no documents to lay out
  make_loader(corpus, cfg.training, cfg.data, cfg.data_options)
  val_host = held_out(corpus, cfg.training, cfg.data_options, cfg.logging.eval_batches)
  val = [global_batch(b, mesh) for b in val_host]
  return mesh, mcfg, corpus, batch_sh, plan, pipe, val_host, val


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


def run_meta(cfg: TrainConfig, mcfg, mesh, corpus: Corpus, pipe: dict | None, report: dict) -> dict:
  """What config.json records: the resolved flags (their paths absolute) and model config, the mesh, the corpus, the
  sha256 of the tokenizer and of an `hf:` source's config.json ("files", which research.sample, export and quantize
  check), versions and devices."""
  meta = {"train": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(mcfg), "mesh": mesh_spec(mesh),
          "corpus": corpus.record() if isinstance(corpus, MixedCorpus) else {
              "source": corpus.source, "fingerprint": corpus.fingerprint, "train_tokens": int(len(corpus.train)),
              "val_tokens": int(len(corpus.val))},
          "files": paths.fingerprints(cfg.data.tokenizer, cfg.finetune.init_from),
          "jax": jax.__version__, "devices": [str(d) for d in mesh.devices.flat]}
  if pipe:
    meta["pipeline"] = pipe
  meta.update(report)
  return meta
