"""BREAD: a float64 NumPy reference written from the algorithm (optim/bread.py's docstring: BAdam's block loop and
AdamW restarts, plus SGD steps or LoRA-factor AdamW steps on the inactive blocks in reach, W = W_base + s·A B kept
merged), both modes over several block switches; BAdam exactly when the inactive learning rate is 0; the factors'
initialisation; state bytes against BAdam and AdamW; the optax contract and sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from sharded_steps import flat, run_steps, sine_grads, unflat

import models
import optim
import sharding
from optim.badam import badam_adamw
from optim.bread import BreadError, bread_adamw
from optim.trees import tree_bytes

RNG = np.random.default_rng(0)
LR, B1, B2, EPS, WD = 0.05, 0.9, 0.95, 1e-8, 0.1


def ref_schedule(num_blocks, k, order, steps):
  """(active block, whether the optimizer state was just cleared) for each update, by the reference's bookkeeping:
  the first block is the last (descending) or 0 (ascending); after its n-th update (n counted from 1) the optimizer
  switches to the next block and clears its state when (n + 1) % K == 0."""
  current, reset, out = num_blocks - 1 if order == "descending" else 0, True, []
  for n in range(1, steps + 1):
    out.append((current, reset))
    reset = False
    if (n + 1) % k == 0:
      current, reset = (current + (1 if order == "ascending" else -1)) % num_blocks, True
  return out


def adamw_step(x, g, key, m, v, t, lr, decay):
  """One AdamW step of x (m, v: dicts of moments by key; t: updates since the last reset, this one included)."""
  m[key] = B1 * m.get(key, 0.0) + (1 - B1) * g
  v[key] = B2 * v.get(key, 0.0) + (1 - B2) * g ** 2
  adam = (m[key] / (1 - B1 ** t)) / (np.sqrt(v[key] / (1 - B2 ** t)) + EPS)
  return x - lr * (adam + (WD * x if decay else 0.0))


def np_bread(params, grad_fn, blocks, always, schedule, mode, reach, ratio, sign=False, rank=None, alpha=None,
             a0=None):
  """Float64 BREAD with AdamW inside. params: {name: array}; a block is a list of (name, layer or None) pieces, in
  depth order. Each update, from the gradient g at the current parameters:
    active block and always-active pieces: AdamW (lr LR, decay except on norms), moments and t cleared at a switch;
    each block b in reach (b > active, or b ≠ active), every piece:
      sgd:      θ ← θ − ratio·LR·g (sign(g) with `sign`)
      lowrank:  matrices only: g_A = s·G Bᵀ, g_B = s·Aᵀ G (s = alpha/rank); A, B ← AdamW with lr ratio·LR (decayed,
                moments cleared with the others); W ← W + s·(A'B' − AB). A starts at a0[piece], B at 0.
  Returns the parameters after every update."""
  p = {k: np.array(x, np.float64) for k, x in params.items()}
  fac = {piece: (np.array(a, np.float64), np.zeros((rank, p[piece[0]].shape[-1]))) for piece, a in (a0 or {}).items()}
  s = None if rank is None else alpha / rank
  out = []
  for active, reset in schedule:
    if reset:
      m, v, t = {}, {}, 0
    g = grad_fn(len(out), p)
    t += 1
    new = {k: x.copy() for k, x in p.items()}
    for name, layer in blocks[active] + always:
      ix = () if layer is None else (layer,)
      new[name][ix] = adamw_step(p[name][ix], g[name][ix], (name, layer), m, v, t, LR, "norm" not in name)
    for b in range(len(blocks)):
      if not (b > active if reach == "deeper" else b != active):
        continue
      for name, layer in blocks[b]:
        ix = () if layer is None else (layer,)
        gi = g[name][ix]
        if mode == "sgd":
          new[name][ix] = p[name][ix] - ratio * LR * (np.sign(gi) if sign else gi)
        elif gi.ndim == 2:
          a, bb = fac[(name, layer)]
          a2 = adamw_step(a, s * gi @ bb.T, (name, layer, "A"), m, v, t, ratio * LR, True)
          b2 = adamw_step(bb, s * a.T @ gi, (name, layer, "B"), m, v, t, ratio * LR, True)
          new[name][ix] = p[name][ix] + s * (a2 @ b2 - a @ bb)
          fac[(name, layer)] = (a2, b2)
    p = new
    out.append({k: x.copy() for k, x in p.items()})
  return out


SHAPES = {"blocks": {"w_DF": (3, 4, 5), "attn_norm": (3, 4)}, "embed_VD": (6, 4), "head_DV": (4, 6),
          "final_norm": (4,)}
layer = lambda i: [("blocks/w_DF", i), ("blocks/attn_norm", i)]
EMBED, HEAD = [("embed_VD", None)], [("head_DV", None)]
FULL = dict(include_embedding=True, include_head=True, always_active=("final_norm",))
CASES = {  # name: (bread kwargs, blocks in depth order, always-active pieces, order, K, steps)
    "sgd_deeper_descending": (dict(mode="sgd", inactive_lr_ratio=3.0, **FULL),
                              [EMBED, layer(0), layer(1), layer(2), HEAD], [("final_norm", None)], "descending", 2, 11),
    "sgd_sign_all_ascending": (dict(mode="sgd", inactive_lr_ratio=0.5, sgd_sign=True, reach="all", include_head=True),
                               [layer(0), layer(1), layer(2), HEAD + [("final_norm", None)]], [], "ascending", 3,
                               10),
    "lowrank_deeper_descending": (dict(mode="lowrank", rank=2, alpha=3.0, inactive_lr_ratio=2.0, **FULL),
                                  [EMBED, layer(0), layer(1), layer(2), HEAD], [("final_norm", None)], "descending",
                                  2, 11),
    "lowrank_all_ascending": (dict(mode="lowrank", rank=3, alpha=6.0, reach="all", include_embedding=True),
                              [EMBED, layer(0), layer(1), layer(2)], [], "ascending", 3, 12),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bread_equals_float64_reference(case):
  kwargs, blocks, always, order, k, steps = CASES[case]
  params0 = jax.tree.map(lambda s: RNG.standard_normal(s), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  noise = [{n: RNG.standard_normal(x.shape) for n, x in flat(params0).items()} for _ in range(steps)]
  grad_fn = lambda t, p: {n: noise[t][n] + 0.5 * p[n] for n in p}  # a quadratic pull: updates feed back
  schedule = ref_schedule(len(blocks), k, order, steps)
  assert sum(r for _, r in schedule) >= 3  # the first block and at least two switches
  with jax.enable_x64(True):
    tx = bread_adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, switch_every=k, order=order, **kwargs)
    params = jax.tree.map(jnp.asarray, params0)
    state = tx.init(params)
    reach = kwargs.get("reach", "deeper")
    a0 = None
    if kwargs["mode"] == "lowrank":  # the initial A is a choice (tested below); the reference starts from it
      p0 = flat(params0)
      factored = [(n, i) for b in (blocks[1:] if reach == "deeper" else blocks) for n, i in b
                  if p0[n].ndim - (i is not None) == 2]
      assert set(state.factors) == {n for n, _ in factored}
      lo = 1 if reach == "deeper" and blocks[0] == layer(0) else 0  # the first block never is in reach
      a0 = {(n, i): np.asarray(state.factors[n]["a_IR"])[() if i is None else (i - lo,)] for n, i in factored}
      assert all(not np.asarray(f["b_RO"]).any() for f in state.factors.values())
    want = np_bread(flat(params0), grad_fn, blocks, always, schedule, kwargs["mode"], reach,
                    kwargs.get("inactive_lr_ratio", 1.0), kwargs.get("sgd_sign", False), kwargs.get("rank"),
                    kwargs.get("alpha"), a0)
    step = jax.jit(lambda g, s, p: (lambda u, s: (u, s, optax.apply_updates(p, u)))(*tx.update(g, s, p)))
    for t, (active, _) in enumerate(schedule):
      assert int(state.badam.block) == active
      updates, state, params = step(unflat(params, grad_fn(t, flat(params))), state, params)
      moving = {piece for piece in blocks[active] + always}
      for b in [b for b in range(len(blocks)) if (b > active if reach == "deeper" else b != active)]:
        # in low-rank mode the vectors of blocks in reach stay fixed
        moving |= {pc for pc in blocks[b] if kwargs["mode"] == "sgd" or pc[0] != "blocks/attn_norm"}
      for name, u in flat(updates).items():  # exact zeros everywhere else, frozen leaves included
        if name.startswith("blocks/"):
          assert not u[[i for i in range(3) if (name, i) not in moving]].any(), (t, name)
        elif (name, None) not in moving:
          assert not u.any(), (t, name)
      got = flat(params)
      assert got["blocks/w_DF"].dtype == np.float64
      for name in got:
        np.testing.assert_allclose(got[name], want[t][name], rtol=0, atol=1e-12, err_msg=f"{case} step {t} {name}")
    frozen = [n for n in ("head_DV", "final_norm", "embed_VD") if not any(n == pc[0] for b in blocks + [always]
                                                                         for pc in b)]
    for name in frozen:
      np.testing.assert_array_equal(got[name], flat(params0)[name])


@pytest.mark.parametrize("mode", ["sgd", "lowrank"])
def test_inactive_lr_ratio_zero_is_badam_exactly(mode):
  params = jax.tree.map(lambda s: jnp.asarray(RNG.standard_normal(s), jnp.float32), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))
  kw = dict(switch_every=2, include_embedding=True, include_head=True)
  runs = []
  for tx in (bread_adamw(0.05, mode=mode, inactive_lr_ratio=0.0, **kw), badam_adamw(0.05, **kw),
             bread_adamw(0.05, mode=mode, inactive_lr_ratio=1.0, **kw)):
    p, state, step, out = params, tx.init(params), jax.jit(tx.update), []
    for k in range(8):  # blocks 4, 3, 3, 2, 2, 1, 1, 0: four switches
      u, state = step(jax.tree.map(lambda x, k=k: jnp.sin(3.0 * x * (k + 1)), p), state, p)
      p = optax.apply_updates(p, u)
      out.append(p)
    runs.append(out)
  for a, b in zip(runs[0], runs[1]):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(runs[2][-1]["head_DV"], runs[1][-1]["head_DV"])  # and a ratio > 0 is not BAdam


def test_factor_initialisation():
  """A ~ U(±1/√fan_in) (PEFT's kaiming-uniform), B = 0, f32 for bf16 weights, keyed by `seed`; under "deeper" layer
  0 (the first block) has none, under "all" it has."""
  params = {"blocks": {"w_DF": jnp.ones((4, 64, 32), jnp.bfloat16), "norm": jnp.ones((4, 64))}}
  deeper = bread_adamw(1e-3, rank=16).init(params).factors
  assert set(deeper) == {"blocks/w_DF"}
  a, b = deeper["blocks/w_DF"]["a_IR"], deeper["blocks/w_DF"]["b_RO"]
  assert a.shape == (3, 64, 16) and b.shape == (3, 16, 32) and a.dtype == b.dtype == jnp.float32
  assert not b.any() and float(jnp.abs(a).max()) <= 1 / 8 and float(jnp.abs(a).max()) > 0.95 / 8
  assert abs(float(a.mean())) < 0.01 and float(a.std()) == pytest.approx(1 / 8 / np.sqrt(3), rel=0.05)
  assert bread_adamw(1e-3, rank=16, reach="all").init(params).factors["blocks/w_DF"]["a_IR"].shape == (4, 64, 16)
  other = bread_adamw(1e-3, rank=16, seed=1).init(params).factors["blocks/w_DF"]["a_IR"]
  assert not np.array_equal(a, other)
  assert bread_adamw(1e-3, mode="sgd").init(params).factors == ()


@pytest.mark.parametrize("name", ["small"])
def test_state_bytes_against_badam_and_adamw(name):
  """`small` (4 layers, d 256, ff 768, tied 256-token embedding): AdamW 27,805,700 B; BAdam and BREAD-SGD
  6,819,852 B (0.245×); BREAD (r = 8, deeper) 8,294,416 B (0.298× AdamW, 1.216× BAdam): + factors A, B and their
  two moments, 3·r·(m + n) f32 per matrix for the 3 layers that can be in reach, and one count."""
  cfg = models.preset(name)
  _, abstract, _ = sharding.logical_names(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  nbytes = lambda opt, **kw: tree_bytes(jax.eval_shape(optim.get_optimizer(opt, 1e-3, **kw).init, abstract))
  adamw, badam, sgd, lowrank = nbytes("adamw"), nbytes("badam"), nbytes("bread", mode="sgd"), nbytes("bread")
  matrices = [x.shape for x in jax.tree.leaves(abstract["blocks"]) if x.ndim == 3]
  factor_numbers = sum((L - 1) * 8 * (m + n) for L, m, n in matrices)
  assert sgd == badam
  assert lowrank == badam + 3 * 4 * factor_numbers + 4
  assert (adamw, badam, lowrank) == (27_805_700, 6_819_852, 8_294_416)
  assert lowrank / adamw < 0.3


def test_jit_compiles_once_and_state_is_stable_across_switches():
  """bf16 weights (f32 factors), K = 2 over 7 updates: the jitted step compiles once, the state keeps its shapes
  and dtypes, and zero gradients give finite updates."""
  params = {"blocks": {"w_up_DF": jnp.asarray(RNG.standard_normal((3, 8, 16)), jnp.bfloat16),
                       "mlp_norm": jnp.ones((3, 8), jnp.bfloat16)},
            "embed_VD": jnp.ones((16, 8), jnp.bfloat16), "final_norm": jnp.ones((8,), jnp.bfloat16)}
  spec = lambda s: jax.tree.map(lambda a: (a.shape, a.dtype), s)
  for mode in ("sgd", "lowrank"):
    tx, traces = bread_adamw(0.02, mode=mode, switch_every=2, include_embedding=True), []

    def update(g, s, p, tx=tx, traces=traces):
      traces.append(1)
      return tx.update(g, s, p)

    step, state = jax.jit(update), tx.init(params)
    first = spec(state)
    for k in range(7):
      u, state = step(jax.tree.map(lambda x, k=k: jnp.cos(x * (k + 1)), params), state, params)
      assert spec(state) == first and spec(u) == spec(params)
      params = optax.apply_updates(params, u)
    assert len(traces) == 1 and step._cache_size() == 1
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = step(zeros, state, params)
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in jax.tree.leaves(u))


@pytest.mark.parametrize("mode", ["sgd", "lowrank"])
def test_inject_hyperparams(mode):
  """inject_hyperparams (rank static, as in STATIC_ARGS) gives the plain factory's updates over switches, and a
  changed injected learning rate or ratio gives the plain factory's update at those values."""
  params = {"blocks": {"w_up_DF": jnp.asarray(RNG.standard_normal((3, 8, 16)), jnp.float32),
                       "mlp_norm": jnp.ones((3, 8))}, "head_DV": jnp.ones((8, 16))}
  kw = dict(mode=mode, switch_every=2, include_head=True, weight_decay=0.1, inactive_lr_ratio=2.0, alpha=4.0)
  plain = lambda **o: bread_adamw(**{"learning_rate": 0.02, **kw, **o})
  tx = optax.inject_hyperparams(bread_adamw, static_args=("rank",))(learning_rate=0.02, rank=8, **kw)
  ref = plain(rank=8)
  s_inj, s_ref = jax.jit(tx.init)(params), ref.init(params)
  grads = lambda k: jax.tree.map(lambda x: jnp.sin(x * (k + 1)), params)
  for k in range(5):
    u_inj, s_inj = jax.jit(tx.update)(grads(k), s_inj, params)
    u_ref, s_ref = jax.jit(ref.update)(grads(k), s_ref, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), u_inj, u_ref)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), s_inj.inner_state, s_ref)
  s_inj.hyperparams["learning_rate"] = jnp.asarray(0.05)
  s_inj.hyperparams["inactive_lr_ratio"] = jnp.asarray(0.5)
  u_inj, _ = jax.jit(tx.update)(grads(5), s_inj, params)
  u_ref, _ = plain(learning_rate=0.05, inactive_lr_ratio=0.5).update(grads(5), s_ref, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), u_inj, u_ref)
  assert float(jnp.abs(u_inj["head_DV"]).max()) > 0  # layer 0 active: the head is in reach


