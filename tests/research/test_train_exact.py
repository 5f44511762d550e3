"""The train loop's exact variance-reduction mode (MARS mode=exact, Muon-MVR mode=mvr2): the state keeps the
previous parameters, each step differentiates the loss at them on the current batch and hands that gradient
(clipped by its own global norm) to the optimizer as `prev_grads`; it trains, differs from the approximate mode
exactly from the step where the two g̃ first differ, and resumes exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from runs import trace

import optim
import sharding
from models import Transformer, preset
from research.data import get_batch, load_corpus
from research.train import TrainConfig, make_steps, run
from research.train.steps import train_state
from research.train.steps.step import keep_prev_params

SMALL = dict(model="tiny", n_layers=1, steps=6, batch_size=8, seq_len=32, log_every=1, eval_every=3, ckpt_every=3,
             warmup_steps=1, eval_batches=1, progress=False, mesh="data=2,fsdp=2,tensor=2", peak_flops=1.0,
             optimizer="mars", lr=1e-2)


def cfg(out, **kw):
  return TrainConfig(out=str(out), **{**SMALL, **kw})


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("exact")
  return out, run(cfg(out, opt=("mode=exact",)))


def test_exact_mode_trains_and_resumes_exactly(exact_run, tmp_path):
  _, ref = exact_run
  assert [r["step"] for r in ref] == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in ref)
  assert ref[-1]["val_loss"] < ref[0]["loss"]  # it learns
  first = run(cfg(tmp_path, opt=("mode=exact",), stop_at=3))
  assert [r["step"] for r in first] == [1, 2, 3]
  assert trace(run(cfg(tmp_path, opt=("mode=exact",)))) == trace(ref)  # prev_params came back from the checkpoint


def test_prev_grads_are_the_previous_params_on_the_current_batch():
  """make_steps with a spy optimizer (SGD that keeps what it receives in its state): at the second step the extra
  argument is ∇f(x_0, ξ_1) clipped by its own global norm — what the current gradient is for a run that starts its
  first step on ξ_1 — not the approximate mode's ∇f(x_0, ξ_0), and the kept parameters are x_1."""
  mcfg = preset("tiny", n_layers=1)
  mesh = sharding.make_mesh("data=1", devices=jax.devices()[:1])
  lr, clip = 0.5, 0.3

  def spy_update(updates, state, params=None, *, prev_grads):
    return jax.tree.map(lambda g: -lr * g, updates), {"g": updates, "prev": prev_grads}

  spy = optax.GradientTransformationExtraArgs(lambda p: {"g": p, "prev": p}, spy_update)
  tx = optim.with_global_norm_clip(spy, clip)
  graphdef, state, shardings = train_state.create(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)), tx, mesh)
  state, shardings = keep_prev_params(state, shardings)
  train_step, _ = make_steps(graphdef, tx, shardings, sharding.batch_sharding(mesh, (4, 16)),
                             update_args={"prev_grads"})
  corpus = load_corpus(None)
  xi = [get_batch(corpus.train, 0, s, 4, 16) for s in range(2)]
  host = lambda t: jax.tree.map(np.asarray, t)
  with jax.set_mesh(mesh):
    x0 = host(state.params)
    other, _ = train_step(jax.jit(lambda t: jax.tree.map(jnp.copy, t))(state), *xi[1])  # from x_0 on ξ_1
    state, _ = train_step(state, *xi[0])
    stale, x1 = host(state.opt_state[1]["g"]), host(state.params)  # clip(∇f(x_0, ξ_0)), x_1
    state, _ = train_step(state, *xi[1])
  want, got = host(other.opt_state[1]["g"]), host(state.opt_state[1]["prev"])  # want: clip(∇f(x_0, ξ_1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), got, want)
  norm = lambda t: np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in jax.tree.leaves(t)))
  assert norm(got) == pytest.approx(clip, rel=1e-5)  # the clip was active
  assert norm(jax.tree.map(np.subtract, got, stale)) > 0.1 * clip
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state.prev_params, x1)
  jax.tree.map(lambda a, b, g: np.testing.assert_allclose(a, b - lr * g, rtol=1e-6, atol=1e-7), x1, x0, stale)
