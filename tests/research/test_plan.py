"""The run's plan (research/train/setup/plan.py): resolved once where the programs are built, and the whole config
reaches only the trainer's entry points; `finetune` split into where the weights come from and what trains."""

import ast
import pathlib

from research.train import TrainConfig
from research.train.config import flat_record
from research.train.config.sections import TrainsSection, WeightsSection

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the entry points: the trainer, its flag checks, the two builders of a run (its programs, and the run around them),
# and the vmapped runner's group
ENTRY = {"research/train/loop.py:run", "research/train/setup/checks.py:check", "research/train/setup/run.py:programs",
         "research/train/setup/run.py:start", "research/train/vmapped.py:build"}


def whole_config_functions(sources: dict[str, str]) -> set[str]:
  """"path:function" for every function with a parameter annotated with `TrainConfig` (or a sequence of them), or an
  unannotated one named cfg/cfgs/config (how the trainer named the config before its annotations)."""
  found = set()
  for path, src in sources.items():
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
          note = ast.unparse(a.annotation) if a.annotation else ""
          if "TrainConfig" in note or (not note and a.arg in ("cfg", "cfgs", "config")):
            found.add(f"{path}:{getattr(node, 'name', 'lambda')}")
  return found


def test_the_whole_config_reaches_the_entry_points_only():
  """Every other part of the trainer receives the plan and its own section(s)."""
  sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "research/train").rglob("*.py"))}
  assert whole_config_functions(sources) == ENTRY
  assert len(ENTRY) <= 5


def test_the_scan_finds_a_function_that_takes_the_config():
  src = ("def a(cfg: TrainConfig): ...\ndef b(cfgs: Sequence[TrainConfig]): ...\ndef c(cfg): ...\n"
         "def d(optim: OptimSection, cfg_dir: str): ...\n")
  assert whole_config_functions({"x.py": src}) == {"x.py:a", "x.py:b", "x.py:c"}


def test_finetune_is_split_into_weights_and_what_trains_and_old_records_still_read():
  cfg = TrainConfig(init_from="runs/src", peft="lora", freeze_layers=2)
  assert isinstance(cfg.weights, WeightsSection) and isinstance(cfg.trains, TrainsSection)
  assert cfg.weights.init_from.endswith("runs/src") and (cfg.trains.peft, cfg.trains.freeze_layers) == ("lora", 2)
  # config.json of a run written before the split: its "finetune" section's flags read as flags
  old = {"optim": {"lr": 0.1}, "finetune": {"init_from": "/a", "freeze": "embed", "freeze_layers": 0,
                                            "frozen_dtype": None, "peft": "lora"}}
  flat = flat_record(old)
  assert (flat["init_from"], flat["freeze"], flat["peft"], flat["lr"]) == ("/a", "embed", "lora", 0.1)
  new = flat_record({"optim": {"lr": 0.1}, "weights": {"init_from": "/b"}, "trains": {"peft": None}})
  assert (new["init_from"], new["peft"]) == ("/b", None)


def test_sections_declare_their_run_features():
  """The clash table reads the features the sections declare (`TrainConfig.features`), not the sections' fields."""
  off = TrainConfig().features()
  assert set(off) == {"sync", "switch_at", "zero1", "freeze_layers", "peft", "freeze", "observe"}
  assert not any(off.values())
  on = TrainConfig(sync="local:4", zero1=True, peft="lora", gns_every=5).features()
  assert (on["sync"], on["zero1"], on["peft"]) == ("--sync local:4", "--zero1", "--peft")
  assert on["observe"].startswith("observers") and on["freeze"] is None
