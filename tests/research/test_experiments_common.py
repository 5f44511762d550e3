"""research/experiments/common.py: the in-state phase schedule and optimizer against the CLI's (optax's schedules
through `optim.make_schedule`, `common.optimizer`), and one compiled step for every lr and length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import make_schedule
from research.experiments import common


@pytest.mark.parametrize("peak,steps,warmup", [(3e-3, 50, 5), (1e-2, 7, 0), (1e-3, 1, 0)])
def test_phase_schedule_is_make_schedule_in_float64(peak, steps, warmup):
  """Warmup, cosine and past the end, to float64 precision (the oracle's own float32 step count aside)."""
  with jax.enable_x64(True):
    t = jnp.arange(steps + 3)
    ref = jax.vmap(make_schedule("cosine", peak, steps, warmup=warmup, min_ratio=0.1))(t)
    got = jax.jit(common.phase_schedule)(t, jnp.float64(peak), jnp.float64(warmup), jnp.float64(steps))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-7, atol=1e-15)


def test_phase_schedule_is_the_cli_schedule_in_float32():
  t = jnp.arange(45)
  ours = jax.jit(common.phase_schedule)  # one program for every (peak, warmup, steps)
  for steps, warmup in ((12, 3), (9, 0), (40, 4)):
    ref = jax.jit(jax.vmap(make_schedule("cosine", 3e-3, steps, warmup=warmup, min_ratio=0.1)))
    got = ours(t, jnp.float32(3e-3), jnp.float32(warmup), jnp.float32(steps))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref(t)), rtol=1e-6, atol=1e-12)


def test_phase_optimizer_is_the_cli_optimizer_and_one_program():
  rng = np.random.default_rng(0)
  params = {"w_DF": jnp.asarray(rng.standard_normal((6, 5)), jnp.float32),
            "attn_norm": jnp.asarray(rng.standard_normal(5), jnp.float32)}
  steps = 10
  ref, ours = common.optimizer("adamw", 2e-2, steps, warmup=2), common.phase_optimizer(2e-2, steps, warmup=2)
  step_ref, step_ours = jax.jit(ref.update), jax.jit(ours.update)
  s_ref, s_ours, p_ref, p_ours = ref.init(params), ours.init(params), params, params
  for _ in range(steps + 2):  # warmup, decay and past the end; gradients big enough to be clipped
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 2, jnp.float32), params)
    u_ref, s_ref = step_ref(g, s_ref, p_ref)
    u_ours, s_ours = step_ours(g, s_ours, p_ours)
    p_ref, p_ours = jax.tree.map(jnp.add, p_ref, u_ref), jax.tree.map(jnp.add, p_ours, u_ours)
    for k in params:
      np.testing.assert_allclose(np.asarray(u_ours[k]), np.asarray(u_ref[k]), rtol=2e-5, atol=1e-9)
  other = common.phase_optimizer(1e-3, 500)  # another lr and length: the same compiled step
  text = lambda tx: jax.jit(tx.update).lower(g, tx.init(params), params).as_text()
  assert text(other) == text(ours)


def test_smoke_compiles_quickly_only_at_smoke_size_and_restores_the_flag():
  import dataclasses

  @dataclasses.dataclass
  class Cfg:
    smoke: bool

  seen = []
  main = common.smoke_compiles_quickly(lambda cfg: seen.append(jax.config.values["jax_disable_most_optimizations"]))
  before = jax.config.values["jax_disable_most_optimizations"]
  main(Cfg(smoke=True))
  main(Cfg(smoke=False))
  assert seen == [True, before] and jax.config.values["jax_disable_most_optimizations"] == before
  with pytest.raises(ZeroDivisionError):  # restored when main raises, too
    common.smoke_compiles_quickly(lambda cfg: 1 / 0)(Cfg(smoke=True))
  assert jax.config.values["jax_disable_most_optimizations"] == before


def test_partial_round_trip_belongs_to_its_config_only(tmp_path):
  import dataclasses

  @dataclasses.dataclass
  class Cfg:
    out: str
    smoke: bool = False
    lrs: tuple = (1e-3, 3e-3)

  cfg = Cfg(str(tmp_path / "out"))
  assert common.load_partial(cfg) is None  # nothing saved yet
  common.save_partial(cfg, runs={"0": {"final": np.float32(2.5)}}, chosen={"dense": 3e-3})
  assert common.load_partial(cfg) == {"runs": {"0": {"final": 2.5}}, "chosen": {"dense": 3e-3}}
  assert common.load_partial(dataclasses.replace(cfg, lrs=(1e-2,))) is None  # another config's file
  assert common.load_partial(dataclasses.replace(cfg, smoke=True)) is None  # a smoke run never resumes
  common.drop_partial(cfg)
  assert not (tmp_path / "out" / common.PARTIAL).exists() and common.load_partial(cfg) is None
  partial = tmp_path / "out" / common.PARTIAL
  damaged = [b'{"config": {"out": ', b"[1, 2]", b"\xff\xfe"]  # cut short while written (before it was replaced
  for data in damaged:  # whole), not an object, not UTF-8: each kept aside (none over another), the run starts over
    partial.write_bytes(data)
    with pytest.warns(UserWarning, match="is unreadable"):
      assert common.load_partial(cfg) is None
    assert not partial.exists()
  assert [(tmp_path / "out" / f"{common.PARTIAL}.unreadable{n}").read_bytes() for n in ("", ".1", ".2")] == damaged