@pytest.mark.parametrize("mode", ["sgd", "lowrank"])
def test_sharded_updates_equal_unsharded_and_keep_shardings(mode):
  tx = bread_adamw(0.02, mode=mode, switch_every=2)
  grads = lambda p, k: jax.tree.map(lambda x: jnp.sin(x * (k + 1)), p)
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  _, abstract, names = sharding.logical_names(lambda: models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0)))
  p_sh = sharding.param_shardings(abstract, names, mesh)
  host = jax.tree.map(lambda a: RNG.standard_normal(a.shape).astype(a.dtype), abstract)

  def update(params, opt_state, k):
    u, opt_state = tx.update(grads(params, k), opt_state, params)
    return u, optax.apply_updates(params, u), opt_state

  def run(params, init):
    step, opt_state, us = jax.jit(update), init(params), []
    for k in range(5):  # tiny has 2 layers: layer 1; layer 0 twice (layer 1 in reach); layer 1 twice: two switches
      u, params, opt_state = step(params, opt_state, k)
      us.append(u)
    return us, params, opt_state

  u_ref, p_ref, _ = run(host, tx.init)
  o_sh = sharding.shardings_like_params(jax.eval_shape(tx.init, abstract), abstract, p_sh, mesh)
  with jax.set_mesh(mesh):
    us, params, opt_state = run(jax.device_put(host, p_sh), jax.jit(tx.init, out_shardings=o_sh))
  for u in us:
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(params)):
      assert a.sharding.is_equivalent_to(b.sharding, b.ndim)
  for a, s in zip(jax.tree.leaves(opt_state), jax.tree.leaves(o_sh)):
    assert a.sharding.is_equivalent_to(s, a.ndim)
  moved = np.asarray(u_ref[2]["blocks"]["w_up_DF"])
  assert np.abs(moved).max(axis=(1, 2)).min() > 0  # layer 0 active, layer 1 in reach
  assert not np.asarray(u_ref[4]["blocks"]["w_up_DF"])[0].any()  # layer 1 active: nothing deeper
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), params, p_ref)


