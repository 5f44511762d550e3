"""LAPACK-backed decompositions (QR, Cholesky, eigh, triangular solves) of a stack, one matrix at a time on the CPU.

This is the way around a deadlock of jaxlib 0.10's CPU kernels in multi-device programs.

jaxlib 0.10's LAPACK kernels (`jaxlib/cpu/lapack_kernels.cc`, `ParallelBatchMap`) split a batch of matrices whose
estimated cost passes a threshold into pieces on XLA:CPU's intra-op thread pool, and the pool thread that runs the
kernel then blocks until the pieces are done, running none itself. A train step on 8 simulated devices has such a
kernel ready on every device at once (an optimizer's QR, eigh or triangular solve of a stack of layers, after the
same all-gather): every pool thread then waits on pieces queued behind the others and the step hangs for good, using
no CPU (gdb: all `tf_XLAEigen` threads in `BlockingCounter::Wait` under `lapack_sgeqrf_ffi`, Dion on the tiny preset
and data=2,fsdp=4; `lapack_ssyevd_ffi` for SOAP, `lapack_strsm_ffi` for Kron). No collective is involved, so the
audit of collectives (`sharding.collectives`) cannot see it. A batch of one runs inline on the calling thread: mapping
over the stack (`lax.map`, one loop, one matrix per kernel call) cannot block. pyproject pins jax < 0.11.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from optim.trees import replicated


def map_stack(fn: Callable[..., Any], stack: tuple[int, ...], *trees: Any, lapack: bool = True) -> Any:
  """Fn on every element of a stack, one element at a time where it calls LAPACK on the CPU, else batched.

  Each leaf of `trees` is (*stack, ...), fn takes one element's leaves and returns arrays, the result has the stack's
  leading axes. For an fn that calls LAPACK (a triangular solve, a QR) on its element, where the default backend is
  the CPU: one element at a time (`lax.map` over the flattened stack, its operands first made whole on every device:
  `optim.trees.replicated`), so every call gets a batch of one (module docstring); elsewhere, and for an fn without
  LAPACK calls (`lapack=False`), batched (`vmap`).

  On a mesh, whole operands keep the loop body free of collectives (one would run once per element, and XLA:CPU's
  simulated devices can deadlock on a collective in a loop); a LAPACK kernel needs whole matrices anyway (the
  partitioner gathers a custom call's operands).

  Args:
    fn: a function of one element's leaves (one argument per tree) returning a pytree of arrays.
    stack: the leading (stack) axes that every leaf of `trees` shares.
    *trees: pytrees whose leaves are (*stack, ...).
    lapack: whether fn calls LAPACK (then one element at a time on the CPU); False: always batched.

  Returns:
    fn's outputs for every element, each leaf with the stack's leading axes.
  """
  size = math.prod(stack)
  flat = lambda tree: jax.tree.map(lambda x: x.reshape((size,) + x.shape[len(stack):]), tree)
  if lapack and size > 1 and jax.default_backend() == "cpu":
    out = jax.lax.map(lambda args: fn(*args), flat(jax.tree.map(replicated, trees)))
  else:
    out = jax.vmap(fn)(*flat(trees))
  return jax.tree.map(lambda y: y.reshape(stack + y.shape[1:]), out)


def per_matrix(fn: Callable[..., Any], *xs: jax.Array) -> Any:
  """fn(*xs) for stacks of matrices xs, one matrix at a time where the default backend is the CPU.

  xs are (*stack, a, b) (the same stack), fn a LAPACK-backed function such as `jnp.linalg.qr`: one matrix at a time
  where the default backend is the CPU (`map_stack`), fn(*xs) itself elsewhere and for a single matrix. Each matrix's
  result is the same either way (the kernel runs the same routine on it).

  Args:
    fn: a LAPACK-backed function of matrices that also takes stacks of them.
    *xs: stacks of matrices with the same leading (stack) axes.

  Returns:
    fn(*xs): fn's outputs with the stack's leading axes.
  """
  stack = xs[0].shape[:-2]
  if math.prod(stack) <= 1 or jax.default_backend() != "cpu":
    return fn(*xs)
  return map_stack(fn, stack, *xs)
