"""Content checksums of a train state that do not depend on how it is sharded.

For an array x with n elements, its bits w_i (each element's bytes as an unsigned integer: float32 → uint32,
bfloat16 → uint16, ...; widened to 32 bits) and its flat (row-major) index i:

  F_k(x) = Σ_i fmix32(w_i ⊕ fmix32(i ⊕ salt_k))  mod 2^32,   k = 1, 2

(fmix32: MurmurHash3's 32-bit finalizer, a bijection of the 32-bit integers). A sum of integers modulo 2^32 is
exact and order-free, so F is the same for every sharding, on every mesh and process count, and it is computed
where the shards live (one pass over the state, one all-reduce of 2 words per array). A change of one element (any
of its bits: a flipped bit) changes that element's term, since fmix32 is a bijection, and no other term: it is
always caught, by both words. Changes of several elements (a truncated shard read back as zeros, another step's
array in a swapped file) go unnoticed only if both sums happen to agree, with probability about 2^-64 (a plain
weighted sum Σ w_i·m(i) would miss two flipped sign bits: 2^31 + 2^31 ≡ 0). Not a cryptographic hash: it detects
accidents, not forgery.

The train loop stores `fingerprints(state)` with each checkpoint and compares them after restoring
(research/checkpoint.py): a step whose bytes changed is refused like an unreadable one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SALTS = (0x9E3779B9, 0x7F4A7C15)


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x) -> jax.Array:
  """Each element's bits as uint32 (8-byte elements as two words along a new last axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
  return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape) -> jax.Array:
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


def _array_fingerprint(x) -> jax.Array:
  w = _words(x)
  index = _flat_index(w.shape)
  return jnp.stack([jnp.sum(_fmix32(w ^ _fmix32(index ^ jnp.uint32(salt))), dtype=jnp.uint32) for salt in SALTS])


@jax.jit
def _fingerprints(leaves):
  return [_array_fingerprint(x) for x in leaves]


def fingerprints(tree) -> dict[str, str]:
  """{path: 16 hex digits} for every array leaf of `tree` (paths as `a/b/0`)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = ["/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
           for path, _ in flat]
  words = jax.device_get(_fingerprints([leaf for _, leaf in flat]))
  return {p: "".join(f"{int(v):08x}" for v in np.asarray(w)) for p, w in zip(paths, words)}


def mismatches(saved: dict[str, str], now: dict[str, str]) -> list[str]:
  """The paths in both whose checksums differ, and those saved but now missing."""
  return sorted(p for p in saved if p in now and saved[p] != now[p]) + sorted(p for p in saved if p not in now)
