"""The main job: train a transformer on a named mesh.

  python -m research.train                                  # `small` on the stdlib corpus, 8 CPU devices
  python -m research.train --mesh fsdp=4,tensor=2 --optimizer lion --lr 3e-4 --out runs/lion

Writes to --out: `config.json` (resolved config, corpus fingerprint, versions), `metrics.jsonl`
(one object per logged step) and `ckpt/` (orbax). Rerunning with the same --out resumes from the
latest checkpoint; the batch at step s is a pure function of (seed, s), so a resumed run continues
exactly where the interrupted one would have been. SIGINT/SIGTERM save a checkpoint and exit.
"""

from __future__ import annotations

import signal

_EARLY_SIGNALS: list[int] = []  # SIGINT/SIGTERM that came while the CLI was still importing (seconds)
if __name__ == "__main__":  # the CLI only: importing this module changes no handler
  for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, lambda signum, _frame: _EARLY_SIGNALS.append(signum))

# the imports below take seconds: they come after the handlers on purpose
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Annotated, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import nnx

from models import PRESETS, HFError, MoEConfig, Transformer, cross_entropy, flops_per_token, peft, preset
from models.moe import aux_loss, summarize as moe_summary, update_router_bias
from models.config import ConfigError
from models.attention import AttentionError, check_attention
from optim import (OPTIMIZERS, UnknownOptimizerError, get_optimizer, make_schedule, needs_max_logits, needs_prev_grads,
                   with_global_norm_clip)
from research import adapters, init_from, preflight, rundir, sync
from research.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError, quiet_orbax_errors
from research.distributed import DistributedError, all_agree, initialize as init_distributed, is_primary
from research.health import BadStepsError, Monitor, keep_if_finite, step_ok
from research.pretrained import peft_settings
from research.progress import Progress, summary
from research.throughput import Meter, Peak
from research.watchdog import EXIT_STATUS as WATCHDOG_EXIT, Watchdog
from research.data import DataError, eval_batches, get_batch, load_corpus
from sharding import MeshError, ShardingError, batch_sharding, global_batch, init_train_state, make_mesh, mesh_spec
from sharding import abstract_state, devices_for, logical_names, parse_mesh_spec, reshard, state_shardings
from sharding.mesh import DATA_AXES
from sharding.pipeline import PipelineError, bubble_fraction, check_pipeline


@dataclasses.dataclass
class MoEFlags:
  """Mixture of experts in every block: each flag overrides one field of the preset's MoE (see models.MoEConfig).
  On a dense preset, --moe.num-experts turns it into an MoE; --moe.num-experts 0 makes an MoE preset dense."""
  num_experts: int | None = None
  """Routed experts per block (0: a dense FFN)."""
  top_k: int | None = None
  """Experts each token is sent to."""
  d_expert: int | None = None
  """Each expert's SwiGLU hidden width (unset: --d-ff)."""
  num_shared: int | None = None
  """Always-on shared experts (DeepSeekMoE), fused into one SwiGLU."""
  d_shared: int | None = None
  """The fused shared SwiGLU's width (unset: num_shared x d_expert)."""
  shared_gate: bool | None = None
  """Scale the shared output by a per-token sigmoid gate (Qwen2-MoE)."""
  router: Literal["softmax", "sigmoid"] | None = None
  """Router scores: softmax, or sigmoid (always renormalised over the top-k)."""
  normalize_top_k: bool | None = None
  """Softmax router: renormalise the k selected probabilities to sum 1 (Mixtral)."""
  capacity_factor: float | None = None
  """Slots per expert = ceil(cf x tokens x k / E), the rest dropped (unset: dropless)."""
  lb_weight: float | None = None
  """Load-balancing loss weight."""
  z_weight: float | None = None
  """Router z-loss weight."""
  bias_rate: float | None = None
  """Aux-loss-free balancing step (DeepSeek-V3: 1e-3; 0: none)."""
  ragged_a2a: bool | None = None
  """Expert parallelism with ragged_all_to_all (GPU/TPU only)."""


