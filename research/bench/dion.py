"""`python -m research.bench dion`: collective bytes of one Dion step against distributed Muon, per device.

Question: on a sharded model, does Dion's low-rank step (arXiv 2504.05295) send fewer bytes than our distributed
Muon (whole matrices moved by all-to-all, `optim.distributed`)? A transformer-like tree (per layer wq, wk, wv, wo
(D, D), w_up (D, F), w_down (F, D); stacked over layers; logical axes embed → fsdp, heads/mlp → tensor,
sharding/rules.py) takes one optimizer update + apply, compiled under the mesh with the optimizer state sharded
like the parameters (Dion's Q: `optim.dion.right_factor_spec`); bytes are read from the compiled HLO by
`sharding.collectives` (ring wire bytes per device; XLA:CPU's all-reduce + dynamic-slice counted as the
reduce-scatter it stands for). Nothing is executed.

Expectation (the model the measured rows are compared with): per matrix of long side L and short side S, with a
devices on the side Q spans and b on P's side, Dion all-reduces P = B Q over a (L/b × r), PᵀP twice and R = Bᵀ P
over b (r × r, S/a × r) and R's column norms over a (r): ≈ 8·[(1−1/a)·L·r/b + (1−1/b)·S·r/a] bytes, where
distributed Muon's all-to-alls move each device's L·S/N share there and back (≈ 8·L·S/N per matrix, N = a·b). The
ratio grows as r·N/S: on fsdp=8 (a = 8, b = 1) it is ≈ 8r/S, so rank 0.25 sends about twice Muon's bytes; on
fsdp=4,tensor=2 both sides are split and rank 0.25 sends about what Muon's all-to-alls send (and less than Muon's
whole step, which on this mesh also all-gathers and permutes). Dion's gain over a data-parallel gradient
all-reduce, its paper's setting, does not arise here: the optimizer receives already-reduced gradients.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

import optim
from optim.dion import DionState, dion_rank, right_factor_spec
from research.bench.report import git_commit, machine, publish, table
from sharding import collectives, logical_to_spec, make_mesh, shardings_like_params

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
NAMES = {"wq": ("layers", "embed", "heads"), "wk": ("layers", "embed", "heads"), "wv": ("layers", "embed", "heads"),
         "wo": ("layers", "heads", "embed"), "w_up": ("layers", "embed", "mlp"), "w_down": ("layers", "mlp", "embed")}
OUT = "research/results/bench_dion_comm.md"


def param_tree(d: int, f: int, layers: int) -> dict:
  """The tree's shapes: {name: ShapeDtypeStruct (layers, fan_in, fan_out)}."""
  shape = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_up": (d, f), "w_down": (f, d)}
  return {"layers": {k: jax.ShapeDtypeStruct((layers,) + s, jnp.float32) for k, s in shape.items()}}


def _shardings(abstract, mesh):
  return {"layers": {k: NamedSharding(mesh, logical_to_spec(NAMES[k], mesh, x.shape))
                     for k, x in abstract["layers"].items()}}


def state_shardings(tx, abstract, p_sh, mesh):
  """The optimizer state's shardings: like the parameters (`shardings_like_params`), Dion's Q by
  `right_factor_spec`."""
  abstract_state = jax.eval_shape(tx.init, abstract)
  o_sh = shardings_like_params(abstract_state, abstract, p_sh, mesh)
  is_dion = lambda x: isinstance(x, DionState)
  q_sh = lambda sh, mu: jax.tree.map(lambda s, x: NamedSharding(mesh, right_factor_spec(s.spec, x.shape)), sh, mu)
  return jax.tree.map(lambda s, a: s._replace(q=q_sh(s.mu, a.mu)) if is_dion(a) else s, o_sh, abstract_state,
                      is_leaf=is_dion)


def step_bytes(tx, mesh, d: int, f: int, layers: int):
  """The `sharding.Audit` of one compiled update + apply of `tx` on the tree, on `mesh`."""
  abstract = param_tree(d, f, layers)
  p_sh = _shardings(abstract, mesh)
  o_sh = state_shardings(tx, abstract, p_sh, mesh)

  def step(state, params, grads):
    u, state = tx.update(grads, state, params)
    return state, optax.apply_updates(params, u)

  abstract_state = jax.eval_shape(tx.init, abstract)
  with jax.set_mesh(mesh):
    compiled = jax.jit(step, in_shardings=(o_sh, p_sh, p_sh), out_shardings=(o_sh, p_sh)).lower(
        abstract_state, abstract, abstract).compile()
  return collectives(compiled)


