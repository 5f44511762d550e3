"""research.train.store.checkpoint.Checkpointer on states the train CLI's tests do not reach by themselves."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from research.train.store.checkpoint import Checkpointer


def test_zero_size_arrays_round_trip_with_their_shape_dtype_and_sharding(tmp_path):
  """Optimizer states hold zero-size placeholders (SOAP's (0,) basis for a side it does not rotate, Kron's q_r of a
  vector); orbax refuses to save a zero-size array ("Cannot save arrays with zero size"), and the CLI's final save
  failed on them. They are left out of the files and rebuilt from the abstract state on restore."""
  mesh = sharding.make_mesh("data=2,fsdp=4")
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  state = {"w": put(jnp.arange(16.0).reshape(8, 2), "fsdp", None),
           "basis": (put(jnp.zeros((0,), jnp.float32)), put(jnp.ones((2, 3), jnp.bfloat16))),
           "q_r": put(jnp.zeros((4, 0), jnp.int32), "fsdp", None), "count": put(jnp.int32(7))}
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  assert ckpt.save(1, state, {"step": 1}, force=True)
  ckpt.close()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  got = Checkpointer(str(tmp_path / "ckpt")).restore(1, abstract, shardings)
  assert jax.tree.structure(got) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
    assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

