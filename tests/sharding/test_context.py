"""Context parallelism (sharding/context.py): the zig-zag layout and its balance, ring and all-gather attention equal
to the reference in value and gradients, their collectives counted against the analytic bytes, and no collective in a
loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from sharding import context as cx

B, T, N, K, H = 2, 64, 4, 2, 16  # GQA: two query heads per kv head


@pytest.fixture(scope="module")
def qkv():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  return tuple(jax.random.normal(k, (B, T, n, H)) for k, n in zip(keys, (N, K, K)))


def reference(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def objective(attn):
  """A scalar whose gradient reaches every output element with a different weight."""
  return lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)) * jnp.arange(1, H + 1))


def in_context_order(algorithm, C, block=cx.BLOCK):
  """Attention on sequences given in position order, computed in the zig-zag layout over `context`."""
  def attn(q, k, v):
    z = lambda x: cx.to_zigzag(x, C)
    return cx.from_zigzag(cx.context_attention(z(q), z(k), z(v), algorithm=algorithm, block=block), C)
  return attn


@pytest.mark.parametrize("C", [1, 2, 4, 8])
def test_zigzag_layout_is_a_permutation_that_round_trips(C):
  pos = cx.zigzag_positions(T, C)
  assert sorted(pos) == list(range(T))
  h = T // (2 * C)
  for c in range(C):  # device c: chunks c and 2C-1-c
    np.testing.assert_array_equal(pos[2 * h * c:2 * h * (c + 1)],
                                  np.r_[c * h:(c + 1) * h, (2 * C - 1 - c) * h:(2 * C - c) * h])
  x = np.random.default_rng(0).integers(0, 1000, size=(3, T, 5))
  np.testing.assert_array_equal(cx.to_zigzag(x, C), x[:, pos])
  np.testing.assert_array_equal(cx.from_zigzag(cx.to_zigzag(x, C), C), x)
  np.testing.assert_array_equal(cx.to_zigzag(x.swapaxes(0, 1), C, axis=0), x[:, pos].swapaxes(0, 1))


@pytest.mark.parametrize("seq, C", [(64, 2), (64, 4), (1024, 8)])
def test_zigzag_balances_the_causal_work_that_a_contiguous_split_does_not(seq, C):
  b = cx.balance(seq, C)
  # positions p see p + 1 keys: device c of a contiguous split owns rows cT/C .. (c+1)T/C - 1
  n = seq // C
  assert b["contiguous"] == [sum(p + 1 for p in range(c * n, (c + 1) * n)) for c in range(C)]
  assert len(set(b["zigzag"])) == 1 and sum(b["zigzag"]) == seq * (seq + 1) // 2
  assert b["zigzag_max_over_mean"] == 1.0
  assert b["contiguous_max_over_mean"] == pytest.approx((2 * C - 1) / C, rel=2e-2)  # the last device: (2C-1)/C²
  # the kernel computes three of its own block's four h x h pairs (h^2 + h(h+1) of their pairs causal) and exactly
  # the needed half of every other device's block: h^2 - h pairs more than the mask keeps, on every device
  h = seq // (2 * C)
  assert [w - z for w, z in zip(b["zigzag_computed"], b["zigzag"])] == [h * h - h] * C


@pytest.mark.parametrize("spec, algorithm, block", [  # block 8: each device's 2·8 chunk positions in 8-tiles
    ("context=8", "ring", cx.BLOCK), ("context=8", "allgather", cx.BLOCK), ("context=2,tensor=2,data=2", "ring", 8),
    ("context=4,fsdp=2", "allgather", 4)])
def test_context_attention_equals_the_reference_in_value_and_gradient(qkv, spec, algorithm, block):
  mesh = sharding.make_mesh(spec)
  attn = in_context_order(algorithm, mesh.shape["context"], block)
  with jax.set_mesh(mesh):
    out = jax.jit(attn)(*qkv)
    grads = jax.jit(jax.grad(objective(attn), argnums=(0, 1, 2)))(*qkv)
  np.testing.assert_allclose(out, reference(*qkv), atol=2e-6)
  for g, r in zip(grads, jax.grad(objective(reference), argnums=(0, 1, 2))(*qkv)):
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


def attention_collectives(algorithm, C, grad):
  """The collectives of the attention alone (forward, or forward and backward) on context=C, by kind."""
  mesh = sharding.make_mesh(f"context={C}", devices=jax.devices()[:C])
  shapes = [jax.ShapeDtypeStruct((B, T, n, H), jnp.float32) for n in (N, K, K)]

  def fwd(q, k, v):
    return cx.context_attention(q, k, v, algorithm=algorithm)
  fn = jax.grad(objective(fwd), argnums=(0, 1, 2)) if grad else fwd
  with jax.set_mesh(mesh):
    audit = sharding.collectives(jax.jit(fn).lower(*shapes).compile())
  assert not any(op.in_loop for op in audit.ops)  # the steps are unrolled: no collective in a while body
  kinds = {}
  for op in audit.ops:
    kinds[op.kind] = kinds.get(op.kind, 0) + op.operand_bytes * op.count
  return kinds


@pytest.mark.parametrize("C", [2, 4])
def test_ring_sends_each_kv_block_around_once_per_pass(C):
  block = B * (T // C) * K * H * 4  # one device's K (or V) block, float32
  # forward: C-1 hops of K and of V
  assert attention_collectives("ring", C, grad=False) == {"collective-permute": 2 * (C - 1) * block}
  # with the backward: the backward's ring of K and V is the forward's (XLA merges the identical hops, since the
  # recomputation needs the same blocks), plus the float32 dK, dV travelling C hops home
  assert attention_collectives("ring", C, grad=True) == {"collective-permute": (2 * (C - 1) + 2 * C) * block}


@pytest.mark.parametrize("C", [2, 4])
def test_allgather_gathers_kv_once_and_reduce_scatters_their_gradients(C):
  block = B * (T // C) * K * H * 4
  assert attention_collectives("allgather", C, grad=False) == {"all-gather": 2 * block}  # operand: the local block
  # the backward's gather is the forward's (merged); dK and dV are reduce-scattered from whole-sequence float32 buffers
  assert attention_collectives("allgather", C, grad=True) == {"all-gather": 2 * block, "reduce-scatter": 2 * C * block}


def test_bad_input_names_the_fix():
  with pytest.raises(cx.ContextError, match="seq_len=60 does not split into the 2\\*context=16 zig-zag chunks"):
    cx.check_context(60, 8)
  cx.check_context(60, 1)
  with pytest.raises(cx.ContextError, match="seq_len=96 gives zig-zag chunks of 24 positions, which the attention's "
                                            "tiles of 16 do not divide; use a seq_len that is a multiple of 64"):
    cx.check_context(96, 2, block=16)
  with pytest.raises(cx.ContextError, match="unknown context-parallel attention 'striped'; choose one of ring"):
    cx.context_attention(*[jnp.zeros((1, 8, 2, 4))] * 3, algorithm="striped")
  mesh = sharding.make_mesh("context=8")
  with jax.set_mesh(mesh), pytest.raises(cx.ContextError, match="seq_len=24 does not split"):
    jax.jit(lambda x: cx.context_attention(x, x, x))(jnp.zeros((1, 24, 2, 4)))