def dion_expected_bytes(mesh, d: int, f: int, layers: int, rank_fraction: float) -> float:
  """Ring wire bytes per device of the Dion step's all-reduces (module docstring), fp32."""
  total = 0.0
  abstract = param_tree(d, f, layers)
  for k, x in abstract["layers"].items():
    spec = tuple(logical_to_spec(NAMES[k], mesh, x.shape)) + (None,) * 3
    m, n = x.shape[-2:]
    size = lambda e: math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
    (long, b), (short, a) = ((m, size(spec[1])), (n, size(spec[2]))) if m > n else ((n, size(spec[2])),
                                                                                     (m, size(spec[1])))
    r = dion_rank(x.shape, rank_fraction)
    ring = lambda k, floats: 2 * (k - 1) / k * 4 * floats
    total += layers * (ring(a, long // b * r) + ring(b, 2 * r * r + short // a * r) + ring(a, r))
  return total


def optimizers(rank_fractions=(1.0, 0.25)) -> dict:
  """{(name, rank_fraction or None): optimizer}: distributed Muon (the baseline), Dion distributed, Dion's
  Householder path (distributed=False) at the smallest rank."""
  common = dict(weight_decay=0.0)
  out = {("muon distributed", None): optim.muon(1e-3, distributed=True, **common)}
  for rf in rank_fractions:
    out[("dion distributed", rf)] = optim.dion(1e-3, rank_fraction=rf, distributed=True, **common)
  out[("dion (Householder QR)", min(rank_fractions))] = optim.dion(1e-3, rank_fraction=min(rank_fractions),
                                                                    **common)
  return out


def dion_comm(meshes: tuple[str, ...] = ("fsdp=8", "fsdp=4,tensor=2"), d: int = 256, f: int = 1024,
              layers: int = 4, rank_fractions: tuple[float, ...] = (1.0, 0.25), out: str | None = OUT) -> str:
  """Collective bytes per device of one optimizer step: Dion (distributed, each rank fraction) vs distributed Muon.

  Args:
    meshes: mesh specs over the 8 devices.
    d, f, layers: the tree (d_model, MLP width, stacked layers).
    rank_fractions: Dion's ranks.
    out: also write the table (markdown) to this file.
  """
  mib = 2 ** 20
  lines = [f"git {git_commit()}; {machine()}; fp32; tree: {layers} layers x (4 (D, D) + (D, F) + (F, D)), D={d}, "
           f"F={f}; one update + apply, compiled, not run; cells `count / MiB` of ring wire bytes per device", ""]
  for spec in meshes:
    mesh = make_mesh(spec)
    rows = []
    audits = {key: step_bytes(tx, mesh, d, f, layers) for key, tx in optimizers(rank_fractions).items()}
    base = audits[("muon distributed", None)].wire_bytes(True)
    for (name, rf), a in audits.items():
      s = a.summary(fold_scatter=True)
      expected = f"{dion_expected_bytes(mesh, d, f, layers, rf) / mib:.2f}" if name == "dion distributed" else "–"
      rows.append([name, "–" if rf is None else f"{rf:g}"]
                  + [f"{s[k].count} / {s[k].wire_bytes / mib:.2f}" if k in s else "–" for k in KINDS]
                  + [f"{a.wire_bytes(True) / mib:.2f}", expected, f"{a.wire_bytes(True) / base:.2f}"])
    lines += [f"### {spec}", ""] + table(["optimizer", "rank_fraction", *KINDS, "total MiB", "expected MiB",
                                          "/ muon distributed"], rows) + [""]
    a2a = audits[("muon distributed", None)].summary(fold_scatter=True).get("all-to-all")
    if a2a and a2a.wire_bytes < base:
      lines += [f"Distributed Muon's all-to-alls alone: {a2a.wire_bytes / mib:.2f} MiB; against them Dion sends "
                + ", ".join(f"{a.wire_bytes(True) / a2a.wire_bytes:.2f}x at rank {rf:g}"
                            for (name, rf), a in audits.items() if name == "dion distributed") + ".", ""]
  lines.append("expected: the all-reduces of P, PᵀP (2 passes), R and R's column norms (module docstring).")
  return publish(lines, out, preface=f"Command: `python -m research.bench dion --out {out}`\n\n")
