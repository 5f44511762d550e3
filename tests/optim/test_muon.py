"""Newton–Schulz and Muon: properties, a float64 NumPy reference of the Moonlight equations, experts,
the optax contract, and sharded == unsharded on Auto and Explicit meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
import optim
import sharding
from optim import COEFFICIENTS, coefficient_table, muon_labels, orthogonalize, scale_by_muon

RNG = np.random.default_rng(0)


def predicted_singular_values(x: np.ndarray, table: np.ndarray, safety: float = 1.0, eps: float = 1e-7):
  """The NS polynomial acts on each singular value alone: σ ← aσ + bσ³ + cσ⁵ from σ/‖X‖_F."""
  s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
  s = s / (np.sqrt(np.sum(s ** 2)) * safety + eps)
  for a, b, c in table:
    s = a * s + b * s ** 3 + c * s ** 5
  return np.sort(s)


@pytest.mark.parametrize("name, steps", [("quintic", 5), ("polar_express", 5), ("tuned5", 5), ("cubic", 12)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_singular_values_follow_the_polynomial(name, steps, method):
  x = RNG.standard_normal((48, 160)).astype(np.float32)
  out = np.asarray(orthogonalize(jnp.asarray(x), coeffs=name, steps=steps, method=method), np.float64)
  got = np.sort(np.linalg.svd(out, compute_uv=False))
  want = predicted_singular_values(x, coefficient_table(name, steps), 1.02 if name == "polar_express" else 1.0)
  np.testing.assert_allclose(got, want, atol=2e-5)
  band = {"quintic": (0.68, 1.14), "polar_express": (0.85, 1.15), "tuned5": (0.97, 1.04), "cubic": (0.999, 1.001)}
  lo, hi = band[name]  # the ranges the reference reports for σ/‖X‖_F in [0.05, 1] (optimizers.md §11.2)
  assert lo <= got.min() and got.max() <= hi


def test_cubic_converges_to_the_polar_factor():
  x = RNG.standard_normal((32, 96))
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  out = np.asarray(orthogonalize(jnp.asarray(x, jnp.float32), coeffs="cubic", steps=16), np.float64)
  np.testing.assert_allclose(out, u @ vt, atol=1e-4)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_batched_equals_per_matrix_and_transpose_equivariant(method):
  x = jnp.asarray(RNG.standard_normal((2, 3, 40, 120)), jnp.float32)
  out = orthogonalize(x, method=method)
  for i in range(2):
    for j in range(3):
      np.testing.assert_allclose(out[i, j], orthogonalize(x[i, j], method=method), atol=1e-6)
  np.testing.assert_allclose(orthogonalize(jnp.swapaxes(x, -1, -2), method=method), jnp.swapaxes(out, -1, -2),
                             atol=1e-6)


def test_gram_matches_standard_with_and_without_restarts():
  x = jnp.asarray(RNG.standard_normal((64, 256)), jnp.float32)
  ref = orthogonalize(x, coeffs="polar_express")
  np.testing.assert_allclose(orthogonalize(x, coeffs="polar_express", method="gram"), ref, atol=5e-6)
  np.testing.assert_allclose(orthogonalize(x, coeffs="polar_express", method="gram", restart=2), ref, atol=5e-6)
  assert optim.ns_flops(768, 3072, 5, "gram") < 0.6 * optim.ns_flops(768, 3072, 5)
  assert optim.ns_flops(768, 768, 5, "gram") == optim.ns_flops(768, 768, 5)  # square: standard is cheaper


def test_finite_on_zero_and_rank_deficient_inputs():
  assert float(jnp.abs(orthogonalize(jnp.zeros((3, 8, 16)))).max()) == 0.0
  low = RNG.standard_normal((24, 2)) @ RNG.standard_normal((2, 40))  # rank 2
  for method in ("standard", "gram"):
    out = np.asarray(orthogonalize(jnp.asarray(low, jnp.float32), method=method))
    assert np.isfinite(out).all()
    s = np.linalg.svd(out, compute_uv=False)
    assert s[2] < 1e-4 and 0.68 < s[1] <= s[0] < 1.14  # the null space stays null


def test_the_iteration_is_a_loop_not_unrolled():
  text = jax.jit(lambda x: orthogonalize(x, steps=12)).lower(jnp.ones((16, 32))).as_text()
  assert "stablehlo.while" in text and text.count("stablehlo.dot_general") <= 4


def test_coefficient_tables():
  assert coefficient_table("quintic", 3).tolist() == [list(COEFFICIENTS["quintic"][0])] * 3
  pe = coefficient_table("polar_express", 7)
  assert pe.shape == (7, 3) and (pe[5] == pe[4]).all() and (pe[6] == pe[4]).all()
  assert coefficient_table([[2, -1.5, 0.5], [3, -3, 1]], 1).tolist() == [[2, -1.5, 0.5]]
  with pytest.raises(ValueError, match="unknown Newton-Schulz coefficients 'keller'"):
    coefficient_table("keller", 5)


# --- Muon against a float64 NumPy reference written from the Moonlight equations (arXiv 2502.16982, Eq. 1-4)


def np_ns(x, a=3.4445, b=-4.7750, c=2.0315, steps=5, eps=1e-7):
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def np_moonlight(w, grads, lr, mu, wd):
  """M ← μM + G; U = μM + G; W ← W − lr·(0.2·√max(A,B)·NS(U) + wd·W)."""
  m = np.zeros_like(w)
  out = []
  for g in grads:
    m = mu * m + g
    w = w - lr * (0.2 * np.sqrt(max(w.shape)) * np_ns(mu * m + g) + wd * w)
    out.append(w)
  return out


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_muon_equals_float64_moonlight_reference(shape):
  lr, mu, wd = 0.02, 0.95, 0.1
  w0 = RNG.standard_normal(shape)
  grads = [RNG.standard_normal(shape) for _ in range(6)]
  want = np_moonlight(w0, grads, lr, mu, wd)
  with jax.enable_x64(True):
    tx = optax.chain(scale_by_muon(mu, momentum="classic", nesterov=True, scale="moonlight"),
                     optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr))
    w, state = jnp.asarray(w0), None
    state = tx.init(w)
    for g, ref in zip(grads, want):
      u, state = tx.update(jnp.asarray(g), state, w)
      w = optax.apply_updates(w, u)
      assert w.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(w), ref, rtol=0, atol=1e-10)


def test_momentum_forms_differ_only_by_scale_before_ns():
  g = [jnp.asarray(RNG.standard_normal((16, 24)), jnp.float32) for _ in range(4)]
  outs = {}
  for form in ("ema", "classic"):
    tx, upd = scale_by_muon(0.9, momentum=form, eps=0.0), []
    s = tx.init(g[0])
    for gi in g:
      u, s = tx.update(gi, s)
      upd.append(u)
    outs[form] = upd
  for a, b in zip(outs["ema"], outs["classic"]):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("scale, factor", [("keller", np.sqrt(96 / 32)), ("moonlight", 0.2 * np.sqrt(96)),
                                           ("spectral", np.sqrt(96 / 32)), ("none", 1.0)])
def test_shape_scales_use_fan_in_and_fan_out(scale, factor):
  g = jnp.asarray(RNG.standard_normal((32, 96)), jnp.float32)  # (fan_in, fan_out)
  tx = scale_by_muon(scale=scale, momentum="classic", nesterov=False)  # first step: U = G exactly
  u, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(u, factor * orthogonalize(g), rtol=1e-6)
  assert optim.shape_scale("spectral", 96, 32) == pytest.approx(np.sqrt(32 / 96))  # no max(1, .) for spectral
  assert optim.shape_scale("keller", 96, 32) == 1.0


def test_experts_are_orthogonalized_one_by_one_with_their_own_scale():
  """(E, d_in, d_out) stacks: each expert like a lone matrix; not the flattened (E·d_in, d_out) matrix."""
  g = jnp.asarray(RNG.standard_normal((4, 16, 48)), jnp.float32)
  tx = scale_by_muon(scale="moonlight", nesterov=False)
  u, _ = tx.update(g, tx.init(g))
  for e in range(4):
    ue, _ = tx.update(g[e], tx.init(g[e]))
    np.testing.assert_allclose(u[e], ue, atol=1e-6)
  flat = g.reshape(64, 48)
  uf, _ = tx.update(flat, tx.init(flat))
  assert float(jnp.abs(u - uf.reshape(4, 16, 48)).max()) > 0.05


def test_labels_route_hidden_matrices_to_muon():
  model = nnx.eval_shape(lambda: models.Transformer(models.preset("tiny", tie_embeddings=False), rngs=nnx.Rngs(0)))
  labels = muon_labels(nnx.to_pure_dict(nnx.state(model)))
  assert labels["embed_VD"] == labels["head_DV"] == labels["final_norm"] == "adam"
  assert labels["blocks"]["attn_norm"] == labels["blocks"]["q_norm"] == "adam"
  assert {labels["blocks"][k] for k in ("wq_DQ", "wk_DK", "wv_DK", "wo_QD", "w_gate_DF", "w_up_DF",
                                        "w_down_FD")} == {"muon"}


def test_muon_partitions_muon_and_adamw():
  params = {"w": jnp.asarray(RNG.standard_normal((8, 12)), jnp.float32), "norm": jnp.ones((12,))}
  grads = {"w": jnp.ones((8, 12)), "norm": jnp.full((12,), 0.5)}
  tx = optim.muon(0.1, weight_decay=0.0, adam_learning_rate=0.01)
  u, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(u["norm"], -0.01 * np.ones(12), rtol=1e-5)  # Adam's first step: -lr·sign(g)
  np.testing.assert_allclose(u["w"], -0.1 * 0.2 * np.sqrt(12) * orthogonalize(grads["w"]),
                             rtol=1e-5)


# --- the optax contract


def tiny_params():
  return nnx.to_pure_dict(nnx.state(models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0))))


def test_jit_inject_hyperparams_dtypes_and_zero_gradients():
  params = tiny_params()
  with pytest.raises(TypeError, match="static_args=\\('ns_steps',\\)"):  # a traced loop count says how to fix it
    bad = optax.inject_hyperparams(optim.muon)(learning_rate=0.02)
    jax.jit(bad.update)(params, bad.init(params), params)
  tx = optax.inject_hyperparams(optim.muon, static_args=("ns_steps",))(learning_rate=0.02, beta=0.9,
                                                                       weight_decay=0.05)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  step = jax.jit(tx.update)
  updates, new_state = step(zeros, state, params)
  assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(lambda a: (a.shape, a.dtype), state)
  # a changed injected hyperparameter changes the update without recompiling the structure
  grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
  u1, _ = step(grads, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.04)
  u2, _ = step(grads, state, params)
  np.testing.assert_allclose(u2["blocks"]["w_up_DF"], 2 * u1["blocks"]["w_up_DF"], rtol=1e-5)


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("spec", ["fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"])
def test_sharded_updates_equal_unsharded_and_keep_the_param_sharding(spec, explicit):
  mf = lambda: models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0))
  tx = optim.muon(0.02)
  one = sharding.make_mesh("data=1", devices=jax.devices()[:1])
  _, ref_state, _ = sharding.init_train_state(mf, tx, one)
  mesh = sharding.make_mesh(spec, explicit=explicit)
  _, state, shardings = sharding.init_train_state(mf, tx, mesh)
  grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), ref_state["params"]) for k in range(3)]

  def run(state, mesh):
    params, opt_state = state["params"], state["opt_state"]
    with jax.set_mesh(mesh):
      step = jax.jit(lambda g, s, p: tx.update(g, s, p))
      for g in grads:
        g = jax.device_put(g, jax.tree.map(lambda a: a.sharding, params))
        u, opt_state = step(g, opt_state, params)
        params = optax.apply_updates(params, u)
    return u, params, opt_state

  u_ref, p_ref, _ = run(ref_state, one)
  u, params, opt_state = run(state, mesh)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(state["params"])):
    assert a.sharding.is_equivalent_to(b.sharding, b.ndim)
  mu = opt_state.inner_states["muon"].inner_state[0].mu
  assert mu["blocks"]["w_up_DF"].sharding.is_equivalent_to(shardings["params"]["blocks"]["w_up_DF"], 3)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), params, p_ref)
  if spec == "fsdp=4,tensor=2":
    assert state["params"]["blocks"]["w_up_DF"].sharding.spec == P(None, "fsdp", "tensor")


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16"])  # a dtype *name*: inject_hyperparams calls callables
def test_scale_by_muon_contract(mu_dtype):
  """jit, injectable beta, state dtypes kept, finite on zero gradients, stacks of matrices."""
  params = {"w": jnp.asarray(RNG.standard_normal((3, 16, 40)), jnp.float32)}
  tx = optax.inject_hyperparams(scale_by_muon, static_args=("ns_steps",))(beta=0.9, mu_dtype=mu_dtype)
  state = tx.init(params)
  step = jax.jit(tx.update)
  u, new = step(jax.tree.map(jnp.zeros_like, params), state, params)
  assert bool(jnp.isfinite(u["w"]).all()) and float(jnp.abs(u["w"]).max()) == 0.0
  assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
  assert new.inner_state.mu["w"].dtype == jnp.dtype(mu_dtype or "float32")
  g = {"w": jnp.ones((3, 16, 40))}
  _, s1 = step(g, state, params)
  state.hyperparams["beta"] = jnp.asarray(0.5)
  _, s2 = step(g, state, params)  # the momentum buffer sees the injected beta: (1 - beta) * g
  np.testing.assert_allclose(s1.inner_state.mu["w"], 0.1, rtol=1e-2)
  np.testing.assert_allclose(s2.inner_state.mu["w"], 0.5, rtol=1e-2)


def test_no_collective_inside_the_newton_schulz_loop():
  """On a mesh each device gathers whole matrices before the loop: a collective inside the loop body
  (GSPMD's default for a split matrix) costs traffic every step and deadlocked XLA:CPU on `small`."""
  import re
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  mf = lambda: models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0))
  tx = optim.muon(0.02)
  _, state, _ = sharding.init_train_state(mf, tx, mesh)
  with jax.set_mesh(mesh):
    hlo = jax.jit(tx.update).lower(state["params"], state["opt_state"], state["params"]).compile().as_text()
  bodies = set(re.findall(r"body=(%?[\w.\-]+)", hlo))
  assert bodies, "expected the Newton-Schulz while loops"
  computations = dict(re.findall(r"\n(%?[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
  for body in bodies:
    text = computations[body if body in computations else body.lstrip("%")]
    assert not re.search(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute", text), body
  assert "all-gather" in hlo  # the gathers happen, once, outside the loop
