"""--gns-every: the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish, Kaplan, Amodei et al. 2018, App. A),
the batch size in sequences past which a larger batch buys little: the step's batch is split into --gns-groups parts
(default 2; each part's rows must split over the mesh's batch axes), each part's gradient taken (one vmapped
backward), and the unbiased estimates of |G|^2 and tr(Sigma) are formed from the parts' mean squared norm (batch
B/groups) and the whole's (batch B). The host keeps an EMA of each over the measurements (--gns-ema, bias-corrected)
and their ratio.

Records: gns/g2, gns/trace (tr Sigma), gns/b_simple (this step's ratio; inf where the estimate of |G|^2 is not
positive), gns/b_simple_ema.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optim.diagnostics import noise
from research.train.observers.registry import Observer, register


def groups(section, batch: int) -> int:
  """The parts the batch is split into: --gns-groups, else 2; ValueError unless it divides the batch."""
  g = section.gns_groups or 2
  if batch % g:
    raise ValueError(f"--gns-groups {g} must divide --batch-size {batch}")
  return g


def observe(result, held, section) -> dict:
  x, y = result.probe.x, result.probe.y
  g = groups(section, x.shape[0])
  split = lambda a: a.reshape(g, a.shape[0] // g, *a.shape[1:])
  grads = jax.vmap(jax.grad(result.probe.loss_at), in_axes=(None, 0, 0))(result.params, split(x), split(y))
  small, big = noise.group_sq_norms(grads)
  g2, trace = noise.unbiased_estimates(small, big, x.shape[0] // g, x.shape[0])
  return {"g2": jnp.asarray(g2, jnp.float32), "trace": jnp.asarray(trace, jnp.float32),
          "b_simple": jnp.asarray(noise.b_simple(g2, trace), jnp.float32)}


def host(section):
  """The EMA of |G|^2 and tr(Sigma) over the measurements (bias-corrected), and their ratio."""
  state = {"s": noise.ema_init()}

  def after(values: dict) -> dict:
    state["s"], ratio = noise.ema_update(state["s"], values["g2"], values["trace"], section.gns_ema)
    return {"b_simple_ema": float(ratio)}
  return after


NOISE = register(Observer(
    "gns", frozenset({"params", "batch", "loss"}),
    "one more backward over the batch, vmapped over its parts (parts x the gradient's memory)",
    observe, every=lambda section: section.gns_every, host=host,
    check=lambda section, batch_size: groups(section, batch_size)))
