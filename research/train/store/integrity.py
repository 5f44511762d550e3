"""Content checksums of a train state that do not depend on how it is sharded.

For an array x with n elements, its bits w_i (each element's bytes as an unsigned integer: float32 → uint32,
bfloat16 → uint16, ...; widened to 32 bits) and its flat (row-major) index i, each element is hashed once,

  h_i = fmix32(w_i ⊕ (φ·i + salt))        (fmix32: MurmurHash3's 32-bit finalizer, a bijection; φ = 0x9E3779B1)

and the two words are sums modulo 2^32:  F_1 = Σ_i h_i,  F_2 = Σ_i (2i + 1)·h_i.
Sums modulo 2^32 are exact and order-free, so F is the same for every sharding, on every mesh and process count,
and it is computed where the shards live (one pass over the state, one all-reduce of 2 words per array). A change
of one element (any of its bits: a flipped bit) changes h_i (a bijection of w_i) and nothing else, and both words
(2i + 1 is odd, so invertible modulo 2^32): it is always caught. Changes of several elements (a truncated shard read
back as zeros, another step's array in a swapped file) go unnoticed only if both sums happen to agree, with
probability about 2^-64, as the h_i look random (a plain weighted sum of the w_i would miss two flipped sign bits:
2^31 + 2^31 ≡ 0). Not a cryptographic hash: it detects accidents, not forgery.

The train loop stores `fingerprints(state)` with each checkpoint and compares them after restoring
(research/train/store/checkpoint.py): a step whose bytes changed is refused like an unreadable one.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from research.train.runtime.xla import compiler_options

SALT = 0x7F4A7C15


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


def _sums(w, index) -> jax.Array:
  """(F_1, F_2) of the words `w` at flat indices `index` (module docstring)."""
  h = _fmix32(w ^ (index * jnp.uint32(0x9E3779B1) + jnp.uint32(SALT)))
  return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(h * (index * jnp.uint32(2) + jnp.uint32(1)),
                                                          dtype=jnp.uint32)])


def _array_fingerprint(x) -> jax.Array:
  w = _words(x)
  return _sums(w, _flat_index(w.shape))


@jax.jit
def _fingerprints(leaves):
  return [_array_fingerprint(x) for x in leaves]


CHUNK = 2 ** 24  # elements per piece of a large array whose first axis is not split (XLA's temporaries: ~4 x this)


def _rows_per_chunk(x) -> int | None:
  """Rows of axis 0 per piece for a large array laid out whole along axis 0 (on one device, replicated, or split on
  other axes); None: fingerprint it in one piece."""
  if x.ndim == 0 or x.size <= CHUNK:
    return None
  sharding = getattr(x, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is not None and len(spec) and spec[0] is not None:
    return None  # a split first axis: slicing it would gather it
  row = x.size // x.shape[0]
  rows = max([d for d in range(1, x.shape[0] + 1) if x.shape[0] % d == 0 and d * row <= CHUNK], default=1)
  return rows if rows < x.shape[0] else None  # a row over CHUNK: one row at a time


def _chunked_fingerprint(x, rows: int):
  """`_array_fingerprint(x)` a piece of `rows` rows at a time (the same two sums: each element's hash and weight
  depend on its flat index only), so that XLA's temporaries are one piece's, not the array's (the 3B model's
  fingerprints took 12.8 GiB in one program; with xla.compiler_options, 96 MiB for a 1.4 GB weight stack)."""
  per = x.size // x.shape[0] * rows * (2 if jnp.dtype(x.dtype).itemsize == 8 else 1)

  def piece(k, sums):
    part = _words(lax.dynamic_slice_in_dim(x, k * rows, rows, 0))
    return sums + _sums(part, _flat_index(part.shape) + (k * per).astype(jnp.uint32))

  return lax.fori_loop(0, x.shape[0] // rows, piece, jnp.zeros(2, jnp.uint32))


@cache
def _chunked():  # jitted on first use: the options read the backend, which must not start at import
  return jax.jit(_chunked_fingerprint, static_argnums=1, compiler_options=compiler_options())


def fingerprints(tree) -> dict[str, str]:
  """{path: 16 hex digits} for every array leaf of `tree` (paths as `a/b/0`)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = ["/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
           for path, _ in flat]
  leaves = [leaf for _, leaf in flat]
  rows = [_rows_per_chunk(x) for x in leaves]
  small = _fingerprints([x for x, r in zip(leaves, rows) if r is None])
  words = [_chunked()(x, r) if r else small.pop(0) for x, r in zip(leaves, rows)]
  words = jax.device_get(words)
  return {p: "".join(f"{int(v):08x}" for v in np.asarray(w)) for p, w in zip(paths, words)}


def mismatches(saved: dict[str, str], now: dict[str, str]) -> list[str]:
  """The paths in both whose checksums differ, and those saved but now missing."""
  return sorted(p for p in saved if p in now and saved[p] != now[p]) + sorted(p for p in saved if p not in now)