@pytest.mark.parametrize("mode", ["sgd", "lowrank"])
def test_explicit_axes_sharded_equals_single_device(mode):
  """Explicit mesh axes: 3 stacked layers (w split on both sides) and a frozen embedding, K = 1, layers 2, 1, 0 in
  turn, so the last step has both others in reach; the state keeps its dtypes and shardings (run_steps), updates
  keep the parameters'. (Whole-leaf blocks are left out: BAdam's slot gather does not trace on Explicit axes.)"""
  rng = np.random.default_rng(3)
  params = {"blocks": {"w": jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32), "norm": jnp.ones((3, 8))},
            "embed_VD": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}
  specs = {"blocks": {"w": P(None, "fsdp", "tensor"), "norm": P(None, "tensor")}, "embed_VD": P("tensor", "fsdp")}
  tx = bread_adamw(0.02, mode=mode, switch_every=1)
  grads = sine_grads(params, 3)
  _, single, _ = run_steps(tx, params, grads)
  mesh = sharding.make_mesh("fsdp=4,tensor=2", explicit=True)
  put = lambda t: jax.tree.map(lambda x, p: jax.device_put(x, jax.sharding.NamedSharding(mesh, p)), t, specs)
  with jax.set_mesh(mesh):
    u, sharded, _ = run_steps(tx, put(params), [put(g) for g in grads])
  for x, y, spec in zip(jax.tree.leaves(u), jax.tree.leaves(sharded), jax.tree.leaves(specs)):
    assert x.sharding.spec == spec and y.sharding.spec == spec
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6),
               sharded, single)
  assert np.abs(np.asarray(u["blocks"]["w"])).max(axis=(1, 2)).min() > 0  # layer 0 active, 1 and 2 in reach


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="lora"), "unknown BREAD mode 'lora'"),
    (dict(reach="shallower"), "unknown BREAD reach 'shallower'"),
    (dict(rank=0), "rank must be a positive integer"),
    (dict(inactive_lr_ratio=-1.0), "inactive_lr_ratio must be >= 0"),
    (dict(order="sideways"), "unknown BAdam order"),
])
def test_bad_configurations_are_refused(kwargs, match):
  with pytest.raises(BreadError if "BAdam" not in match else optim.BAdamError, match=match):
    bread_adamw(1e-3, **kwargs)


def test_registry_cli_hyperparameters():
  hp = optim.hyperparameters("bread")
  assert (hp["mode"], hp["rank"], hp["alpha"], hp["inactive_lr_ratio"], hp["reach"]) == ("lowrank", 8, 16.0, 1.0,
                                                                                          "deeper")
  assert (hp["b1"], hp["b2"], hp["switch_every"], hp["order"]) == (0.9, 0.95, 50, "descending")
  assert "rank" in optim.registry.STATIC_ARGS
  tx = optim.get_optimizer("bread", 1e-3, mode="sgd", switch_every=20, always_active=["final_norm"])
  params = jax.tree.map(jnp.ones, SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  u, _ = jax.jit(tx.update)(params, tx.init(params), params)
  assert u["final_norm"].all() and not u["embed_VD"].any() and not u["head_DV"].any()
