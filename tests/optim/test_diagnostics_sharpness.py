"""optim/diagnostics/sharpness.py against the dense float64 Hessian of a tiny model (jax.hessian on the flattened
parameters, numpy.linalg.eigh), and the same programs on one device and on an 8-device mesh.

The model: a 4-8-4 tanh MLP (76 parameters in a dict tree), softmax cross-entropy on a fixed batch of 16 examples
whose inputs are offset by 3 (a non-centred input makes the top eigenvalue an outlier: λ₁ ≈ 7.7, |λ₂|/λ₁ ≈ 0.56,
checked below). Softmax's shift invariance gives H a 9-dimensional null space (the output bias and each hidden unit's
outgoing row), so a full-length Lanczos run breaks down and must restart.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optim.diagnostics import noise, sharpness
from optim.trees import replicated

D, H, C, B = 4, 8, 4, 16
SPECS = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"), "b2": P("fsdp")}


def make_problem(seed: int = 0, offset: float = 3.0):
  """(params, x, y) as float64 NumPy."""
  rng = np.random.default_rng(seed)
  params = {"w1": rng.normal(size=(D, H)) / np.sqrt(D), "b1": rng.normal(size=H) * 0.1,
            "w2": rng.normal(size=(H, C)) / np.sqrt(H), "b2": np.zeros(C)}
  x = rng.normal(size=(B, D)) + offset
  y = rng.integers(0, C, B)
  return params, x, y


def loss(p, x, y):
  """Mean softmax cross-entropy of the MLP; the weights gathered first (FSDP-style) so it runs on any mesh."""
  p = jax.tree.map(replicated, p)
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  logp = jax.nn.log_softmax(h @ p["w2"] + p["b2"])
  return -jnp.mean(jnp.sum(jax.nn.one_hot(y, C, dtype=logp.dtype) * logp, axis=-1))


@pytest.fixture(scope="module")
def dense():
  """The float64 problem and its dense Hessian: (params, x, y, H, eigenvalues ascending, eigenvectors)."""
  params, x, y = make_problem()
  with jax.enable_x64(True):
    flat, unravel = ravel_pytree(jax.tree.map(jnp.asarray, params))
    hess = np.asarray(jax.jit(jax.hessian(lambda f: loss(unravel(f), jnp.asarray(x), jnp.asarray(y))))(flat))
  assert hess.shape == (76, 76)
  evals, evecs = np.linalg.eigh(hess)
  return params, x, y, hess, evals, evecs


def flat(tree) -> np.ndarray:
  """The leaves of a tree, flattened in ravel_pytree's order, as one NumPy vector (any dtype kept)."""
  return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(tree)])


