"""Optimizers declare what they need from the trainer (`optim.Needs`) and the trainer acts on the declaration, never
on a name: a toy optimizer registered here, with two needs (the previous gradients and the attention-logit maxima),
trains through `research.train.run` with no edit under research/train/, and no registered optimizer's name appears in
the trainer's code."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from names import code_tokens, names_in

import optim
from optim import registry
from research.train import TrainConfig, run
from research.train.steps import update_args

RECEIVED = []  # per update: (max |prev_grads - grads|, max over the received max_logits)


def _toy(learning_rate: optax.ScalarOrSchedule, *, scale: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """SGD that reports, from inside the compiled step, what the trainer handed to it."""
  def update(updates, state, params=None, *, prev_grads, max_logits):
    gap = jnp.max(jnp.stack([jnp.max(jnp.abs(p - g)) for p, g in zip(jax.tree.leaves(prev_grads),
                                                                     jax.tree.leaves(updates))]))
    jax.debug.callback(lambda a, b: RECEIVED.append((float(a), float(b))), gap, jnp.max(max_logits))
    lr = learning_rate(state) if callable(learning_rate) else learning_rate
    return jax.tree.map(lambda g: -lr * scale * g, updates), state + 1

  return optax.GradientTransformationExtraArgs(lambda params: jnp.zeros([], jnp.int32), update)


@pytest.fixture
def toy():
  """The toy optimizer registered for one test, and removed again (the registry is global)."""
  registry.register("toy_needs", needs=optim.Needs(update_args={"prev_grads", "max_logits"}))(_toy)
  RECEIVED.clear()
  yield "toy_needs"
  registry.OPTIMIZERS.pop("toy_needs")
  registry.NEEDS.pop("toy_needs")


def test_a_new_optimizer_with_two_needs_trains_through_the_trainer(toy, tmp_path):
  records = run(TrainConfig(model="tiny", n_layers=2, qk_norm=False, optimizer=toy, lr=0.05, steps=4, batch_size=8,
                            seq_len=32, log_every=1, eval_every=4, eval_batches=1, ckpt_every=4, warmup_steps=0,
                            mesh="data=2,fsdp=2,tensor=2", progress=False, peak_flops=1.0, out=str(tmp_path)))
  assert [r["step"] for r in records] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in records)
  assert len(RECEIVED) == 4
  # prev_grads: at step 1 the previous parameters are the initial ones, so it is the gradient itself; later not
  assert RECEIVED[0][0] < 1e-6 and all(gap > 1e-4 for gap, _ in RECEIVED[1:])
  # max_logits: the model's logit statistics were switched on for it, and it received what the step logs
  assert [m for _, m in RECEIVED] == [r["attn/max_logit"] for r in records]
  assert records[-1]["val_loss"] < records[0]["loss"]  # it learns


def test_a_declared_model_refusal_is_one_line(toy, tmp_path, capsys):
  from research.train.command import main
  registry.NEEDS["toy_needs"] = optim.Needs(update_args={"max_logits"}, model_refuses=(("qk_norm", "cannot see it"),))
  with pytest.raises(SystemExit) as e:
    main(["--model", "tiny", "--qk-norm", "True", "--optimizer", toy, "--steps", "2", "--out", str(tmp_path / "r"),
          "--no-progress"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == "error: --optimizer toy_needs cannot see it: --model tiny has qk_norm; add --qk-norm False"


def test_an_update_argument_the_trainer_does_not_supply_is_one_line(toy, tmp_path, capsys):
  from research.train.command import main
  registry.NEEDS["toy_needs"] = optim.Needs(update_args={"hessian"})
  with pytest.raises(SystemExit) as e:
    main(["--model", "tiny", "--optimizer", toy, "--steps", "2", "--out", str(tmp_path / "r"), "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err == ["error: --optimizer toy_needs: update argument(s) hessian are not ones the "
                                       "trainer supplies (registered: prev_grads, max_logits)"]
  assert not (tmp_path / "r").exists()
  with pytest.raises(ValueError, match="must be keyword names"):
    optim.Needs(update_args={"not a name"})


@pytest.fixture
def token_count(toy):
  """An update argument declared in this file (the batch's token count, with a clash of its own), and an optimizer
  that takes it: no edit under research/train."""
  arg = update_args.register(update_args.UpdateArg("token_count", lambda c: jnp.sum(jnp.ones_like(c.y)),
                                                   clashes={"zero1": "counts the whole batch"}))

  def counting(learning_rate, *, scale: float = 1.0):
    def update(updates, state, params=None, *, token_count):
      jax.debug.callback(lambda n: RECEIVED.append(int(n)), token_count)
      return jax.tree.map(lambda g: -learning_rate(state) * scale * g, updates), state + 1
    return optax.GradientTransformationExtraArgs(lambda params: jnp.zeros([], jnp.int32), update)

  registry.OPTIMIZERS[toy] = counting
  registry.NEEDS[toy] = optim.Needs(update_args={arg.name})
  yield toy
  update_args.ARGS.pop(arg.name)


def test_a_new_update_argument_declared_in_a_test_file_reaches_the_optimizer(token_count, tmp_path, capsys):
  from research.train.command import main
  records = run(TrainConfig(model="tiny", optimizer=token_count, lr=0.05, steps=3, batch_size=8, seq_len=32,
                            log_every=1, eval_every=3, eval_batches=1, ckpt_every=3, warmup_steps=0,
                            mesh="data=2,fsdp=2,tensor=2", progress=False, out=str(tmp_path / "a")))
  assert [r["step"] for r in records] == [1, 2, 3] and RECEIVED == [8 * 32] * 3
  with pytest.raises(SystemExit) as e:  # its declared clash, in the one table's words
    main(["--model", "tiny", "--optimizer", token_count, "--zero1", "--steps", "2", "--out", str(tmp_path / "b"),
          "--no-progress"])
  assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
      f"error: --zero1 does not combine with --optimizer {token_count}'s update argument token_count (counts the "
      f"whole batch)")


def test_no_optimizer_name_under_the_trainer():
  assert names_in(os.path.join("research", "train"), sorted(optim.OPTIMIZERS)) == []


def test_no_update_argument_name_outside_its_declaration():
  """research/ (trainer, experiments, benches) reads the declarations; only update_args.py names the arguments."""
  assert names_in("research", sorted(update_args.ARGS), skip="research/train/steps/update_args.py") == []


def test_the_name_check_can_fail(tmp_path):
  path = tmp_path / "x.py"
  path.write_text('if cfg.optimizer == "badam":\n  tx = optax.sgd(1.0)  # badam\n')
  assert [t for _, t in code_tokens(str(path)) if re.search(r"(?<![\w.])badam(?!\w)", t)] == ['"badam"', "# badam"]


def test_needs_computed_from_a_value_out_of_range_are_one_line(tmp_path, capsys):
  """BREAD's declared needs divide by its rank: --opt rank=0 is refused by the rank's range before they are computed
  (it was a 36-line ZeroDivisionError), and nothing is written."""
  from research.train import main
  with pytest.raises(SystemExit) as e:
    main(["--optimizer", "bread", "--opt", "rank=0", "--steps", "2", "--out", str(tmp_path / "run")])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err == "error: optimizer 'bread': rank=0 must lie in [1, inf)"
  assert not (tmp_path / "run").exists()


def test_the_needs_are_computed_once_per_run(tmp_path, monkeypatch):
  """The run computes its optimizer's declared needs once, where its programs are built, and hands them to every
  part that acts on them (model settings, clashes, blockwise plan, state, steps, sync, memory pre-flight); MARS's
  exact mode, whose needs are a function of its hyperparameters, with a --switch-at layout that compiles its own
  steps."""
  from research.train.setup import build
  calls = []
  real = build.needs
  monkeypatch.setattr(build, "needs", lambda *a: calls.append(a) or real(*a))
  records = run(TrainConfig(model="tiny", optimizer="mars", opt=('mode="exact"',), steps=2, batch_size=8, seq_len=32,
                            log_every=1, eval_every=2, eval_batches=1, ckpt_every=2, warmup_steps=0, progress=False,
                            mesh="data=2,fsdp=2,tensor=2", switch_at=("1:fsdp=4,tensor=2",), out=str(tmp_path)))
  assert [r["step"] for r in records] == [1, 2] and len(calls) == 1, calls


def test_a_clash_with_an_unknown_feature_is_one_line(token_count, tmp_path, capsys, monkeypatch):
  """A declaration's typo in its clashes (a feature the clash table does not know) is said in one line."""
  from research.train.command import main
  monkeypatch.setitem(update_args.ARGS, "token_count", update_args.UpdateArg(
      "token_count", lambda c: jnp.sum(jnp.ones_like(c.y)), clashes={"zer01": "counts the whole batch"}))
  with pytest.raises(SystemExit) as e:
    main(["--model", "tiny", "--optimizer", token_count, "--steps", "2", "--out", str(tmp_path / "r"), "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err[-1].startswith(f"error: --optimizer {token_count}'s update arguments declare "
                                                  f"clashes with unknown run features zer01; the features are ")