def test_run_seeds_tunes_on_the_first_seed_saves_after_each_and_skips_what_a_stopped_run_finished(tmp_path):
  """The experiments' seed loop (pad_net, exfusion, moe_design, data_mixing): seed 0 runs every lr of the grid and
  picks each arm's best, later seeds run that lr only; partial.json after every seed; a rerun after a stop at seed 1
  runs seed 2 only and returns the same runs."""
  import dataclasses

  @dataclasses.dataclass
  class Cfg:
    out: str
    smoke: bool = False
    seeds: tuple = (0, 1, 2)
    lrs: tuple = (1e-3, 3e-3)

  calls = []

  def one_seed(seed, tune, chosen):
    def fit_at(lr):
      calls.append((seed, lr))
      return common.Fit(None, None, [{"step": 1, "val_loss": abs(lr - 3e-3) + seed}])
    f = common.tuned_fit("arm", fit_at, cfg.lrs, seed == cfg.seeds[0], tune, chosen)
    return {"arms": {"arm": {"final": f.final_val, "lr": chosen["arm"]}}}

  cfg = Cfg(str(tmp_path / "out"))
  whole = common.run_seeds(cfg, one_seed)
  assert calls == [(0, 1e-3), (0, 3e-3), (1, 3e-3), (2, 3e-3)] and whole.chosen == {"arm": 3e-3}
  assert whole.tune == {"arm": {1e-3: 2e-3, 3e-3: 0.0}} and sorted(whole.runs) == [0, 1, 2]
  common.drop_partial(cfg)
  calls.clear()
  stopped = dataclasses.replace(cfg, seeds=(0, 1))
  common.run_seeds(stopped, one_seed)  # a run that ended after seed 1 (same config but its seeds: a stand-in)
  saved = common.load_partial(stopped)
  common.save_partial(cfg, **saved)  # what the full config's run had saved when it stopped after seed 1
  calls.clear()
  again = common.run_seeds(cfg, one_seed)
  assert calls == [(2, 3e-3)]
  assert {s: r["arms"]["arm"]["final"] for s, r in again.runs.items()} == \
      {s: r["arms"]["arm"]["final"] for s, r in whole.runs.items()}
  smoke = dataclasses.replace(cfg, out=str(tmp_path / "smoke"), smoke=True)
  common.run_seeds(smoke, one_seed)
  assert not (tmp_path / "smoke").exists()  # a smoke run writes nothing


def test_full_results_is_the_committed_file_or_how_to_make_it():
  import pathlib
  committed = pathlib.Path(common.__file__).resolve().parents[1] / "results" / "optimizers" / "results.md"
  assert common.full_results("optimizers") == committed.read_text()
  assert common.full_results("no_such_experiment") == (
      "No full-size results yet: run `python -m research.experiments.no_such_experiment`.")


@pytest.mark.parametrize("case", ["moe_router_bias", "muonclip_max_logits"])
def test_fit_steps_as_the_trainer_does(case):
  """`fit` and the trainer's `make_steps` (one device) take the same steps: each step's loss, and after them the
  parameters (MuonClip given max_logits, with a threshold it crosses) and buffers (the MoE router-bias update)."""
  import chex
  from flax import nnx

  import models
  import optim
  from research.train import make_steps
  from research.train.steps.train_state import create
  from sharding import batch_sharding, devices_for, make_mesh

  if case == "moe_router_bias":
    c = models.preset("moe_tiny", moe=models.MoEConfig(num_experts=8, top_k=2, d_expert=32, bias_rate=1e-2))
    # eps 1e-3: with Adam's 1e-8 an entry whose gradient is ~1e-8 turns the two programs' float32 rounding into a
    # visible update difference (as in test_blockstep.py)
    make_tx, kw = lambda: common.optimizer("adamw", 3e-3, 3, eps=1e-3), {}
  else:
    c = models.preset("tiny", logit_stats=True, qk_norm=False)
    make_tx, kw = lambda: optim.get_optimizer("muonclip", 1e-2, clip_threshold=0.05), {"update_args": {"max_logits"}}
  rng = np.random.default_rng(0)
  batches = [tuple(rng.integers(0, c.vocab_size, (4, 16), dtype=np.int32) for _ in range(2)) for _ in range(3)]
  got = common.fit(models.Transformer(c, rngs=nnx.Rngs(0)), make_tx(), None, steps=3,
                   batch_fn=lambda i: batches[i], **kw)

  assert len(got.records) == 3
  mesh = make_mesh("data=1", devices=devices_for("data=1"))
  tx = make_tx()
  graphdef, state, shardings = create(lambda: models.Transformer(c, rngs=nnx.Rngs(0)), tx, mesh)
  batch_sh = batch_sharding(mesh, (4, 16))
  train, _ = make_steps(graphdef, tx, shardings, batch_sh, update_args={"max_logits"} if kw else ())
  with jax.set_mesh(mesh):
    for (x, y), rec in zip(batches, got.records):
      state, out = train(state, jax.device_put(x, batch_sh), jax.device_put(y, batch_sh))
      np.testing.assert_allclose(rec["loss"], float(out["loss"]), rtol=1e-6)
  _, params, buffers = common.split(got.model)
  chex.assert_trees_all_close(params, jax.device_get(state.params), rtol=2e-5, atol=2e-6)
  chex.assert_trees_all_close(buffers, jax.device_get(state.model_buffers), rtol=2e-5, atol=2e-6)
  if case == "moe_router_bias":
    assert any(np.any(np.asarray(b) != 0) for b in jax.tree.leaves(buffers))  # the bias moved