@dataclasses.dataclass
class TrainConfig:
  """Train a decoder-only transformer on a named device mesh."""

  model: Annotated[str, tyro.conf.arg(help=f"Size preset: {', '.join(PRESETS)}. The flags below override single "
                                           "fields of it.")] = "small"
  d_model: int | None = None
  """Model width (residual stream)."""
  n_layers: int | None = None
  """Transformer blocks."""
  n_heads: int | None = None
  """Query heads."""
  n_kv_heads: int | None = None
  """Key/value heads; fewer than query heads = grouped-query attention."""
  d_ff: int | None = None
  """SwiGLU hidden width."""
  qk_norm: bool | None = None
  """RMSNorm on queries and keys (Qwen3)."""
  qkv_bias: bool | None = None
  """Biases on the q, k, v projections (Qwen2)."""
  tie_embeddings: bool | None = None
  """Share the input embedding and the output head."""
  compute_dtype: Literal["float32", "bfloat16"] | None = None
  """Matmul dtype (the loss stays float32)."""
  remat: bool | None = None
  """Recompute each block in the backward pass (less memory, ~1/3 more compute)."""
  microbatches: int | None = None
  """Pipeline microbatches when the mesh has stage > 1 (unset: one per stage); the GPipe bubble is (S-1)/(M+S-1)."""
  attention: Literal["auto", "xla", "flash", "cudnn", "ring", "allgather"] | None = None
  """Attention implementation (models/attention.py); with a `context` mesh axis, ring or allgather (auto: ring)."""
  logit_stats: bool | None = None
  """Log each step's largest attention logit (attn/max_logit, attn/max_logit_layer); on for --optimizer muonclip."""
  moe: MoEFlags = dataclasses.field(default_factory=MoEFlags)
  """Mixture of experts (--moe.num-experts 8 --moe.top-k 2 ...): each flag overrides one field of the preset's.
  Expert parallelism comes from an `expert` mesh axis; router metrics go to metrics.jsonl as moe/*."""
  optimizer: Annotated[str, tyro.conf.arg(help=f"One of {', '.join(sorted(OPTIMIZERS))} (their hyperparameters "
                                               "are listed above); unset hyperparameters take its defaults.")] = "adamw"
  lr: float = 3e-3
  """Peak learning rate."""
  weight_decay: float | None = None
  """Optimizer weight decay (unset: the optimizer's default)."""
  b1: float | None = None
  """First-moment decay, for optimizers that have b1 (unset: its default)."""
  b2: float | None = None
  """Second-moment decay, for optimizers that have b2 (unset: its default)."""
  opt: tuple[str, ...] = ()
  """More optimizer hyperparameters as KEY=VALUE (VALUE parsed as JSON), e.g. --opt nesterov=false."""
  schedule: Literal["cosine", "wsd", "constant"] = "cosine"
  """Learning-rate schedule after the linear warmup (wsd = warmup-stable-decay)."""
  warmup_steps: int | None = None
  """Linear warmup steps (unset: 10% of --steps, at most 100)."""
  min_lr_ratio: float = 0.1
  """Final learning rate as a fraction of the peak (cosine, wsd)."""
  grad_clip: float = 1.0
  """Clip the global gradient norm to this (0 = off)."""
  steps: int = 200
  """Training steps (optimizer updates) in the whole run."""
  stop_at: int | None = None
  """Stop after this step with a checkpoint, as if preempted; rerunning resumes the same schedule."""
  batch_size: int = 16
  """Global batch (sequences per step), split over the data axes of the mesh."""
  seq_len: int = 128
  """Tokens per sequence (bytes, on a text corpus)."""
  seed: int = 0
  """Seeds the initialization and the batch order."""
  mesh: str = "data=2,fsdp=2,tensor=2"
  """Axis sizes over data, stage, fsdp, expert, context, tensor; omitted axes are 1, one may be -1."""
  switch_at: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
  """STEP:MESH, repeatable: after STEP steps move the whole state to MESH in-process and train on there (its step
  is compiled before training starts). MESH may use fewer devices than --mesh: the first ones it needs."""
  devices: int = 8
  """Simulated devices when running on the CPU (ignored on accelerators)."""
  zero1: bool = False
  """ZeRO-1: split the optimizer state over the data axis as well (the parameters stay replicated there)."""
  sync: str = "allreduce"
  """How the replicas on the data axis agree (research/sync.py): allreduce (every step's gradients averaged),
  local:H (local SGD / DiLoCo: H steps apart, then an outer step), gossip[:ring|complete|FILE] (decentralized: each
  step, average with the neighbours), stale:TAU[:random] (gradients TAU steps old: simulated asynchronous workers)."""
  outer_lr: float = 0.7
  """--sync local:H: the outer optimizer's learning rate (DiLoCo's 0.7)."""
  outer_momentum: float = 0.9
  """--sync local:H: the outer optimizer's Nesterov momentum (DiLoCo's 0.9; 0 = plain SGD)."""
  data: str | None = None
  """A text file, a directory of text files, or a .npy/.bin token array (unset: the stdlib corpus)."""
  sampling: Literal["random", "sequential"] = "random"
  """Training windows drawn uniformly at random each step, or read in order as a stream (adjacent text in a batch and
  across steps: an unshuffled dataset)."""
  tokenizer: str | None = None
  """Encode the text with this Hugging Face tokenizer.json (or a directory holding one) instead of bytes; the tokens
  are cached once (research/tokenized.py)."""
  init_from: str | None = None
  """Start from pretrained parameters: hf:PATH (a Hugging Face model directory) or an optlab RUN_DIR (its newest
  checkpoint). The model config is the checkpoint's (a conflicting model flag is an error); the optimizer starts
  fresh. Resuming this run later resumes it, not the source."""
  freeze: str | None = None
  """Keep the parameters whose path matches this regular expression fixed (no optimizer state, no update), e.g.
  'embed|norm' or 'blocks/(wq|wk)'."""
  peft: Literal[peft.METHODS] | None = None
  """Fine-tune adapters on the frozen model instead of its weights (models/peft.py), usually with --init-from: the
  base stays fixed (no gradient, no optimizer state), checkpoints hold the adapters with it, research.export writes
  it merged or (LoRA, DoRA) as a PEFT adapter."""
  peft_options: Annotated[adapters.PeftFlags, tyro.conf.arg(name="peft")] = dataclasses.field(
      default_factory=adapters.PeftFlags)
  """Adapter settings (--peft.rank 8 --peft.alpha 16 --peft.targets REGEX ...); each method reads its own."""
  out: str = "runs/default"
  """Run directory: metrics.jsonl, config.json, ckpt/. An existing one is resumed (one run at a time: it is locked)."""
  amend: bool = False
  """Resume although training settings (--lr, --steps, --seed, the data, ...) differ from the checkpoint's: the run
  goes on with the new ones and config.json's `history` records the change (without it, such a resume is refused)."""
  eval_every: int = 25
  """Steps between evaluations on the held-out batches (and at the last step)."""
  eval_batches: int = 8
  """Held-out batches per evaluation (the same ones every time)."""
  ckpt_every: int = 100
  """Steps between checkpoints (and one at the end, or when stopped)."""
  keep: int = 3
  """Checkpoints kept (the newest)."""
  log_every: int = 10
  """Steps between records in metrics.jsonl and lines or bar updates on the console."""
  peak_flops: float | None = None
  """FLOP/s that MFU is relative to (unset: the best fp32 matmul rate this machine has shown, see README)."""
  progress: bool = True
  """Console output: a progress bar on a terminal, plain lines otherwise (--no-progress: only the final line)."""
  compile_cache: bool = True
  """Keep compiled programs in ~/.cache/optlab/jax ($OPTLAB_CACHE) so reruns and resumes start fast."""
  max_bad_steps: int = 5
  """Non-finite steps (loss, gradients or updated parameters; their updates are skipped) in a row that stop the run
  (0 = never)."""
  spike_factor: float = 1.5
  """Flag a loss above this multiple of the median of the last --spike-window losses (0 = off)."""
  spike_window: int = 100
  """Finite losses the spike detector's median looks back over."""
  coordinator: str | None = None
  """HOST:PORT of process 0 in a multi-process run (or $JAX_COORDINATOR_ADDRESS); every process runs the same
  command with its own --process-id (see README, Multi-host)."""
  num_processes: int | None = None
  """Processes in a multi-process run (or $JAX_NUM_PROCESSES)."""
  process_id: int | None = None
  """This process's index, 0 .. --num-processes - 1 (or $JAX_PROCESS_ID)."""
  peer_timeout: float = 300.0
  """Multi-process runs: a process that sees no step complete for this many seconds (a peer died mid-collective)
  exits with one error line and status 4; restarting every process resumes (compilation, the first step, is not
  timed)."""
  distributed: Literal["auto", "on", "off"] = "auto"
  """auto: start jax.distributed when a coordinator is given or SLURM/Open MPI launched several tasks; on: always,
  with JAX's cluster detection (TPU pods, Kubernetes); off: never."""