def test_hvp_and_directional_curvature_equal_dense_hessian(dense):
  params, x, y, hess, _, _ = dense
  rng = np.random.default_rng(1)
  u = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
  with jax.enable_x64(True):
    f = lambda p: loss(p, jnp.asarray(x), jnp.asarray(y))
    hu, curv, zero = jax.jit(lambda p, u: (sharpness.hvp(f, p, u), sharpness.directional_curvature(f, p, u),
                                           sharpness.directional_curvature(f, p, jax.tree.map(jnp.zeros_like, u))))(
                                             params, u)
  assert jax.tree.structure(hu) == jax.tree.structure(params)
  np.testing.assert_allclose(flat(hu), hess @ flat(u), rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(curv, flat(u) @ hess @ flat(u) / (flat(u) @ flat(u)), rtol=1e-10)
  assert curv.dtype == np.float64 and float(zero) == 0


def test_top_eigenvalue_and_vector_equal_eigh(dense):
  params, x, y, _, evals, evecs = dense
  by_size = evals[np.argsort(-np.abs(evals))]
  iters = 40
  # the top eigenvalue is positive and separated, so 40 iterations converge far below the tolerances:
  # the Rayleigh quotient's error shrinks like (|λ₂|/λ₁)^(2·iters)
  assert by_size[0] > 0 and (abs(by_size[1]) / by_size[0]) ** iters < 1e-9
  with jax.enable_x64(True):
    lam, v = jax.jit(lambda p: sharpness.top_eigenvalue(lambda q: loss(q, jnp.asarray(x), jnp.asarray(y)), p,
                                                        iters=iters))(params)
    ov = sharpness.overlap(v, jax.tree.map(jnp.asarray, params))  # checked against NumPy below
  np.testing.assert_allclose(lam, evals[-1], rtol=1e-10)
  top = evecs[:, -1]
  np.testing.assert_allclose(np.linalg.norm(flat(v)), 1, rtol=1e-12)
  assert 1 - (flat(v) @ top) ** 2 < 1e-12
  p = flat(params)
  np.testing.assert_allclose(ov, (flat(v) @ p) ** 2 / (flat(v) @ flat(v) * (p @ p)), rtol=1e-12)


def test_lanczos_equals_eigh_through_breakdown(dense):
  """76 steps on 76 parameters: the top Ritz values converge, and so does the whole spectrum, the null space's zeros
  included, which only the restarts after breakdown reach (the start vector's Krylov space has dimension at most
  76 − 9 + 1 = 68)."""
  params, x, y, _, evals, _ = dense
  assert np.sum(np.abs(evals) < 1e-12 * evals[-1]) == 9
  with jax.enable_x64(True):
    ritz = jax.jit(lambda p: sharpness.lanczos(lambda q: loss(q, jnp.asarray(x), jnp.asarray(y)), p,
                                               iters=76))(params)
  ritz = np.asarray(ritz)
  assert ritz.dtype == np.float64 and np.all(np.diff(ritz) <= 0)
  np.testing.assert_allclose(ritz[:3], evals[::-1][:3], rtol=1e-8)
  np.testing.assert_allclose(ritz, evals[::-1], rtol=0, atol=1e-10 * evals[-1])


def test_breakdown_on_exact_invariant_subspaces():
  """A quadratic with H = diag(1, 1, 1, 3, 3, 3) (two distinct eigenvalues: every Krylov space has dimension 2) and a
  linear loss (H = 0, β = 0 exactly): the Ritz values are H's eigenvalues, never NaN."""
  c = {"a": jnp.array([1.0, 1.0, 3.0]), "b": jnp.array([[3.0, 1.0, 3.0]])}
  params = jax.tree.map(lambda a: jnp.full(a.shape, 0.5), c)
  quadratic = lambda p: 0.5 * sum(jnp.sum(k * q * q) for k, q in zip(jax.tree.leaves(c), jax.tree.leaves(p)))
  linear = lambda p: sum(jnp.sum(q) for q in jax.tree.leaves(p))
  run = jax.jit(lambda p: (sharpness.lanczos(quadratic, p, iters=6), sharpness.lanczos(linear, p, iters=6),
                           sharpness.top_eigenvalue(linear, p)))
  ritz, zeros, (lam, v) = run(params)
  np.testing.assert_allclose(ritz, [3, 3, 3, 1, 1, 1], rtol=1e-6)
  np.testing.assert_array_equal(zeros, np.zeros(6))
  assert lam == 0 and np.isfinite(flat(v)).all()
  with pytest.raises(ValueError, match="iters"):
    sharpness.lanczos(quadratic, params, iters=7)


def test_interpolate_and_overlap(dense):
  params, x, y, _, _, _ = dense
  rng = np.random.default_rng(2)
  u = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
  alphas = (-1.0, 0.0, 0.5, 1.0, 2.0)
  with jax.enable_x64(True):
    f = lambda p: loss(p, jnp.asarray(x), jnp.asarray(y))
    got = jax.jit(lambda p, u: sharpness.interpolate(f, p, u, alphas))(params, u)
    want = [f(jax.tree.map(lambda p, d: p + a * d, params, u)) for a in alphas]
    np.testing.assert_allclose(got, want, rtol=1e-13)
    v = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
    a, b = flat(v), flat(u)
    np.testing.assert_allclose(sharpness.overlap(v, u), (a @ b) ** 2 / ((a @ a) * (b @ b)), rtol=1e-13)
    np.testing.assert_allclose(sharpness.overlap(v, jax.tree.map(lambda t: -3 * t, v)), 1, rtol=1e-14)
    assert sharpness.overlap(v, jax.tree.map(jnp.zeros_like, u)) == 0


def test_sharded_equals_single_device():
  """float32, the params over fsdp/tensor and the held batch over data: the same eigenvalue, eigenvector, Ritz values,
  losses along a direction and group noise scale as on one device."""
  params, x, y = make_problem()
  params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
  x = np.asarray(x, np.float32)
  u = jax.tree.map(lambda a: np.asarray(np.random.default_rng(3).normal(size=a.shape), np.float32), params)
  groups, per_group = 8, 2
  xg, yg = x.reshape(groups, per_group, D), y.reshape(groups, per_group)

  def diagnose(params, u, x, y, xg, yg):
    f = lambda p: loss(p, x, y)
    lam, v = sharpness.top_eigenvalue(f, params, iters=20)
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, xg, yg)
    g2, s = noise.unbiased_estimates(*noise.group_sq_norms(grads), per_group, groups * per_group)
    return {"lam": lam, "v": v, "ritz": sharpness.lanczos(f, params, iters=8),
            "line": sharpness.interpolate(f, params, u, (0.0, 0.5, 1.0)), "g2": g2, "s": s,
            "b_simple": noise.b_simple(g2, s), "big_sq": noise.group_sq_norms(grads)[1]}

  single = jax.jit(diagnose)(params, u, x, y, xg, yg)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    sharded = jax.jit(diagnose)({k: put(a, SPECS[k]) for k, a in params.items()},
                                {k: put(a, SPECS[k]) for k, a in u.items()}, put(x, P("data")), put(y, P("data")),
                                put(xg, P("data")), put(yg, P("data")))
  assert {k: a.sharding.spec for k, a in sharded["v"].items()} == SPECS
  # |G|² = (n·big_sq − b·small_sq)/(n − b) loses less than a factor 20 to cancellation here, so float32's rounding
  # (~1e-7) stays well below the tolerance
  n = groups * per_group
  assert n * single["big_sq"] < 20 * (n - per_group) * single["g2"]
  for key in ("lam", "line", "g2", "s", "b_simple"):
    np.testing.assert_allclose(sharded[key], single[key], rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(flat(sharded["v"]), flat(single["v"]), rtol=0, atol=1e-5)
  np.testing.assert_allclose(sharded["ritz"][:3], single["ritz"][:3], rtol=1e-5)
  # the lower Ritz values to the same accuracy relative to ‖H‖ (an eigenvalue moves by at most a perturbation's norm)
  np.testing.assert_allclose(sharded["ritz"], single["ritz"], rtol=0, atol=1e-5 * single["ritz"][0])
