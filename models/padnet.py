"""PAD-Net: a Mixture-of-Experts FFN whose expert weights are partitioned into dynamic and static entries.

He, Ding, Dong et al., ACL 2023, arXiv 2211.05528; code Shwai-He/PAD-Net. Dynamic entries are per expert, static ones
shared by the experts.

Shapes: E experts, D d_model, F expert width; a block stack adds leading layer axes (L, ...).
For each of the three SwiGLU matrices (gate, up, down) of expert e:
  W_e = λ_d · M_e ⊙ W_e^dyn + λ_s · (1 − M_e) ⊙ W^static,   λ_d = 2σ(φ), λ_s = 2 − λ_d
M_e a 0/1 mask per entry (`PadMask`, a buffer: never seen by the optimizer), W^static one matrix shared by every
expert, φ one learnable scalar per layer, 0 at initialisation (λ_d = λ_s = 1; the code's `PadMoE.phi`). With M all
ones and φ = 0 the layer is the plain MoE exactly (λ_d = 1 and the static term is 0·W^static).

Iterative Mode Partition (IMP, the paper's §3.2; the code's `moe/transformers/pruning/prune.py::prune_loop` with the
SNIP scorer): T rounds; in round t = 1..T every entry is scored by |∂L/∂M| summed over the scoring batches (the
gradient is summed, then its magnitude taken, as the code does) and ranked, over all PAD-Net matrices of the model
together ("global", the code's default `mask_scope`, `_global_mask`) or per expert matrix ("local", its `_local_mask`:
each expert's matrix is its own parameter there). Round t's dynamic share is
  exponential: d_t = r^{t/T}        linear: d_t = 1 − (1 − r)·(t/T)        (r the final dynamic ratio)
and a ranking of n entries keeps the `kept(n, d_t)` = n − int((1 − d_t)·n) highest scores dynamic, the rest static
(the code's count, `pruning/pruners.py`: it makes the k = int((1 − d)·n) lowest static, in Python floats with int()
truncating; n = 10, d = 0.72 keeps 8 where round(d·n) would keep 7). When k = 0 the ranking's masks are left as they
are (the code's `if not k < 1`). Ties: exactly `kept` entries stay dynamic, among equal scores the earlier in the
ranking's flattened order first; the code's `score <= threshold` makes every entry tied with the k-th lowest score
static, keeping fewer when that score is tied (|∂L/∂M| of float32 gradients rarely is). The code partitions
once, at the start of fine-tuning (`trainer_pad.py`, epoch 0), on a random subset of the training data. Every entry
is re-ranked each round: a static entry's mask gradient is defined too,
  ∂L/∂M_e = (λ_d W_e^dyn − λ_s W^static) ⊙ ∂L/∂W_e,
the first-order loss change of switching the entry's mode, so an entry may turn dynamic again (the code does not set
the scores of static entries to −inf either). No training happens between rounds (as in `prune_loop`).

Choices of ours, stated: 5 rounds by default (the code's `prune_epochs` defaults to 1); masks are per expert entry
(the code's `PadMoE` keeps one (out, in) mask buffer per layer that its `SingleExpert_Pad` takes as an argument); φ
is one scalar per layer shared by the three matrices; the static weights of a converted MoE (models/surgery.py
`to_padnet`) start at the experts' mean, which is the dense FFN for experts copied from it. The mask buffers are
replicated on every device like the other buffers (bool: a quarter of a float32 expert stack).

References:
  He, Ding, Dong, Liu, Yu, Tao, "PAD-Net: An Efficient Framework for Dynamic Networks", ACL 2023, arXiv 2211.05528
  (code Shwai-He/PAD-Net: `PadMoE`, `moe/transformers/pruning/prune.py::prune_loop`, `pruners.py::_global_mask`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.params import param

MATRICES = {"gate": "w_gate_EDF", "up": "w_up_EDF", "down": "w_down_EFD"}  # the MoE's expert stacks
STATIC = {"gate": "static_gate_DF", "up": "static_up_DF", "down": "static_down_FD"}
MASKS = {"gate": "mask_gate_EDF", "up": "mask_up_EDF", "down": "mask_down_EFD"}
SCHEDULES = ("exponential", "linear")
SCOPES = ("local", "global")


class PadNetError(ValueError):
  """An argument PAD-Net cannot use."""


class PadMask(nnx.Variable):
  """PAD-Net's mode mask: True where an expert's entry is dynamic (its own), False where it takes the static weight."""


def add_parameters(moe: nnx.Module, rngs: nnx.Rngs, D: int, E: int, F: int, std: float, out_std: float,
                   dtype: jax.typing.DTypeLike):
  """Adds PAD-Net's parameters to an MoE module, in place: with them it is still the plain MoE.

  The static weights are initialised like the experts, the masks all dynamic (ones) and φ = 0 (λ_d = λ_s = 1).

  Args:
    moe: the MoE module (models/moe.py's `MoE`).
    rngs: the static weights' random streams.
    D: d_model.
    E: the number of experts.
    F: the expert width.
    std: the initial std of the gate and up matrices.
    out_std: the initial std of the down matrix.
    dtype: the parameters' dtype.
  """
  # nnx.Module's type declares no attributes: the MoE gains these here
  moe.static_gate_DF = param(rngs, (D, F), ("embed", "mlp"), std, dtype)  # type: ignore[attr-defined]
  moe.static_up_DF = param(rngs, (D, F), ("embed", "mlp"), std, dtype)  # type: ignore[attr-defined]
  moe.static_down_FD = param(rngs, (F, D), ("mlp", "embed"), out_std, dtype)  # type: ignore[attr-defined]
  moe.pad_phi = param(rngs, (), (), None, dtype)  # type: ignore[attr-defined]  # zeros: λ_d = λ_s = 1
  for name, shape in (("mask_gate_EDF", (E, D, F)), ("mask_up_EDF", (E, D, F)), ("mask_down_EFD", (E, F, D))):
    setattr(moe, name, PadMask(jnp.ones(shape, jnp.bool_), out_sharding=(None, None, None), eager_sharding=False))


def scales(phi: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(λ_d, λ_s) = (2σ(φ), 2 − 2σ(φ)).

  Args:
    phi: φ, any shape.

  Returns:
    (λ_d, λ_s), each shaped like φ; they sum to 2.
  """
  dynamic = 2 * jax.nn.sigmoid(phi)
  return dynamic, 2 - dynamic


def mix(w_EIO: jax.Array, static_IO: jax.Array, mask_EIO: jax.Array, phi: jax.Array) -> jax.Array:
  """The effective expert weights λ_d·M⊙W + λ_s·(1 − M)⊙W^static, in the weights' dtype.

  Leading layer axes are allowed on every argument.

  Args:
    w_EIO: the experts' dynamic weights (..., E, I, O).
    static_IO: the static weight shared by the experts (..., I, O).
    mask_EIO: M (..., E, I, O), bool or float (a float mask, as IMP differentiates it, works too).
    phi: φ (...).

  Returns:
    (..., E, I, O).
  """
  dynamic, static = scales(jnp.asarray(phi, w_EIO.dtype)[..., None, None, None])
  m = mask_EIO.astype(w_EIO.dtype)
  return dynamic * m * w_EIO + static * (1 - m) * static_IO[..., None, :, :].astype(w_EIO.dtype)


def expert_weights(moe: nnx.Module) -> dict[str, jax.Array]:
  """The effective expert stacks of a PAD-Net MoE module (`mix` of each matrix).

  Args:
    moe: an MoE module with PAD-Net's parameters (`add_parameters`).

  Returns:
    {"gate", "up", "down": (..., E, I, O)}.
  """
  phi = moe.pad_phi[...]  # type: ignore[attr-defined]  # added by add_parameters, unknown to nnx.Module's type
  return {k: mix(getattr(moe, MATRICES[k])[...], getattr(moe, STATIC[k])[...], getattr(moe, MASKS[k])[...], phi)
          for k in MATRICES}


def _masks(model: nnx.Module) -> list[np.ndarray]:
  masks = [np.asarray(m) for m in jax.tree.leaves(nnx.state(model, PadMask))]
  if not masks:
    raise PadNetError("the model has no PAD-Net layer (build it with moe.pad=True or models.surgery.to_padnet)")
  return masks


def dynamic_share(model: nnx.Module) -> float:
  """The dynamic entries' share of all PAD-Net expert entries of `model`.

  Args:
    model: a model with PAD-Net layers.

  Returns:
    The share in [0, 1] (1.0 before any partition).
  """
  masks = _masks(model)
  return float(sum(m.sum() for m in masks) / sum(m.size for m in masks))


def counts(model: nnx.Module) -> dict[str, int]:
  """The PAD-Net entries of `model` by mode.

  Args:
    model: a model with PAD-Net layers.

  Returns:
    {"dynamic": expert entries that are dynamic, "masked": expert entries that are static (their own value unused),
    "static": the shared static weights' entries}.
  """
  masks = _masks(model)
  static = sum(int(np.prod(v.shape)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if str(p[-1]) in STATIC.values())
  dynamic = int(sum(m.sum() for m in masks))
  return {"dynamic": dynamic, "masked": int(sum(m.size for m in masks)) - dynamic, "static": static}


def share_at(round_: int, rounds: int, ratio: float, schedule: str) -> float:
  """The dynamic share after an IMP round.

  exponential: r^{t/T}; linear: 1 − (1 − r)·t/T.

  Args:
    round_: t, the round (1..rounds).
    rounds: T.
    ratio: r, the final dynamic share.
    schedule: "exponential", else linear.

  Returns:
    The share after round t (`ratio` after the last).
  """
  if schedule == "exponential":
    return ratio ** (round_ / rounds)
  return 1.0 - (1.0 - ratio) * (round_ / rounds)  # the code's grouping: the float, hence `kept`, is the same


def kept(n: int, share: float) -> int:
  """The entries a ranking of `n` keeps dynamic at the dynamic share `share`: n − int((1 − share)·n).

  The code's count (`_global_mask` / `_local_mask` make the k = int((1 − share)·n) lowest scores static), in Python
  float arithmetic with int() truncating, so it may keep one more than round(share·n) (n = 10, share = 0.72: 8).

  Args:
    n: the entries ranked together.
    share: the round's dynamic share, in (0, 1].

  Returns:
    The dynamic entries, in [0, n].
  """
  return n - int((1.0 - share) * n)


def _keep_top(scores: list[np.ndarray], masks: list[np.ndarray], share: float, scope: str,
              lead: list[int]) -> list[np.ndarray]:
  """Masks keeping the `kept` highest scores: over all arrays together ("global") or per matrix and layer.

  A ranking that makes nothing static (k = 0) keeps its masks as they are.
  """
  def top(flat: np.ndarray, current: np.ndarray) -> np.ndarray:  # rows of scores -> their masks
    n = flat.shape[-1]
    if kept(n, share) == n:  # the code's `if not k < 1`: no threshold, the masks unchanged
      return current
    order = np.argsort(-flat, axis=-1, kind="stable")[..., :kept(n, share)]  # ties: the earlier entry first
    mask = np.zeros(flat.shape, bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask
  if scope == "global":
    joined = top(np.concatenate([s.ravel() for s in scores])[None], np.concatenate([m.ravel() for m in masks])[None])
    out, at = [], 0
    for s in scores:
      out.append(joined[0, at:at + s.size].reshape(s.shape))
      at += s.size
    return out
  rows = [int(np.prod(s.shape[:n])) for s, n in zip(scores, lead)]
  return [top(s.reshape(r, -1), m.reshape(r, -1)).reshape(s.shape) for s, m, r in zip(scores, masks, rows)]


def iterative_partition(masks: list, grad_sum: Callable[[list], list], ratio: float, *, rounds: int = 5,
                        schedule: str = "exponential", scope: str = "global") -> tuple[list[np.ndarray], list[float]]:
  """Iterative Mode Partition of PAD-Net masks to a dynamic share `ratio` (the paper's §3.2).

  Each round scores every entry by |∂L/∂M| and keeps the `kept(n, share_at(t, ...))` highest of each ranking of n
  dynamic.

  Args:
    masks: the current masks, arrays of shape (..., E, I, O).
    grad_sum: float masks → ∂L/∂M for each (summed over the scoring batches).
    ratio: the final dynamic share, in (0, 1].
    rounds: T (default 5).
    schedule: "exponential" (default) or "linear".
    scope: "global" (default: one ranking over all masks) or "local" (one per expert matrix).

  Returns:
    (the new boolean masks, the dynamic share after each round).
  """
  check(ratio, rounds, schedule, scope)
  masks, shares = [np.asarray(m, bool) for m in masks], []
  for t in range(1, rounds + 1):
    scores = [np.abs(np.asarray(g, np.float64)) for g in grad_sum([jnp.asarray(m, jnp.float32) for m in masks])]
    # local: one ranking per expert matrix (the layer axes and the expert axis lead: (..., E, I, O))
    masks = _keep_top(scores, masks, share_at(t, rounds, ratio, schedule), scope, [s.ndim - 2 for s in scores])
    shares.append(float(sum(m.sum() for m in masks) / sum(m.size for m in masks)))
  return masks, shares


def check(ratio: float, rounds: int = 5, schedule: str = "exponential", scope: str = "global"):
  """Refuses a partition's arguments that cannot work, in one line.

  Args:
    ratio: the final dynamic share, which must lie in (0, 1].
    rounds: the IMP rounds, at least 1 (default 5).
    schedule: one of `SCHEDULES` (default "exponential").
    scope: one of `SCOPES` (default "global").

  Raises:
    PadNetError: when an argument is out of range or unknown.
  """
  if not 0.0 < ratio <= 1.0:
    raise PadNetError(f"the dynamic ratio must lie in (0, 1], got {ratio}")
  if rounds < 1:
    raise PadNetError(f"IMP needs at least one round, got {rounds}")
  if schedule not in SCHEDULES or scope not in SCOPES:
    raise PadNetError(f"schedule must be one of {SCHEDULES} and scope one of {SCOPES}, got {schedule!r}, {scope!r}")


def partition(model: nnx.Module, loss_fn: Callable[[nnx.Module, object], jax.Array], batches: list, ratio: float, *,
              rounds: int = 5, schedule: Literal["exponential", "linear"] = "exponential",
              scope: Literal["local", "global"] = "global") -> list[float]:
  """`iterative_partition` of every PAD-Net layer of `model`, in place.

  Args:
    model: a model with PAD-Net layers (refused otherwise: PadNetError); its masks are replaced.
    loss_fn: `loss_fn(model, batch)` → the scalar loss.
    batches: the scoring batches (a list); the mask gradients are summed over them.
    ratio: the final dynamic share, in (0, 1].
    rounds: the IMP rounds (default 5).
    schedule: "exponential" (default) or "linear".
    scope: "global" (default) or "local".

  Returns:
    The dynamic share after each round.
  """
  _masks(model)  # refuses a model without PAD-Net layers
  graphdef, masks, rest = nnx.split(model, PadMask, ...)  # type: ignore[misc]  # flax: variadic tuple of states
  leaves, treedef = jax.tree.flatten(masks)

  @jax.jit
  def mask_grad(masks_f, rest, batch):
    return jax.grad(lambda m: loss_fn(nnx.merge(graphdef, jax.tree.unflatten(treedef, m), rest), batch))(masks_f)

  def grad_sum(masks_f):
    grads = [mask_grad(masks_f, rest, b) for b in batches]
    return [sum(g[i] for g in grads) for i in range(len(masks_f))]

  new, shares = iterative_partition(leaves, grad_sum, ratio, rounds=rounds, schedule=schedule, scope=scope)
  nnx.update(model, jax.tree.unflatten(treedef, [jnp.asarray(m) for m in new]))
  return shares