class RunError(ValueError):
  """A run that cannot start as configured."""


# Bad input of any kind: reported as one line and exit status 2 by the CLIs.
USER_ERRORS = (RunError, preflight.PreflightError, rundir.RunDirError, ConfigError, UnknownOptimizerError,
               CheckpointError, DataError, MeshError, ShardingError, DistributedError, PipelineError,
               init_from.InitError, HFError, peft.PEFTError, AttentionError)


def _setup_jax(devices: int, compile_cache: bool):
  try:
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:  # backend already up (a test or notebook set it): keep what is there
    pass
  one_blas_thread()
  if compile_cache and not jax.config.jax_compilation_cache_dir:  # reruns and resumes skip compilation
    root = os.environ.get("OPTLAB_CACHE") or os.path.expanduser("~/.cache/optlab")
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax"))


def one_blas_thread():
  """One thread for each BLAS library loaded (numpy's and scipy's OpenBLAS, which jaxlib's CPU LAPACK kernels call):
  with several simulated devices running those kernels at once, each call's own spinning thread pool oversubscribed
  the cores (a Kron step on 8 devices ran ~10x slower: 72 vs 704 tokens/s on the tiny preset, 2 cores). XLA's own
  matmuls do not use them. The limit holds for the rest of the process (an experiment's NumPy included)."""
  import importlib

  import threadpoolctl
  importlib.import_module("scipy.linalg")  # loads scipy's OpenBLAS, so that the limit reaches it
  threadpoolctl.threadpool_limits(1, user_api="blas")


def _model_config(cfg: TrainConfig):
  """The preset (or --init-from's config) with every given flag overriding its one field (--moe.* fields of the
  MoE included)."""
  over = {k: getattr(cfg, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "qk_norm",
                                       "qkv_bias", "tie_embeddings", "compute_dtype", "remat", "microbatches",
                                       "attention", "logit_stats")
          if getattr(cfg, k) is not None}
  if needs_max_logits(cfg.optimizer):  # MuonClip reads each head's max logit from the forward pass
    over["logit_stats"] = True
  moe = {k: v for k, v in dataclasses.asdict(cfg.moe).items() if v is not None}
  if cfg.init_from:
    return init_from.model_config(cfg, {**over, "moe": moe})
  if moe:
    base = PRESETS[cfg.model].moe if cfg.model in PRESETS else None
    if base is None and "num_experts" not in moe:
      raise RunError(f"--model {cfg.model} is dense: give --moe.num-experts to make it a mixture of experts")
    over["moe"] = dataclasses.replace(base or MoEConfig(), **moe)
  return preset(cfg.model, **over)


def _opt_hparams(cfg: TrainConfig) -> dict:
  hp = {k: getattr(cfg, k) for k in ("weight_decay", "b1", "b2") if getattr(cfg, k) is not None}
  for item in cfg.opt:
    key, sep, value = item.partition("=")
    if not sep:
      raise RunError(f"--opt {item!r} is not KEY=VALUE")
    try:
      hp[key] = json.loads(value)
    except json.JSONDecodeError:
      hp[key] = value
  return hp


def _exact(cfg: TrainConfig) -> bool:
  """Whether the optimizer runs in an exact variance-reduction mode (MARS mode=exact, Muon-MVR mode=mvr2)."""
  return needs_prev_grads(cfg.optimizer, _opt_hparams(cfg))


