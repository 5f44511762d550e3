"""The Muon-style hybrids' AdamW group is one `AdamGroup` (optim/adam_group.py): each hybrid takes its settings as
the flat adam_* keyword arguments (what the registry, --opt and optax.inject_hyperparams read) or whole as `adam=`,
and both give the same optimizer as optax.adamw on the group's leaves."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from optim.adam_group import KWARGS, AdamGroup

HYBRIDS = ("muon", "normuon", "adamuon", "cautious_muon", "mgup_muon", "muon_mvr", "dion")


@pytest.mark.parametrize("name", HYBRIDS)
def test_every_hybrid_shows_the_flat_keyword_arguments(name):
  params = inspect.signature(optim.OPTIMIZERS[name]).parameters
  assert "adam" not in params
  assert [(n, optim.registry.schema(name)[n], params[n].default) for n, _, _ in KWARGS] == [
      ("adam_learning_rate", ("optax.ScalarOrSchedule | None", "factory"), None),
      ("adam_b1", ("float", (0, 1, False)), 0.9), ("adam_b2", ("float", (0, 1, False)), 0.95),
      ("adam_eps", ("float", (0, None, False)), 1e-8), ("adam_weight_decay", ("float | None", (0, None, False)), None)]
  with pytest.raises(optim.UnknownOptimizerError, match=r"adam_learning_rate=-0.1 must lie in \[0, inf\)"):
    optim.get_optimizer(name, 0.1, adam_learning_rate=-0.1)  # the AdamGroup field's declared range, on a number


def test_flat_and_whole_give_the_group_optax_adamw_would():
  params = {"embed": jnp.ones((8, 4)), "norm": jnp.ones((4,))}  # both AdamW leaves under muon_labels
  grads = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape)), params)
  flat = optim.muon(0.1, adam_learning_rate=0.02, adam_b1=0.8, adam_eps=1e-6, adam_weight_decay=0.3)
  whole = optim.muon(0.1, adam=AdamGroup(learning_rate=0.02, b1=0.8, eps=1e-6, weight_decay=0.3))
  ref = optax.adamw(0.02, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3, mask=optim.decay_mask)
  updates = [tx.update(grads, tx.init(params), params)[0] for tx in (flat, whole, ref)]
  for u in updates[1:]:
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), updates[0], u)
  with pytest.raises(TypeError, match="not both"):
    optim.muon(0.1, adam=AdamGroup(), adam_b1=0.8)


def test_inject_hyperparams_reads_the_flat_arguments():
  tx = optax.inject_hyperparams(optim.muon, static_args=("ns_steps",))(learning_rate=0.1, adam_b1=0.7)
  state = tx.init({"w": jnp.ones((4, 4)), "b": jnp.ones((4,))})
  assert float(state.hyperparams["adam_b1"]) == pytest.approx(0.7)
