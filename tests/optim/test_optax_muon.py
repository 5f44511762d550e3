"""optax's Muon test cases (`optax/contrib/_muon_test.py`, optax's public repository), ported to `optim.muon`.

optax reshapes a leaf to (batch, reduction, output) from `MuonDimensionNumbers`; optim's convention is fixed:
the last two axes are (fan_in, fan_out) and every leading axis is batch (layers, experts), and routing is a label
tree or function ("muon" / "adam"). So optax's dimension-number cases become: the same reshape cases read as
stacks, label functions, and prefix label trees whose state matches the parameter tree. optax's `preconditioning`
modes (frobenius, aol, schatten) become optim's two iterations (`method`: standard, gram). Muon is run with
optax.contrib.muon's defaults (no decay, eps 1e-8, the √max(1, fan_out/fan_in) scale, Adam β2 0.999).
Tolerances are optax's where the case is the same.

Not ported, having no counterpart: dimension numbers with negative or several output axes (the layout is fixed),
`test_aol_numerical_difference` and `adaptive=True` (no AOL preconditioning, no adaptive scaling). Different by
design: optax sends only 2-D leaves to Muon by default, optlab every leaf with ndim ≥ 2 (stacks of layers or experts),
so optax's "a (1, 2, 3) leaf goes to Adam" is asserted the other way round below. The keller scale is read from the
stored (fan_in, fan_out) shape, so a transposed non-square matrix gets the other side's factor (optax reads the
dimension numbers); the transpose case below uses a square matrix for that reason.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax._src import test_utils
from optax.transforms import _masking

from optim import muon, orthogonalize
from optim.trees import ParameterTreeError

OPTAX_DEFAULTS = dict(weight_decay=0.0, eps=1e-8, scale="keller", adam_b2=0.999, adam_weight_decay=0.0)
METHODS = ("standard", "gram")


def get_updates(params, labels=None, method="standard", **kw):
  opt = muon(learning_rate=1e-3, labels=labels, method=method, **{**OPTAX_DEFAULTS, **kw})
  state = opt.init(params)
  return opt.update(params, state, params=params)  # loss = 1/2 Σ params², so grad = params


def muon_mu(state):
  """The Muon group's momentum tree: partition state → 'muon' → masked inner → chain → MuonState.mu."""
  return state.inner_states["muon"].inner_state[0].mu


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (2, 3, 4, 5)])
@pytest.mark.parametrize("method", METHODS)
def test_leading_axes_are_a_stack_of_matrices(shape, method):
  """test_reshape_inverse / 3d_batch_axis / 4d_multiple_batch_axes: a (..., m, n) leaf is prod(...) matrices,
  each updated as if alone, and the update keeps the leaf's shape."""
  w = jax.random.normal(jax.random.key(0), shape)
  updates, _ = get_updates({"w": w}, method=method)
  assert updates["w"].shape == shape
  flat = w.reshape((-1,) + shape[-2:])
  one_by_one = jnp.stack([get_updates({"w": m}, method=method)[0]["w"] for m in flat]).reshape(shape)
  test_utils.assert_trees_all_close(updates["w"], one_by_one, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_transposed_layout_gives_the_transposed_update(method):
  """test_reshape_and_update_single_param: the same weight stored (fan_out, fan_in) gets the transposed update,
  as optax's reduction/output axes swapped (the keller scale is read from the stored shape, so square here)."""
  w = jax.random.normal(jax.random.key(0), (10, 10))
  u, _ = get_updates({"w": w}, method=method)
  ut, _ = get_updates({"w": w.T}, method=method)
  test_utils.assert_trees_all_close(u["w"].T, ut["w"], rtol=1e-5, atol=1e-5)


def test_callable_labels():
  """test_callable_weight_dim_nums: routing given as a function of the params, including one that sends a
  matrix to AdamW; both run, and the routing is what the function said."""
  params = {"w1": jnp.ones((10, 10)), "w2": jnp.ones((2, 10))}
  for fn in (lambda p: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", p),
             lambda p: {"w1": "muon", "w2": "adam"}):
    _, state = get_updates(params, labels=fn)
    mu = muon_mu(state)
    assert not isinstance(mu["w1"], _masking.MaskedNode)
    assert isinstance(mu["w2"], _masking.MaskedNode) == (fn(params)["w2"] == "adam")


def test_label_combinations_and_prefixes():
  """test_dim_nums_combinations: full label trees, the default routing, and PREFIX label trees (one label for a
  whole subtree), whose state matches the parameter tree leaf for leaf."""
  is_masked = lambda x: isinstance(x, _masking.MaskedNode)
  # full labels
  _, state = get_updates({"w1": jnp.ones((1, 2, 3)), "w2": jnp.ones((2, 3, 4))}, labels={"w1": "muon", "w2": "muon"})
  assert not any(is_masked(v) for v in muon_mu(state).values())
  # default routing: matrices (and stacks of them) to Muon, vectors to AdamW
  _, state = get_updates({"w1": jnp.ones((1, 2, 3)), "w2": jnp.ones((3,))})
  assert not is_masked(muon_mu(state)["w1"]) and is_masked(muon_mu(state)["w2"])
  # prefix trees
  params = {"w1": {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))}, "w2": {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))}}
  for labels, routed in (({"w1": "adam", "w2": {"a": "muon", "b": "adam"}}, {("w2", "a")}),
                         ({"w1": "muon", "w2": "adam"}, {("w1", "a"), ("w1", "b")})):
    updates, state = get_updates(params, labels=labels)
    mu = muon_mu(state)
    assert jax.tree.structure(mu, is_leaf=is_masked) == jax.tree.structure(params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    for k in ("w1", "w2"):
      for j in ("a", "b"):
        assert is_masked(mu[k][j]) == ((k, j) not in routed), (labels, k, j)


@pytest.mark.parametrize("labels,match", [
    ({"w1": "muon"}, "does not match the parameters"),
    ({"w1": "muon", "w2": {"a": "muon"}}, "does not match the parameters"),
    ({"w1": "muon", "w2": "sgd"}, "unknown labels \\['sgd'\\]"),
])
def test_label_trees_that_do_not_fit_fail_at_init(labels, match):
  params = {"w1": jnp.ones((2, 3)), "w2": {"a": jnp.ones((2, 3)), "b": jnp.ones((3,))}}
  with pytest.raises(ParameterTreeError, match=match):
    muon(1e-3, labels=labels).init(params)


def test_newton_schulz():
  """test_newton_schulz: the convergent cubic (2, −1.5, 0.5) orthogonalizes a real (4, 3) matrix in 20 steps
  and unitarizes a complex one in 10 (atol = rtol = 1e-5; CPU)."""
  real = jax.random.normal(jax.random.key(0), (4, 3), dtype=jnp.float32)
  cplx = jax.random.normal(jax.random.key(0), (4, 3), dtype=jnp.complex64)
  o = orthogonalize(real, coeffs=[(2.0, -1.5, 0.5)], steps=20, eps=1e-12)
  np.testing.assert_allclose(o.T @ o, jnp.eye(3), atol=1e-5, rtol=1e-5)
  oc = orthogonalize(cplx, coeffs=[(2.0, -1.5, 0.5)], steps=10, eps=1e-8)
  assert oc.shape == cplx.shape and oc.dtype == cplx.dtype
  np.testing.assert_allclose(oc.conj().T @ oc, jnp.eye(3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_complex_newton_schulz_equals_the_polar_factor(method):
  """Beyond optax: the complex result is U Vᴴ of the SVD (the unitary polar factor), wide and tall."""
  for shape in ((3, 5), (5, 3)):
    x = jax.random.normal(jax.random.key(1), shape, dtype=jnp.complex64)
    u, _, vh = np.linalg.svd(np.asarray(x, np.complex128), full_matrices=False)
    o = orthogonalize(x, coeffs=[(2.0, -1.5, 0.5)], steps=30, eps=1e-12, method=method)
    np.testing.assert_allclose(o, u @ vh, atol=1e-4)


@pytest.mark.parametrize("nesterov", [True, False])
def test_complex_mixed_target(nesterov):
  """test_complex_mixed_target: Muon on a complex 2x2 target, 1000 steps by lax.scan, within 3e-2 (optax's
  `adaptive` flag has no counterpart here)."""
  final = jnp.array([[1.0 + 2.0j, 0.0], [-1.0 + 1.0j, 1.0 - 3.0j]], dtype=jnp.complex64)
  objective = lambda p: jnp.sum(jnp.abs(p - final) ** 2)
  opt = muon(learning_rate=1e-2, nesterov=nesterov, **OPTAX_DEFAULTS)

  def step(carry, _):
    params, state = carry
    grads = jax.tree.map(jnp.conj, jax.grad(objective)(params))
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  initial = jnp.zeros((2, 2), jnp.complex64)
  (params, _), _ = jax.lax.scan(step, (initial, opt.init(initial)), length=1000)
  test_utils.assert_trees_all_close(params, final, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("shape", [(100, 100), (100, 50), (50, 100)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("method", METHODS)
def test_muon_orthogonalization_modes(method, shape):
  """test_muon_orthogonalization_modes: lr 1, no decay: the update keeps the shape; a square one has singular
  values in (0.1, 2)."""
  params = {"w": jax.random.normal(jax.random.key(42), shape)}
  opt = muon(learning_rate=1.0, method=method, **OPTAX_DEFAULTS)
  updates, _ = opt.update(params, opt.init(params), params=params)
  assert updates["w"].shape == shape
  if shape[0] == shape[1]:
    s = jnp.linalg.svd(updates["w"], compute_uv=False)
    assert float(s.max()) < 2.0 and float(s.min()) > 0.1, (float(s.min()), float(s.max()))


@pytest.mark.parametrize("method", METHODS)
def test_orthogonality(method):
  """test_orthogonality: on 2·I the update U satisfies ‖UᵀU / max(UᵀU) − I‖ < 1e-3, with no NaN."""
  params = {"w": jnp.eye(8) * 2.0}
  opt = muon(learning_rate=0.1, method=method, **OPTAX_DEFAULTS)
  updates, _ = opt.update(params, opt.init(params), params)
  w = updates["w"]
  assert not bool(jnp.isnan(w).any())
  gram = w.T @ w
  assert float(jnp.linalg.norm(gram / jnp.max(gram) - jnp.eye(8))) < 1e-3