def _optimizer(cfg: TrainConfig):
  hp = _opt_hparams(cfg)
  warmup = min(100, cfg.steps // 10) if cfg.warmup_steps is None else cfg.warmup_steps
  schedule = make_schedule(cfg.schedule, cfg.lr, cfg.steps, warmup=warmup, min_ratio=cfg.min_lr_ratio)
  try:
    tx = get_optimizer(cfg.optimizer, schedule, **hp)
  except ValueError as e:  # the registry's refusals, or a factory's own (MGUP's AlignmentError, BAdamError)
    raise e if isinstance(e, UnknownOptimizerError) else RunError(f"--optimizer {cfg.optimizer}: {e}") from None
  if cfg.grad_clip > 0 and _exact(cfg):  # the clip also applies to prev_grads, each by its own global norm
    tx = with_global_norm_clip(tx, cfg.grad_clip)
  elif cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
  if cfg.freeze and _exact(cfg):
    raise RunError("--freeze does not combine with the exact MARS / Muon-MVR2 modes (prev_grads)")
  return init_from.freeze(tx, cfg.freeze)[0], schedule


def _switch_plan(cfg: TrainConfig) -> list[tuple[int, jax.sharding.Mesh]]:
  """--switch-at as (step, mesh) in step order; a mesh spec with fixed sizes takes the first devices it needs."""
  plan = {}
  for item in cfg.switch_at:
    at, sep, spec = item.partition(":")
    if not (sep and at.strip().isdigit()):
      raise RunError(f"--switch-at {item!r} is not STEP:MESH, e.g. --switch-at 100:fsdp=4,tensor=2")
    if not 0 < int(at) < cfg.steps:
      raise RunError(f"--switch-at {item!r}: STEP must lie in [1, --steps={cfg.steps})")
    if int(at) in plan:
      raise RunError(f"--switch-at names step {int(at)} twice")
    plan[int(at)] = make_mesh(spec, devices=devices_for(spec))
    try:  # the batch must split over the new mesh's data axes
      batch_sharding(plan[int(at)], (cfg.batch_size, cfg.seq_len))
    except ShardingError as e:
      raise ShardingError(f"--switch-at {item!r}: the batch: {e}") from None
  return sorted(plan.items(), key=lambda item: item[0])


def _switch_layout(mesh, state, names, graphdef, tx, cfg: TrainConfig, val_host):
  """What training on `mesh` needs: (mesh, state shardings, batch sharding, held-out batches there, train and
  eval steps compiled ahead of time (`.lower(...).compile()`) for those shardings)."""
  try:
    shardings = state_shardings(state, names, mesh, zero1=cfg.zero1)
  except ShardingError as e:
    raise ShardingError(f"--switch-at to {mesh_spec(mesh)}: {e}") from None
  batch_sh = batch_sharding(mesh, (cfg.batch_size, cfg.seq_len))
  train, evaluate = make_steps(graphdef, tx, shardings, batch_sh, max_logits=needs_max_logits(cfg.optimizer))
  x = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32, sharding=batch_sh)
  t = time.perf_counter()
  with jax.set_mesh(mesh):
    train = train.lower(abstract_state(state, shardings), x, x).compile()
    evaluate = evaluate.lower(abstract_state(state["params"], shardings["params"]), x, x,
                              abstract_state(state.get("buffers", {}), shardings.get("buffers", {}))).compile()
  print(f"compiled the steps for mesh {mesh_spec(mesh)} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
  return mesh, shardings, batch_sh, [global_batch(b, mesh) for b in val_host], train, evaluate


def _pipeline_plan(mesh, mcfg, batch_size: int) -> dict | None:
  """The GPipe pipeline a mesh with stage > 1 runs (printed, and saved in config.json); None without one."""
  S = mesh.shape["stage"]
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


def keep_prev_params(state, shardings):
  """(state, shardings) of an exact variance-reduced run plus "prev_params": the parameters before the last
  update (at first a copy of the initial ones), sharded like the parameters."""
  prev = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings["params"])(state["params"])
  return {**state, "prev_params": prev}, {**shardings, "prev_params": shardings["params"]}


def lm_loss(graphdef):
  """loss_fn(params, x, y, buffers) -> (cross entropy + weighted MoE aux losses, (cross entropy, aux)), aux the
  model's (per-layer router stats, attention-logit maxima)."""
  def loss_fn(params, x, y, buffers):
    model = nnx.merge(graphdef, params, buffers)
    logits, aux = model.forward(x)
    ce = cross_entropy(logits, y)
    return ce + aux_loss(aux, model.c), (ce, aux)
  return loss_fn


