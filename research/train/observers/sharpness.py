"""--sharpness-every: the loss's curvature on a fixed held batch (the first held-out batch, its first
--sharpness-rows rows), at the parameters the step's gradients were taken at, by Hessian-vector products:

  lambda_max       the Hessian's top eigenvalue (--sharpness-iters power iterations; compared with 2/lr, the edge of
                   stability of gradient descent, Cohen et al. 2021)
  ritz             with --lanczos K, the top Ritz values of K Lanczos iterations (the top eigenvalues)
  update_curvature u^T H u / u^T u of the step's update u: the curvature along the step
  overlap          (v^T u)^2 / (|v|^2 |u|^2), v the top eigenvector: how much of the step lies along the sharpest
                   direction (Gur-Ari, Roberts & Dyer 2018)
  interpolation    the held batch's loss at params + alpha * u for alpha in `ALPHAS` (alpha = 1: the step taken)

The loss is the one the step differentiates (cross entropy + an MoE's weighted aux losses), over the trained tree
(the active layer's master in the blockwise step).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from optim.diagnostics import sharpness
from research.train.observers.registry import Observer, register
from sharding.rules import logical_to_spec

ALPHAS = (0.0, 0.5, 1.0, 1.5, 2.0)
ROWS = 4  # --sharpness-rows unset: one measurement costs ~8.5 plain steps of the default run, not ~26 with all 16 rows
# (research/results/diagnostics/results.md): every 200 steps or rarer stays under 5%


def default_rows(batch: int) -> int:
  """`ROWS`, rounded up to a multiple of the mesh's batch split (data × fsdp × expert: the rows must divide over it,
  as the batch's do), at most the batch; read from the mesh the step is traced under."""
  mesh = jax.sharding.get_abstract_mesh()
  spec = logical_to_spec(("batch",), mesh) if mesh is not None and mesh.shape else ()
  axes = (spec[0],) if spec and isinstance(spec[0], str) else tuple(spec[0] or ()) if spec else ()
  split = math.prod(mesh.shape[a] for a in axes) if axes else 1
  return min(batch, split * -(-ROWS // split))


def check(section, batch_size: int) -> None:
  """--sharpness-rows must fit the held batch (--batch-size rows)."""
  if section.sharpness_rows and section.sharpness_rows > batch_size:
    raise ValueError(f"--sharpness-rows {section.sharpness_rows} exceeds the held batch's --batch-size {batch_size}")


def observe(result, held, section) -> dict:
  hx, hy = held
  rows = section.sharpness_rows or default_rows(hx.shape[0])
  hx, hy = hx[:rows], hy[:rows]
  loss = lambda p: result.probe.loss_at(p, hx, hy)
  params, u = result.params, result.updates
  # unrolled: a loop around the products' collectives deadlocked XLA:CPU's simulated devices inside the step
  lam, v = sharpness.top_eigenvalue(loss, params, iters=section.sharpness_iters, key=jax.random.key(0), unroll=True)
  out = {"lambda_max": lam, "update_curvature": sharpness.directional_curvature(loss, params, u),
         "overlap": sharpness.overlap(v, u),
         "interpolation": sharpness.interpolate(loss, params, u, ALPHAS, unroll=True)}
  if section.lanczos:
    out["ritz"] = sharpness.lanczos(loss, params, iters=section.lanczos, key=jax.random.key(1), unroll=True)[:3]
  return {k: jnp.asarray(x, jnp.float32) for k, x in out.items()}


SHARPNESS = register(Observer(
    "sharpness", frozenset({"params", "updates", "loss", "held"}),
    "--sharpness-iters + 1 Hessian-vector products (each ~2 backward passes) and 5 forwards on the held rows; "
    "--lanczos K adds K products and K parameter copies",
    observe, every=lambda section: section.sharpness_every, check=check))
