"""BAdam: a float64 NumPy reference written from the paper's Algorithm 1 and the reference's bookkeeping
(Ledzy/BAdam `BlockOptimizer`: block order, switch after update n when (n+1) % K == 0, optimizer state cleared at
every switch), block orders, exact zeros off the active block, state bytes against AdamW, no recompilation across
switches, the optax contract and sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from sharded_steps import flat, unflat

import models
import optim
import sharding
from optim.badam import BAdamError, badam, badam_adamw, badam_labels, block_index

RNG = np.random.default_rng(0)
LR, B1, B2, EPS, WD = 0.05, 0.9, 0.95, 1e-8, 0.1


class RefSchedule:
  """The reference's block bookkeeping, one update at a time: __init__ switches once (the block becomes active and
  the index moves on), every update increments global_step and then switches if (global_step + 1) % K == 0."""

  def __init__(self, num_blocks, k, mode, start=None):
    self.d, self.k, self.mode, self.global_step = num_blocks, k, mode, 0
    self.current = start if start is not None else (num_blocks - 1 if mode == "descending" else 0)
    self.switch()

  def switch(self):
    self.active, self.reset = self.current, True
    step = {"ascending": 1, "descending": -1, "fixed": 0}[self.mode]
    self.current = (self.current + step) % self.d

  def after_update(self):
    self.global_step += 1
    if (self.global_step + 1) % self.k == 0:
      self.switch()


def np_badam(params, grad_fn, blocks, always, sched, steps):
  """Float64 BAdam with AdamW inside. params: {name: array}; a block is a list of (name, layer or None) pieces.

  At a switch m, v ← 0 and t ← 0. Each update: t ← t+1; for every piece of the active block and the always-active
  ones: m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², θ ← θ − lr·(m/(1−β1^t) / (√(v/(1−β2^t)) + ε) + wd·θ)
  (no decay on names containing "norm"). Returns the parameters after every update.
  """
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  out = []
  for step in range(steps):
    if sched.reset:
      m, v, t, sched.reset = {}, {}, 0, False
    g = grad_fn(step, p)
    t += 1
    for name, layer in blocks[sched.active] + always:
      ix = () if layer is None else (layer,)
      gi, key = g[name][ix], (name, layer)
      m[key] = B1 * m.get(key, 0.0) + (1 - B1) * gi
      v[key] = B2 * v.get(key, 0.0) + (1 - B2) * gi ** 2
      adam = (m[key] / (1 - B1 ** t)) / (np.sqrt(v[key] / (1 - B2 ** t)) + EPS)
      wd = 0.0 if "norm" in name.split("/")[-1] else WD
      p[name][ix] = p[name][ix] - LR * (adam + wd * p[name][ix])
    sched.after_update()
    out.append({k: x.copy() for k, x in p.items()})
  return out


STACKED = {"blocks": {"w_DF": (3, 4, 5), "attn_norm": (3, 4)}, "embed_VD": (6, 4), "head_DV": (4, 6),
           "final_norm": (4,)}
LOOSE = {"l0": {"w": (4, 5), "norm": (5,)}, "l1": {"w": (4, 5), "norm": (5,)}, "l2": {"w": (4, 5), "norm": (5,)},
         "out_DV": (5, 3), "extra": (2,)}
layer = lambda i: [("blocks/w_DF", i), ("blocks/attn_norm", i)]
loose = lambda i: [(f"l{i}/w", None), (f"l{i}/norm", None)]
CASES = {  # name: (shapes, badam kwargs, blocks in order, always-active pieces, order, K, start, steps)
    "layers_descending": (STACKED, {}, [layer(0), layer(1), layer(2)], [], "descending", 2, None, 7),
    "layers_embed_head_ascending": (
        STACKED, dict(include_embedding=True, include_head=True, always_active=("final_norm",)),
        [[("embed_VD", None)], layer(0), layer(1), layer(2), [("head_DV", None)]], [("final_norm", None)],
        "ascending", 2, None, 10),
    "label_fn_descending_from_1": (
        LOOSE, dict(blocks=lambda p: {"l0": {"w": 0, "norm": 0}, "l1": {"w": 1, "norm": 1},
                                      "l2": {"w": 2, "norm": "active"}, "out_DV": 3, "extra": "frozen"}),
        [loose(0), loose(1), [("l2/w", None)], [("out_DV", None)]], [("l2/norm", None)], "descending", 3, 1, 8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_badam_equals_float64_reference(case):
  shapes, kwargs, blocks, always, order, k, start, steps = CASES[case]
  params0 = jax.tree.map(lambda s: RNG.standard_normal(s), shapes, is_leaf=lambda x: isinstance(x, tuple))
  noise = [{n: RNG.standard_normal(x.shape) for n, x in flat(params0).items()} for _ in range(steps)]
  grad_fn = lambda t, p: {n: noise[t][n] + 0.5 * p[n] for n in p}  # a quadratic pull: updates feed back
  want = np_badam(flat(params0), grad_fn, blocks, always, RefSchedule(len(blocks), k, order, start), steps)
  sched = RefSchedule(len(blocks), k, order, start)
  with jax.enable_x64(True):
    tx = badam_adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, switch_every=k, order=order, start_block=start,
                     **{a: b for a, b in kwargs.items() if a != "blocks"})
    if "blocks" in kwargs:  # the same AdamW around a label_fn
      inner = optax.chain(optax.scale_by_adam(B1, B2, EPS), optax.add_decayed_weights(WD, optim.decay_mask))
      tx = optax.chain(badam(inner, blocks=kwargs["blocks"], switch_every=k, order=order, start_block=start),
                       optax.scale_by_learning_rate(LR))
    params = jax.tree.map(jnp.asarray, params0)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: (lambda u, s: (u, s, optax.apply_updates(p, u)))(*tx.update(g, s, p)))
    for t in range(steps):
      pieces = set(blocks[sched.active] + always)
      assert int(state[0].block) == sched.active
      updates, state, params = step(unflat(params, grad_fn(t, flat(params))), state, params)
      for name, u in flat(updates).items():  # exact zeros off the active block, frozen leaves included
        idle = [i for i in range(len(u)) if (name, i) not in pieces] if name.startswith("blocks/") else None
        if idle is not None:
          assert not u[idle].any(), (t, name)
        elif (name, None) not in pieces:
          assert not u.any(), (t, name)
      sched.after_update()
      got = flat(params)
      assert got["blocks/w_DF" if "blocks/w_DF" in got else "l0/w"].dtype == np.float64
      for name in got:
        np.testing.assert_allclose(got[name], want[t][name], rtol=0, atol=1e-12, err_msg=f"{case} step {t} {name}")
    if "extra" in got:
      np.testing.assert_array_equal(got["extra"], params0["extra"])


@pytest.mark.parametrize("num_blocks, k", [(1, 1), (3, 1), (3, 2), (4, 3), (5, 7)])
@pytest.mark.parametrize("order, start", [("descending", None), ("ascending", None), ("descending", 0),
                                          ("ascending", 2), ("fixed", 0)])
def test_block_index_follows_the_reference_bookkeeping(num_blocks, k, order, start):
  start = None if start is None else min(start, num_blocks - 1)
  sched, want = RefSchedule(num_blocks, k, order, start), []
  for _ in range(40):
    want.append(sched.active)
    sched.after_update()
  got = block_index(jnp.arange(40), num_blocks, switch_every=k, order=order, start_block=start)
  assert np.asarray(got).tolist() == want


def test_documented_orders_and_no_recompilation_across_switches():
  """D = 4 layers, K = 2: the first block runs one update (K − 1), every later one two; the step compiles once."""
  params = {"blocks": {"w": jnp.ones((4, 2, 3))}, "embed_VD": jnp.ones((5, 2))}
  grads = jax.tree.map(jnp.ones_like, params)
  want = {("descending", None): [3, 2, 2, 1, 1, 0, 0, 3, 3], ("ascending", None): [0, 1, 1, 2, 2, 3, 3, 0, 0],
          ("descending", 1): [1, 0, 0, 3, 3, 2, 2, 1, 1], ("fixed", 2): [2] * 9}
  for (order, start), seq in want.items():
    tx, traces = badam(optax.scale_by_adam(), switch_every=2, order=order, start_block=start), []

    def update(g, s, p, tx=tx, traces=traces):
      traces.append(1)  # runs once per trace, i.e. per compilation
      return tx.update(g, s, p)

    step, state, got, counts = jax.jit(update), tx.init(params), [], []
    for _ in range(9):
      got.append(int(state.block))
      u, state = step(grads, state, params)
      counts.append(int(state.inner_state.count))
      w = np.asarray(u["blocks"]["w"])
      assert w[got[-1]].all() and not np.delete(w, got[-1], 0).any()  # the active layer only
    assert got == seq, order
    assert counts == [0, 1, 0, 1, 0, 1, 0, 1, 0]  # Adam's bias-correction count restarts at every switch
    assert len(traces) == 1 and step._cache_size() == 1


def test_random_order_reshuffles_every_block_epoch():
  sequence = jax.jit(lambda k, seed: jax.vmap(lambda t: block_index(t, 4, switch_every=k, order="random",
                                                                    seed=seed))(jnp.arange(24)))
  draw = lambda n, k, seed: np.asarray(sequence(k, seed))[:n]  # switch_every and seed traced: one compile
  seqs = {s: draw(24, 1, s) for s in (0, 1)}
  for seq in seqs.values():
    epochs = seq.reshape(6, 4)
    assert all(sorted(e) == [0, 1, 2, 3] for e in epochs.tolist())  # every block once per block-epoch
    assert len({tuple(e) for e in epochs.tolist()}) > 1  # a fresh order each block-epoch
  assert not np.array_equal(seqs[0], seqs[1])
  np.testing.assert_array_equal(seqs[0], draw(24, 1, 0))
  k3 = draw(11, 3, 0)
  np.testing.assert_array_equal(k3, seqs[0][(np.arange(11) + 1) // 3])  # K updates per block (first: K − 1)


def tree_bytes(tree):
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ["small"])
def test_state_bytes_are_one_layer_against_adamw(name):
  cfg = models.preset(name)
  _, abstract, _ = sharding.logical_names(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  badam_bytes = tree_bytes(jax.eval_shape(optim.get_optimizer("badam", 1e-3).init, abstract))
  adamw_bytes = tree_bytes(jax.eval_shape(optim.get_optimizer("adamw", 1e-3).init, abstract))
  one_layer = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(abstract["blocks"]))
  assert one_layer * cfg.n_layers + cfg.vocab_size * cfg.d_model + cfg.d_model == models.count_params(cfg)
  assert badam_bytes == 2 * 4 * one_layer + 3 * 4  # m, v in fp32 for one layer; 3 int32 counters
  assert adamw_bytes == 2 * 4 * models.count_params(cfg) + 4
  assert badam_bytes / adamw_bytes < 0.25  # 0.245 on `small` (results/badam_state_bytes.md)


def test_label_fn_blocks_of_equal_structure_share_one_block_of_state():
  params = {f"l{i}": {"w": jnp.ones((8, 16)), "norm": jnp.ones((16,))} for i in range(5)}
  label = lambda p: {k: {"w": int(k[1:]), "norm": int(k[1:])} for k in p}
  state = jax.eval_shape(badam(optax.scale_by_adam(), blocks=label).init, params)
  assert tree_bytes(state) == 2 * 4 * (8 * 16 + 16) + 3 * 4


def test_labels_freeze_embedding_head_and_final_norm_by_default():
  model = nnx.eval_shape(lambda: models.Transformer(models.preset("tiny", tie_embeddings=False), rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(model))
  labels = badam_labels(params)
  assert labels["embed_VD"] == labels["head_DV"] == labels["final_norm"] == "frozen"
  assert set(labels["blocks"].values()) == {"layers"}
  labels = badam_labels(params, include_embedding=True, include_head=True, always_active=("q_norm",))
  assert (labels["embed_VD"], labels["head_DV"], labels["final_norm"]) == ("embedding", "head", "head")
  assert labels["blocks"]["q_norm"] == "active" and labels["blocks"]["wq_DQ"] == "layers"


@pytest.mark.parametrize("kwargs, params, match", [
    (dict(order="sideways"), None, "unknown BAdam order 'sideways'"),
    (dict(order="fixed"), None, "pass start_block"),
    (dict(order="random", start_block=1), None, "'random' draws every block-epoch"),
    (dict(switch_every=0), None, "switch_every must be a positive"),
    (dict(blocks="experts"), None, "blocks must be 'auto', 'layers', 'leaves' or a function"),
    (dict(blocks=lambda p: 0, include_head=True), {"w": jnp.ones(3)}, "give those leaves their own block id"),
    (dict(blocks=lambda p: {"w": "x"}), {"w": jnp.ones(3)}, "use a block id >= 0, 'active' or 'frozen'"),
    (dict(start_block=3), {"blocks": {"w": jnp.ones((3, 2))}}, "start_block=3 is outside the 3 blocks"),
    (dict(blocks="layers"), {"layers": {"w": jnp.ones((3, 2))}},
     "found no stacked leaves under 'blocks'; pass stacked="),
    ({}, {"blocks": {"w": jnp.ones((3, 2)), "v": jnp.ones((2, 2))}}, "share one leading .layer. axis"),
])
def test_bad_configurations_say_how_to_fix_them(kwargs, params, match):
  with pytest.raises(BAdamError, match=match) as err:
    badam(optax.scale_by_adam(), **kwargs).init(params)
  assert isinstance(err.value, ValueError)


def test_registry_cli_hyperparameters():
  hp = optim.hyperparameters("badam")
  assert (hp["b1"], hp["b2"], hp["switch_every"], hp["order"], hp["include_embedding"]) == (0.9, 0.95, 50,
                                                                                           "descending", False)
  with pytest.raises(optim.UnknownOptimizerError, match="'badam' has no hyperparameter switch_blocks"):
    optim.get_optimizer("badam", 1e-3, switch_blocks=3)
  tx = optim.get_optimizer("badam", 1e-3, switch_every=20, always_active=["final_norm"])  # as `--opt` parses JSON
  params = jax.tree.map(jnp.ones, STACKED, is_leaf=lambda x: isinstance(x, tuple))
  assert tx.init(params)[0].block == 2  # 3 layers, the last first
  u, _ = jax.jit(tx.update)(params, tx.init(params), params)
  assert u["final_norm"].all() and not u["embed_VD"].any()


# --- the optax contract


def test_jit_inject_hyperparams_dtypes_and_zero_gradients():
  params = {"blocks": {"w_up_DF": jnp.asarray(RNG.standard_normal((2, 8, 16)), jnp.float32),
                       "mlp_norm": jnp.ones((2, 8))}, "embed_VD": jnp.ones((16, 8)), "final_norm": jnp.ones((8,))}
  tx = optax.inject_hyperparams(badam_adamw)(learning_rate=0.02, switch_every=2, weight_decay=0.1)
  state = tx.init(params)
  step = jax.jit(tx.update)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, new = step(zeros, state, params)
  assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
  spec = lambda s: jax.tree.map(lambda a: (a.shape, a.dtype), s)
  assert spec(new) == spec(state)
  grads = jax.tree.map(jnp.ones_like, params)
  u1, s1 = step(grads, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.04)
  u2, _ = step(grads, state, params)
  np.testing.assert_allclose(u2["blocks"]["w_up_DF"], 2 * u1["blocks"]["w_up_DF"], rtol=1e-6)
  assert float(jnp.abs(u1["blocks"]["w_up_DF"][1]).min()) > 0 and not u1["blocks"]["w_up_DF"][0].any()
  _, s2 = step(grads, s1, params)  # an injected (traced) switch_every still switches: block 1, then 0, 0
  assert (int(s1.inner_state[0].block), int(s2.inner_state[0].block)) == (0, 0)


def test_sharded_updates_equal_unsharded_and_keep_shardings():
  tx = badam_adamw(0.02, switch_every=2)
  grads = lambda p, k: jax.tree.map(lambda x: jnp.sin(x * (k + 1)), p)
  mesh = sharding.make_mesh("fsdp=4,tensor=2")
  _, abstract, names = sharding.logical_names(lambda: models.Transformer(models.preset("tiny"), rngs=nnx.Rngs(0)))
  p_sh = sharding.param_shardings(abstract, names, mesh)  # the model's parameter shardings, no model compiled
  host = jax.tree.map(lambda a: RNG.standard_normal(a.shape).astype(a.dtype), abstract)

  def update(params, opt_state, k):
    u, opt_state = tx.update(grads(params, k), opt_state, params)
    return u, optax.apply_updates(params, u), opt_state

  def run(params, init):
    step, opt_state = jax.jit(update), init(params)
    for k in range(4):  # blocks 1, 0, 0, 1: two switches
      u, params, opt_state = step(params, opt_state, k)
    return u, params, opt_state

  p_ref = run(host, tx.init)[1]  # one device, no mesh
  # the library's rule: a layer's moments take the spec of the weight's trailing dimensions
  o_sh = sharding.shardings_like_params(jax.eval_shape(tx.init, abstract), abstract, p_sh, mesh)
  with jax.set_mesh(mesh):
    u, params, opt_state = run(jax.device_put(host, p_sh), jax.jit(tx.init, out_shardings=o_sh))
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(params)):
    assert a.sharding.is_equivalent_to(b.sharding, b.ndim)
  for a, s in zip(jax.tree.leaves(opt_state), jax.tree.leaves(o_sh)):
    assert a.sharding.is_equivalent_to(s, a.ndim)
  mu = opt_state[0].inner_state[0].mu["params"]["blocks"]["w_up_DF"]
  assert mu.shape == (64, 128) and mu.sharding.spec == P("fsdp", "tensor")  # one layer, split like the weight
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), params, p_ref)