def make_steps(graphdef, tx, shardings, batch_sh, *, max_logits: bool = False):
  """Jitted (train_step, eval_step) with the state's shardings pinned; train_step donates the state.

  A state with "prev_params" (`keep_prev_params`) also differentiates the loss at the previous parameters on
  the same batch and hands that gradient to the optimizer as `prev_grads=` (exact MARS / Muon-MVR2). With
  `max_logits`, the model's per-head attention-logit maxima (aux "max_logit") go to it as `max_logits=` (MuonClip).
  A step whose loss, gradient norm or update norm is not finite leaves the state unchanged but for "step", and reports
  finite=False (`research.health`).
  """
  exact = "prev_params" in shardings
  loss_fn = lm_loss(graphdef)

  def eval_fn(params, x, y, buffers):
    return loss_fn(params, x, y, buffers)[1][0]

  def train_step(state, x, y):
    buffers = state.get("buffers", {})
    (total, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], x, y, buffers)
    extra = {"prev_grads": jax.grad(lambda p: loss_fn(p, x, y, buffers)[0])(state["prev_params"])} if exact else {}
    if max_logits:
      extra["max_logits"] = aux["max_logit"]
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"], **extra)
    params = optax.apply_updates(state["params"], updates)
    new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
    if exact:
      new["prev_params"] = state["params"]
    if buffers:  # a router's selection bias, a PEFT run's frozen base
      new["buffers"] = buffers
    metrics = {}
    if "load" in aux:  # MoE: aux-loss-free bias update from this step's loads (DeepSeek-V3), router metrics
      rate = nnx.merge(graphdef, state["params"], buffers).c.moe.bias_rate
      if buffers:
        new["buffers"] = update_router_bias(buffers, aux, rate)
      metrics = {"aux_loss": total - loss, **moe_summary(aux)}
    if "max_logit" in aux:  # (L, N): the largest over heads and layers, and each layer's
      metrics["attn/max_logit"] = jnp.max(aux["max_logit"])
      metrics["attn/max_logit_layer"] = jnp.max(aux["max_logit"], axis=-1)
    grad_norm = optax.tree.norm(grads)
    ok = step_ok(total, grad_norm, updates)
    return keep_if_finite(ok, new, state), {"loss": loss, "grad_norm": grad_norm, "finite": ok, **metrics}

  train = jax.jit(train_step, in_shardings=(shardings, batch_sh, batch_sh), out_shardings=(shardings, None),
                  donate_argnums=0)
  evaluate = jax.jit(eval_fn, in_shardings=(shardings["params"], batch_sh, batch_sh, shardings.get("buffers", {})))
  return train, evaluate


