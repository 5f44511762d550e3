"""The process the trainer runs in: simulated CPU devices, one BLAS thread, the compilation cache."""

from __future__ import annotations

import os

import jax

from research.data.cache import cache_writable, default_cache_dir


def setup_jax(devices: int, compile_cache: bool):
  try:
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:  # backend already up (a test or notebook set it): keep what is there
    pass
  one_blas_thread()
  cache_dir = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax.config: flags set at runtime
  if compile_cache and not cache_dir:  # reruns and resumes skip compilation
    root = default_cache_dir()
    if cache_writable(root):  # else one warning, no cache (JAX would warn at each program with its source path)
      jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax"))


def one_blas_thread():
  """One thread for each BLAS library loaded (numpy's and scipy's OpenBLAS, which jaxlib's CPU LAPACK kernels call):
  with several simulated devices running those kernels at once, each call's own spinning thread pool oversubscribed
  the cores (a Kron step on 8 devices ran ~10x slower: 72 vs 704 tokens/s on the tiny preset, 2 cores). XLA's own
  matmuls do not use them. The limit holds for the rest of the process (an experiment's NumPy included)."""
  import importlib

  import threadpoolctl
  importlib.import_module("scipy.linalg")  # loads scipy's OpenBLAS, so that the limit reaches it
  threadpoolctl.threadpool_limits(1, user_api="blas")
