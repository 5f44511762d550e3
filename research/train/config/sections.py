"""The trainer's config, section by section: each a small dataclass of the flags one concern reads.

`TrainConfig` (research/train/config/__init__.py) holds one of each. A section's checks sit beside its fields:
`PATHS` (paths that must not be empty: an unset shell variable), `POSITIVE` (counts that must be positive) and `RANGES`
(flag: (low, high, whether low itself is allowed); every value finite), which research/train/setup/checks.py applies
to every section; a numeric flag every command shares (--steps, --batch-size, --seq-len, --seed, --lr, --devices,
--peft.rank, ...) takes its one rule from research/flags.py's table instead. The paths a run reads (--data, --tokenizer,
--init-from) are made absolute when their section is built (research/train/config/paths.py). The flags keep their
spelling: a section's fields are flags without a prefix (`--lr`, `--steps`), but for the three with their own,
`--moe.*`, `--data.*` and `--peft.*` (research/train/config/prefixed.py). `--help` shows one group per section.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, ClassVar, Literal

import tyro

from models import PRESETS, TransformerConfig, peft
from optim import DEFAULT_OPTIMIZER, OPTIMIZERS
from research.train.config.derived import flags_of
from research.train.config.paths import absolute, absolute_data, absolute_source

_PRESET = Annotated[str, tyro.conf.arg(name="model", help=f"Size preset: {', '.join(PRESETS)}. The flags below "
                                                           "override single fields of it.")]
# one flag per documented field of models.TransformerConfig (its schema: models/schema.py), --moe.* apart
ModelSection = flags_of(TransformerConfig, "ModelSection", __name__,
                        first=(("preset", _PRESET, dataclasses.field(default="small")),),
                        doc="The model: a size preset and the fields that override single values of it.")
if typing.TYPE_CHECKING:  # a derived class: its flags are TransformerConfig's fields
  class ModelSection:  # type: ignore[no-redef]  # noqa: D101
    preset: str

    def __getattr__(self, name: str) -> Any: ...


@dataclasses.dataclass
class OptimSection:
  """The optimizer and its learning-rate schedule."""
  RANGES: ClassVar[dict] = {"weight_decay": (0, None, True), "b1": (0, 1, True),  # --lr: research/flags.py's
                            "b2": (0, 1, True), "min_lr_ratio": (0, 1, True), "grad_clip": (0, None, True)}
  optimizer: Annotated[str, tyro.conf.arg(help=f"One of {', '.join(sorted(OPTIMIZERS))} (their hyperparameters "
                                               "are listed above); unset hyperparameters take its defaults.")] = \
      DEFAULT_OPTIMIZER
  lr: float = 3e-3
  """Peak learning rate."""
  weight_decay: float | None = None
  """Optimizer weight decay (unset: the optimizer's default)."""
  b1: float | None = None
  """First-moment decay, for optimizers that have b1 (unset: its default)."""
  b2: float | None = None
  """Second-moment decay, for optimizers that have b2 (unset: its default)."""
  opt: tuple[str, ...] = ()
  """More optimizer hyperparameters as KEY=VALUE (VALUE parsed as JSON), e.g. --opt nesterov=false; a number for a
  KEY ending in learning_rate (adam_learning_rate=3e-3) is a peak on the --lr schedule's shape."""
  schedule: Literal["cosine", "wsd", "constant"] = "cosine"
  """Learning-rate schedule after the linear warmup (wsd = warmup-stable-decay)."""
  warmup_steps: int | None = None
  """Linear warmup steps (unset: 10% of --steps, at most 100)."""
  min_lr_ratio: float = 0.1
  """Final learning rate as a fraction of the peak (cosine, wsd)."""
  grad_clip: float = 1.0
  """Clip the global gradient norm to this (0 = off)."""


@dataclasses.dataclass
class TrainingSection:
  """How long and on how much: steps, batch, sequence length, seed."""
  # --steps, --batch-size, --seq-len, --seed: the rules every command shares (research/flags.py)
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


@dataclasses.dataclass
class DataSection:
  """The training data and the order it is read in."""
  PATHS: ClassVar[tuple] = ("tokenizer",)
  paths: Annotated[tuple[str, ...] | None, tyro.conf.arg(name="data")] = None
  """The training data (unset: the stdlib corpus): files, directories or globs, several allowed: text files or a
  directory of them, Parquet, JSON Lines (.jsonl, .jsonl.gz), Arrow (.arrow) or a `datasets.save_to_disk`
  directory, or a .npy/.bin token array. Tokenized once into cached memory-mapped shards (research/data/shards.py).
  NAME=PATH entries (code=src/ docs=d.jsonl) are a mixture of named sources, sampled by --mix."""
  mix: str | None = None
  """How the named --data sources are mixed (research/data/mixture.py): uniform (the default), size (by training
  tokens), fixed:W1,W2,... (in --data's order), dynamic[:eta=10,c=0.05,every=100,batches=5] (MoE only: weights
  moved toward the sources the router treats least like the others, Zhu et al. 2024)."""
  sampling: Literal["shuffle", "random", "sequential"] = "shuffle"
  """The order of the training windows (research/data/loader.py): shuffle (epochs over windows of the token stream,
  each epoch in its own order from (seed, epoch)), random (starts drawn uniformly with replacement, from (seed,
  step)), or sequential (read in order as a stream: adjacent text in a batch and across steps)."""
  tokenizer: str | None = None
  """Encode the text with this Hugging Face tokenizer.json (or a directory holding one) instead of bytes; the tokens
  are cached once (research/data/tokenized.py). config.json records its absolute path and sha256: research.sample,
  export and quantize use that file, and refuse it if it has changed."""

  def __post_init__(self):  # paths absolute from here on: the run and its config.json name the same files
    if isinstance(self.paths, str):  # data="path" from Python: one path
      self.paths = (self.paths,)
    self.paths = absolute_data(self.paths) or None
    self.tokenizer = absolute(self.tokenizer)


@dataclasses.dataclass
class MeshSection:
  """The device mesh the run is laid out on."""
  spec: Annotated[str, tyro.conf.arg(name="mesh")] = "data=2,fsdp=2,tensor=2"
  """Axis sizes over data, stage, fsdp, expert, context, tensor; omitted axes are 1, one may be -1."""
  switch_at: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
  """STEP:MESH, repeatable: after STEP steps move the whole state to MESH in-process and train on there (its step
  is compiled before training starts). MESH may use fewer devices than --mesh: the first ones it needs."""
  zero1: bool = False
  """ZeRO-1: split the optimizer state over the data axis as well (the parameters stay replicated there)."""

  def features(self) -> dict[str, str | None]:
    """The run features this section turns on, by research/train/setup/clashes.py's names: {feature: flag or None}."""
    return {"switch_at": "--switch-at" if self.switch_at else None, "zero1": "--zero1" if self.zero1 else None}


@dataclasses.dataclass
class SyncSection:
  """How the data replicas agree."""
  mode: Annotated[str, tyro.conf.arg(name="sync")] = "allreduce"
  """How the replicas on the data axis agree (research/train/steps/sync.py): allreduce (every step's gradients
  averaged), local:H (local SGD / DiLoCo: H steps apart, then an outer step), gossip[:ring|complete|FILE]
  (decentralized: each step, average with the neighbours), stale:TAU[:random] (gradients TAU steps old: simulated
  asynchronous workers)."""
  outer_lr: float = 0.7
  """--sync local:H: the outer optimizer's learning rate (DiLoCo's 0.7)."""
  outer_momentum: float = 0.9
  """--sync local:H: the outer optimizer's Nesterov momentum (DiLoCo's 0.9; 0 = plain SGD)."""

  def features(self) -> dict[str, str | None]:
    """The run features this section turns on, by research/train/setup/clashes.py's names: {feature: flag or None}."""
    return {"sync": f"--sync {self.mode}" if self.mode != "allreduce" else None}


@dataclasses.dataclass
class WeightsSection:
  """Where the weights come from: random (the preset's shapes) or pretrained ones."""
  PATHS: ClassVar[tuple] = ("init_from",)
  init_from: str | None = None
  """Start from pretrained parameters: hf:PATH (a Hugging Face model directory) or an optlab RUN_DIR (its newest
  checkpoint). The model config is the checkpoint's (a conflicting model flag is an error); the optimizer starts
  fresh. Resuming this run later resumes it, not the source."""

  def __post_init__(self):
    self.init_from = absolute_source(self.init_from)  # hf:PATH keeps its prefix


@dataclasses.dataclass
class TrainsSection:
  """What trains: every parameter, or the ones left after a freeze, or adapters on a frozen base."""
  freeze: str | None = None
  """Keep the parameters whose path matches this regular expression fixed (no gradient, no optimizer state, no
  update), e.g. 'embed|norm' or 'blocks/(wq|wk)'."""
  freeze_layers: int = 0
  """Keep the bottom N layers of the stack and the embedding table fixed (research/train/steps/layerfreeze.py): the
  backward stops at layer N (no gradient of any kind below it); the trained part has a float32 master, the rest is
  stored in --frozen-dtype. Combines with --freeze (more leaves frozen); 0: off."""
  frozen_dtype: Literal["bfloat16", "float32"] | None = None
  """The dtype the parameters a step does not train are stored in: --freeze's, and with a blockwise optimizer's step or
  --freeze-layers every parameter (what trains has a float32 master copy). Unset: bfloat16 when fine-tuning (with
  --init-from), else float32. They are read in the compute dtype; bfloat16 halves their memory. Runs with none of
  these use no such storage and ignore it (as a study sharing one config over several optimizers needs)."""
  peft: Literal[tuple(peft.ADAPTERS)] | None = None  # type: ignore[valid-type]  # the registered methods
  """Fine-tune adapters on the frozen model instead of its weights (models/peft.py), usually with --init-from: the
  base stays fixed (no gradient, no optimizer state), checkpoints hold the adapters with it, research.export writes
  it merged or (a method PEFT's format holds) as a PEFT adapter."""

  def features(self) -> dict[str, str | None]:
    """The run features this section turns on, by research/train/setup/clashes.py's names: {feature: flag or None}."""
    return {"freeze_layers": "--freeze-layers" if self.freeze_layers else None,
            "peft": "--peft" if self.peft else None, "freeze": "--freeze" if self.freeze else None}


@dataclasses.dataclass
class CheckpointSection:
  """The run directory and its checkpoints."""
  POSITIVE: ClassVar[tuple] = ("ckpt_every", "keep")
  PATHS: ClassVar[tuple] = ("out",)
  out: str = "runs/default"
  """Run directory: metrics.jsonl, config.json, ckpt/. An existing one is resumed (one run at a time: it is locked)."""
  amend: bool = False
  """Resume although training settings (--lr, --steps, --seed, the data, ...) differ from the checkpoint's: the run
  goes on with the new ones and config.json's `history` records the change (without it, such a resume is refused)."""
  ckpt_every: int = 100
  """Steps between checkpoints (and one at the end, or when stopped)."""
  keep: int = 3
  """Checkpoints kept (the newest)."""


@dataclasses.dataclass
class LoggingSection:
  """What is measured, logged and shown."""
  POSITIVE: ClassVar[tuple] = ("log_every", "eval_every", "eval_batches")
  RANGES: ClassVar[dict] = {"peak_flops": (0, None, False)}
  eval_every: int = 25
  """Steps between evaluations on the held-out batches (and at the last step)."""
  eval_batches: int = 8
  """Held-out batches per evaluation (the same ones every time)."""
  log_every: int = 10
  """Steps between records in metrics.jsonl and lines or bar updates on the console."""
  tracker: tyro.conf.UseAppendAction[tuple[Literal["tensorboard", "wandb", "mlflow", "none"], ...]] = ()
  """Where the metrics also go, repeatable (metrics.jsonl is always written): tensorboard (the default: event files
  in --out, `tensorboard --logdir runs`), wandb (offline unless WANDB_MODE/WANDB_API_KEY say otherwise), mlflow
  (./mlruns, or $MLFLOW_TRACKING_URI); none: metrics.jsonl only (research/train/hooks/trackers.py)."""
  peak_flops: float | None = None
  """FLOP/s that MFU is relative to (unset: the chip's datasheet peak for the compute dtype, or on a device without
  one the best matmul rate this machine has shown; see docs/train-cli.md, MFU)."""
  profile: str | None = None
  """STEP:COUNT: a jax.profiler trace of steps STEP .. STEP+COUNT-1 in <out>/profile/ (TensorBoard's profile plugin
  or XProf), and their top ops by device time printed. Step 1 compiles: start at 2 or later."""
  progress: bool = True
  """Console output: a progress bar on a terminal, plain lines otherwise (--no-progress: only the final line)."""


@dataclasses.dataclass
class HealthSection:
  """Non-finite steps and loss spikes."""
  POSITIVE: ClassVar[tuple] = ("spike_window",)
  RANGES: ClassVar[dict] = {"spike_factor": (0, None, True), "max_bad_steps": (0, None, True)}
  max_bad_steps: int = 5
  """Non-finite steps (loss, gradients or updated parameters; their updates are skipped) in a row that stop the run
  (0 = never)."""
  spike_factor: float = 1.5
  """Flag a loss above this multiple of the median of the last --spike-window losses (0 = off)."""
  spike_window: int = 100
  """Finite losses the spike detector's median looks back over."""


@dataclasses.dataclass
class RuntimeSection:
  """This machine: simulated devices, the memory limit, the compile cache."""
  RANGES: ClassVar[dict] = {"memory_limit": (0, None, True)}  # --devices: research/flags.py's
  devices: int = 8
  """Simulated devices when running on the CPU (ignored on accelerators)."""
  memory_limit: float | None = None
  """GiB the run may use per device (CPU: the whole process, host RAM): replaces the detected limit the memory
  pre-flight checks its estimate against (research/train/setup/memory.py); 0 prints the estimate and checks nothing."""
  compile_cache: bool = True
  """Keep compiled programs in ~/.cache/optlab/jax ($OPTLAB_CACHE) so reruns and resumes start fast."""


@dataclasses.dataclass
class DistributedSection:
  """Multi-process runs (JAX's distributed runtime)."""
  RANGES: ClassVar[dict] = {"peer_timeout": (0, None, False)}
  coordinator: str | None = None
  """HOST:PORT of process 0 in a multi-process run (or $JAX_COORDINATOR_ADDRESS); every process runs the same
  command with its own --process-id (see docs/reliability.md, multi-host)."""
  num_processes: int | None = None
  """Processes in a multi-process run (or $JAX_NUM_PROCESSES)."""
  process_id: int | None = None
  """This process's index, 0 .. --num-processes - 1 (or $JAX_PROCESS_ID)."""
  peer_timeout: float = 300.0
  """Multi-process runs: a process that sees no step complete for this many seconds (a peer died mid-collective)
  exits with one error line and status 4; restarting every process resumes (compilation, the first step, is not
  timed)."""
  mode: Annotated[Literal["auto", "on", "off"], tyro.conf.arg(name="distributed")] = "auto"
  """auto: start jax.distributed when a coordinator is given or SLURM/Open MPI launched several tasks; on: always,
  with JAX's cluster detection (TPU pods, Kubernetes); off: never."""