class _Stop:
  """Turns SIGINT/SIGTERM into a flag the loop checks after each step."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    if _EARLY_SIGNALS:  # one came during the CLI's imports
      self.signum = _EARLY_SIGNALS[0]
    for s in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[s] = signal.signal(s, self._handle)
      except ValueError:  # not the main thread: no handler
        pass
    return self

  def _handle(self, signum, _frame):
    if self.signum is not None:  # a second signal: stop now, without the checkpoint
      raise KeyboardInterrupt
    self.signum = signum
    print(f"\nsignal {signum}: saving a checkpoint after this step (again to abort)", file=sys.stderr)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def _router_metrics(out: dict) -> dict:
  """The MoE and attention-logit entries of a step's outputs as JSON numbers (per-expert loads, per-layer maxima as
  lists)."""
  got = jax.device_get({k: v for k, v in out.items() if k.startswith(("moe/", "attn/")) or k == "aux_loss"})
  return {k: np.asarray(v).tolist() for k, v in got.items()}


def _state_signature(meta: dict) -> dict:
  """What fixes the saved state's shapes and structure: the model's shape fields and the optimizer."""
  model = {k: v for k, v in meta["model_config"].items()
           if k not in ("compute_dtype", "remat", "microbatches", "attention", "logit_stats")}
  if model.get("moe"):  # the expert shapes and whether a selection bias is kept; not the routing or loss knobs
    m = model["moe"]
    model["moe"] = {k: m[k] for k in ("num_experts", "d_expert", "num_shared")} | {"bias": m["bias_rate"] > 0}
  train = meta["train"]
  flag = train.get("sync", "allreduce")
  mode = sync.parse(flag)
  replicas = parse_mesh_spec(meta["mesh"], len(meta["devices"]))["data"]
  return {**model, "optimizer": train["optimizer"], "opt": list(train["opt"]), "freeze": train.get("freeze"),
          "peft": peft_settings(meta), "sync": flag,  # per-replica state, the delays' draws
          **({"replicas": replicas} if mode.replicated or mode.random else {})}


def _check_resume(saved: dict, meta: dict, out: str):
  old, new = _state_signature(saved), _state_signature(meta)
  changed = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
  if changed:
    raise RunError(f"{out} holds a checkpoint of a different model/optimizer ({'; '.join(changed)}); "
                   f"use a new --out or the original settings")
  settings = rundir.changed_settings(saved, meta)
  if settings and not meta["train"]["amend"]:
    raise RunError(f"{out} was trained with other settings ({rundir.describe(settings)}); rerun with the original "
                   f"flags, or add --amend to go on with these (config.json's history records the change)")
  if saved["corpus"]["fingerprint"] != meta["corpus"]["fingerprint"]:
    print(f"warning: {out} was trained on other data (corpus fingerprint changed); continuing", file=sys.stderr)
  return settings


def _setup(cfg: TrainConfig):
  """Mesh, model config, data and held-out batches, with every check of the flags that needs them."""
  mesh = make_mesh(cfg.mesh)
  mcfg = _model_config(cfg)
  _check_sync(cfg, mesh, mcfg)
  if needs_max_logits(cfg.optimizer) and mcfg.qk_norm:
    raise RunError(f"--optimizer {cfg.optimizer} clips W_q and W_k, which QK-norm undoes: --model {cfg.model} has "
                   f"qk_norm; add --qk-norm False")
  corpus = load_corpus(cfg.data, tokenizer=cfg.tokenizer)
  if mcfg.vocab_size < corpus.vocab_size:
    raise RunError(f"the data has {corpus.vocab_size} token ids but the model's vocab_size is {mcfg.vocab_size}")
  batch_sh = batch_sharding(mesh, (cfg.batch_size, cfg.seq_len))
  plan = _switch_plan(cfg)
  pipe = _pipeline_plan(mesh, mcfg, cfg.batch_size)
  for m in [mesh] + [m for _, m in plan]:  # a switch to a pipeline or context mesh must fit the model and batch too
    if m is not mesh:
      _pipeline_plan(m, mcfg, cfg.batch_size)
    try:
      check_attention(mcfg.attention, cfg.seq_len, m.shape["context"])
    except AttentionError as e:
      raise RunError(f"--mesh {mesh_spec(m)}: {e}") from None
  if cfg.peft and (cfg.freeze or cfg.switch_at or mesh.shape["stage"] > 1):
    raise RunError("--peft trains the adapters only and does not combine with --freeze, --switch-at or a pipeline "
                   "(stage) mesh")
  get_batch(corpus.train, cfg.seed, 0, 1, cfg.seq_len)  # fail early if the data is shorter than a sequence
  val_host = eval_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
  val = [global_batch(b, mesh) for b in val_host]
  return mesh, mcfg, corpus, batch_sh, plan, pipe, val_host, val


def _check_sync(cfg: TrainConfig, mesh, mcfg):
  """--sync parsed and checked against the rest of the run (RunError)."""
  try:
    mode = sync.parse(cfg.sync)
    if mode.kind == "gossip":
      sync.mixing_matrix(mode, mesh.shape["data"])
    sync.outer_optimizer(cfg.outer_lr, cfg.outer_momentum)
  except sync.SyncError as e:
    raise RunError(str(e)) from None
  if mode.kind == "allreduce":
    return
  clash = [flag for flag, on in (("--peft", cfg.peft), ("--switch-at", cfg.switch_at), ("--zero1", cfg.zero1),
                                 ("a pipeline (stage) mesh", mesh.shape["stage"] > 1), ("a MoE model", mcfg.moe),
                                 (f"--optimizer {cfg.optimizer}'s exact mode", _exact(cfg))) if on]
  if clash:
    raise RunError(f"--sync {cfg.sync} keeps a copy of the parameters per data replica and does not combine with "
                   f"{', '.join(clash)}")
  if mesh.shape["data"] == 1:
    print(f"warning: --sync {cfg.sync} on a mesh with data=1 has a single replica (add data=R to --mesh for R)",
          file=sys.stderr)


def _initial_state(cfg: TrainConfig, mcfg, mesh, tx, corpus):
  """(graphdef, state, shardings, report) at step 0, created sharded: random parameters, or --init-from's (unless the
  run has a checkpoint of its own to resume), or --peft's adapters on either, --freeze's report, and the exact
  modes' copy of the parameters. `report`: what config.json records of it (--peft's sizes) or {}."""
  fresh_init_from = cfg.init_from and not rundir.has_checkpoint(cfg.out)  # a resumed run restores its own state instead
  report = {}
  if cfg.peft:
    base = init_from.load_model(cfg.init_from, mcfg, mesh) if fresh_init_from else \
        adapters.random_base(mcfg, mesh, cfg.seed)
    first = global_batch(get_batch(corpus.train, cfg.seed, 0, cfg.batch_size, cfg.seq_len), mesh)  # SNIP's batch
    with jax.set_mesh(mesh):
      graphdef, state, shardings, report = adapters.initial_state(base, cfg.peft, cfg.peft_options, cfg.seed, tx,
                                                                  mesh, first, cfg.zero1)
    if is_primary():
      print(adapters.report_line(report), file=sys.stderr)
    report = {"peft": report}
  else:
    graphdef, state, shardings = init_train_state(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)), tx, mesh,
                                                  zero1=cfg.zero1)
    if fresh_init_from:
      state["params"] = init_from.load_params(cfg.init_from, mcfg, mesh)
  if cfg.freeze and is_primary():
    print(init_from.frozen_summary(state["params"], init_from.freeze(tx, cfg.freeze)[1], _optimizer(
        dataclasses.replace(cfg, freeze=None))[0], tx), file=sys.stderr)
  if _exact(cfg):  # exact MARS / Muon-MVR2: one more copy of the parameters, a second backward pass per step
    state, shardings = keep_prev_params(state, shardings)
  return graphdef, state, shardings, report


def _newest_readable(ckpt, meta: dict, state, shardings, switches, out: str):
  """(step, restored state, its meta) of the newest checkpoint every process can read, or (None, None, None);
  unreadable newer ones are moved aside (never deleted), and none readable among several is an error."""
  start, damaged = None, []
  for s in reversed(ckpt.all_steps()):  # the newest readable checkpoint
    try:
      saved = ckpt.read_meta(s)
      settings = _check_resume(saved, meta, out)
      layout = [sw for at, sw in switches if at <= s]  # the mesh the run had switched to by then
      restored = ckpt.restore(s, state, layout[-1][1] if layout else shardings)
      error = None
    except CheckpointError as e:
      error = e
    if all_agree(error is None):
      start = s
      break
    damaged.append((s, error or CheckpointError(f"checkpoint {ckpt.directory}/{s} is unreadable on another process")))
  if start is not None:
    meta["history"] = rundir.amend_history(saved, settings, start)
  if damaged and start is None:
    raise CheckpointError(f"{damaged[0][1]}; no older checkpoint is readable: move {ckpt.directory} aside or use a "
                          f"new --out")
  for s, e in damaged:  # kept byte for byte, out of orbax's sight (no overwrite, no keep-N deletion)
    moved = ckpt.quarantine(s)
    if is_primary():
      print(f"warning: {e}; moved to {moved}, resuming from step {start}", file=sys.stderr)
  return (start, restored, saved) if start is not None else (None, None, None)


def run(cfg: TrainConfig) -> list[dict]:
  """Trains (or resumes) and returns the metrics records of the whole run: the flags checked before anything starts,
  the run directory locked for the run (and removed again if this run created it and failed before its first
  checkpoint)."""
  preflight.check(cfg)
  with _Stop() as stop:  # from here on SIGINT/SIGTERM stop the run cleanly, during start-up too
    init_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.distributed,  # before any JAX use
                     heartbeat_timeout=cfg.peer_timeout + 60)  # JAX's abort comes after ours, if ours is armed
    _setup_jax(cfg.devices, cfg.compile_cache)
    with rundir.claim(cfg.out, lock=is_primary(), keep_on=(BadStepsError, CheckpointSaveError)):
      return _train(cfg, stop)


def _train(cfg: TrainConfig, stop: _Stop) -> list[dict]:
  mesh, mcfg, corpus, batch_sh, plan, pipe, val_host, val = _setup(cfg)

  tx, schedule = _optimizer(cfg)
  graphdef, state, shardings, report = _initial_state(cfg, mcfg, mesh, tx, corpus)
  train_step, eval_step = make_steps(graphdef, tx, shardings, batch_sh, max_logits=needs_max_logits(cfg.optimizer))
  state, shardings, syncer = _sync_steps(cfg, graphdef, tx, state, shardings, batch_sh, train_step)
  names = logical_names(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)))[2]
  switches = [(at, _switch_layout(m, state, names, graphdef, tx, cfg, val_host)) for at, m in plan]

  meta = {"train": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(mcfg), "mesh": mesh_spec(mesh),
          "corpus": {"source": corpus.source, "fingerprint": corpus.fingerprint,
                     "train_tokens": int(len(corpus.train)), "val_tokens": int(len(corpus.val))},
          "jax": jax.__version__, "devices": [str(d) for d in mesh.devices.flat]}
  if pipe:
    meta["pipeline"] = pipe
  meta.update(report)
  ckpt = Checkpointer(os.path.join(cfg.out, "ckpt"), keep=cfg.keep, every=cfg.ckpt_every)
  metrics = rundir.MetricsLog(os.path.join(cfg.out, "metrics.jsonl"), enabled=is_primary())
  monitor = Monitor(cfg.max_bad_steps, cfg.spike_factor, cfg.spike_window)
  start, restored, saved = _newest_readable(ckpt, meta, state, shardings, switches, cfg.out)
  if start is not None:
    while switches and switches[0][0] <= start:  # resume on the mesh the run had switched to by then
      mesh, shardings, batch_sh, val, train_step, eval_step = switches.pop(0)[1]
      syncer.switched(train_step)
    state = restored
    monitor.load(saved.get("health"))
    print(f"resuming {cfg.out} from step {start}", file=sys.stderr)
  start = start or 0
  peak = Peak(cfg.peak_flops)  # what MFU divides by, and how it was obtained (research/throughput.py)
  meta["peak_flops"] = {"flops": peak.flops, "source": peak.source}
  records = metrics.open(start)  # what the interrupted run logged past its checkpoint is dropped
  if is_primary():  # one writer for the run's own files; orbax coordinates the checkpoint writes
    rundir.write_json_lines(os.path.join(cfg.out, "config.json"), [meta], indent=2)

  model_flops_per_token = flops_per_token(mcfg, cfg.seq_len)
  meter = Meter(cfg.batch_size * cfg.seq_len)

  def evaluate(state):  # the model: --sync gossip's is the replicas' mean
    params = syncer.model(state)["params"]
    return float(np.mean([eval_step(params, x, y, state.get("buffers", {})) for x, y in val]))

  progress = Progress(cfg.steps, start, enabled=cfg.progress and is_primary())
  step = start
  watchdog = Watchdog(cfg.peer_timeout, f"after step {{step}} of a {jax.process_count()}-process run: a peer "
                      f"process probably died; restart every process with the same command to resume")
  try:
    with watchdog if jax.process_count() > 1 else contextlib.nullcontext(), contextlib.ExitStack() as in_mesh:
      in_mesh.enter_context(jax.set_mesh(mesh))
      end = min(cfg.steps, cfg.stop_at or cfg.steps)
      while step < end and stop.signum is None:
        if switches and switches[0][0] == step:  # --switch-at: the new steps are compiled, only the state moves
          t = time.perf_counter()
          mesh, shardings, batch_sh, val, train_step, eval_step = switches.pop(0)[1]
          syncer.switched(train_step)
          state = jax.block_until_ready(reshard(state, shardings=shardings, donate=True))
          in_mesh.close()
          in_mesh.enter_context(jax.set_mesh(mesh))
          print(f"step {step}: switched to mesh {mesh_spec(mesh)} in {time.perf_counter() - t:.2f} s", file=sys.stderr)
        state, out = syncer.step(state, *global_batch(get_batch(corpus.train, cfg.seed, step, cfg.batch_size,
                                                                   cfg.seq_len, cfg.sampling), mesh))
        step += 1
        last = step == cfg.steps
        state = syncer.after(state, step, last)  # --sync local:H: the outer step every H steps
        if step == start + 1:  # the first step compiles: throughput is timed from its end
          jax.block_until_ready(out)
          meter.compiled(step)
        monitor.push(step, out)
        ckpt.check()  # a failed background save stops the run here
        log = step % cfg.log_every == 0 or last or step % cfg.eval_every == 0
        if log or step % cfg.ckpt_every == 0 or step == end or stop.signum is not None:
          monitor.flush()  # the loss and finite flag of every step since the last flush, in one transfer
        else:  # the previous step's (done by now, this one queued behind it): every step is counted in time
          monitor.flush(keep=1)
        watchdog.beat(step - 1)  # every process took part in the steps read back so far
        if log:
          loss = float(out["loss"])  # waits for the step
          rec = {"step": step, "loss": loss, "grad_norm": float(out["grad_norm"]), "lr": float(schedule(step - 1)),
                 **monitor.take()}
          rate = meter.window(step)  # None until a whole step has run after compilation
          if rate is not None:
            rec["tokens_per_s"], rec["mfu"] = rate, peak.mfu(rate * model_flops_per_token)
          if step == end and meter.average() is not None:  # the whole run's (this session's) averages
            rec["run_tokens_per_s"] = meter.average()
            rec["run_mfu"] = meter.average() * model_flops_per_token / peak.flops
            rec["peak_source"] = peak.source
          if step % cfg.eval_every == 0 or last:
            rec["val_loss"] = evaluate(state)
          rec.update(_router_metrics(out))
          rec.update(syncer.metrics(state, step, out, last))
          records.append(rec)
          metrics.write(rec)
          progress.log(rec)
          meter.restart()  # evaluation and logging are not training time
        if monitor.failed:  # stop before saving: the newest checkpoint stays the last one before the bad steps
          break
        final = step == end or stop.signum is not None
        # every --ckpt-every steps (no periodic save amid bad steps) and at the end; deciding here, not in orbax,
        # keeps orbax from also saving the first step it sees (a step-1 checkpoint nobody asked for)
        if (monitor.bad_run == 0 and step % cfg.ckpt_every == 0) or final:
          state = syncer.model(state)  # gossip: "params" (what export and sampling read) = the replicas' mean
          ckpt.save(step, state, {**meta, "health": monitor.state()}, force=True)
        progress.advance()
    progress.close()
    ckpt.close()
  except CheckpointSaveError:  # nothing past the newest committed checkpoint stays logged
    metrics.cut(ckpt.latest_step())
    raise
  finally:
    metrics.close()

  if monitor.failed:
    raise monitor.error(step, ckpt.manager.latest_step())
  if stop.signum is not None:
    saved = ("checkpoint saved" if step > start else
             "the checkpoint it resumed from is kept" if start else "nothing was saved")
    print(f"stopped by signal {stop.signum} at step {step}; {saved}, rerun the same command to resume",
          file=sys.stderr)
    raise SystemExit(128 + stop.signum)
  return records


def _sync_steps(cfg: TrainConfig, graphdef, tx, state, shardings, batch_sh, train_step):
  """(state, shardings, sync.Steps) of --sync: the state laid out for it and its programs (allreduce: the plain
  `train_step`, audited for its bytes)."""
  mode = sync.parse(cfg.sync)
  outer_tx = sync.outer_optimizer(cfg.outer_lr, cfg.outer_momentum)
  state, shardings = sync.init_state(mode, state, shardings, outer_tx, seed=cfg.seed)
  steps = sync.Steps(mode, lm_loss(graphdef), tx, outer_tx, shardings, batch_sh,
                     max_logits=needs_max_logits(cfg.optimizer), mixing=sync.mixing_matrix(mode, batch_sh.mesh.shape[
                         "data"]) if mode.kind == "gossip" else None, plain=train_step)
  return state, shardings, steps


def optimizer_help() -> str:
  """Every registered optimizer with its hyperparameters and defaults (shown by --help)."""
  from optim import OPTIMIZERS, hyperparameters
  lines = ["optimizers (--optimizer NAME; any hyperparameter below by --opt KEY=VALUE, or --weight-decay/--b1/--b2):"]
  for name in sorted(OPTIMIZERS):
    hp = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in hyperparameters(name).items())
    lines.append(f"  {name}: {hp}")
  return "\n".join(lines)


COLLECTIVE_FAILED = r"Gloo|NCCL|[Cc]onnection (reset|closed) by peer|heartbeat"


def _failure(e: Exception) -> tuple[int, str] | None:
  """(exit status, error line) of a run that failed in a way the CLI reports in one line, or None (a bug: the
  traceback is shown)."""
  text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
  peers = jax.distributed.is_initialized() and jax.process_count() > 1
  if peers and (isinstance(e, jax.errors.JaxRuntimeError) or re.search(COLLECTIVE_FAILED, str(e))):
    # a collective failed (in a step, or in a checkpoint save's own collectives): a peer is gone
    return WATCHDOG_EXIT, (f"a collective failed in a {jax.process_count()}-process run ({text}): a peer process "
                           f"probably died; restart every process with the same command to resume")
  if isinstance(e, USER_ERRORS) or isinstance(e, OSError):  # bad input; the run directory's disk or permissions
    return 2, str(e)
  if isinstance(e, BadStepsError):
    return 3, str(e)
  if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
    return 2, f"out of memory ({text}): lower --batch-size or --seq-len, add --remat, or shard over more devices"
  return None


def main(argv=None):
  cfg = tyro.cli(TrainConfig, args=argv, prog="python -m research.train",
                 description=f"{TrainConfig.__doc__}\n\n{optimizer_help()}")
  quiet_orbax_errors()  # a failed save is reported in one line of ours
  try:
    records = run(cfg)
  except Exception as e:
    failure = _failure(e)
    if failure is None:
      raise
    print(f"error: {failure[1]}", file=sys.stderr, flush=True)
    if jax.distributed.is_initialized() and jax.process_count() > 1:
      sys.stdout.flush()  # and not through jax.distributed's shutdown barrier: a dead peer would hold it until JAX's
      os._exit(failure[0])  # heartbeat timeout, then abort this process with a stack trace
    raise SystemExit(failure[0]) from None
  if records and is_primary():
    print(summary(records, cfg.out))


if __name__ == "__main__":
  main()
  for _signum in (signal.SIGINT, signal.SIGTERM):  # the run is complete and saved: a signal during the
    signal.signal(_signum, signal.SIG_IGN)         # interpreter's teardown (which resets Python handlers) is moot
