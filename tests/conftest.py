"""8 simulated CPU devices for every test (set before JAX starts its backend), and one persistent
compilation cache for the session: runs of the same config (determinism, resume, subprocesses, the
notebook kernel, which inherit these variables) compile once."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="optlab-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
