"""8 simulated CPU devices for every test (set before JAX starts its backend)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
