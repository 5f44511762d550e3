"""BAdam against the `badam` package (Ledzy/BAdam 1.4, `badam.BlockOptimizer` wrapping torch.optim.AdamW) as an
installed oracle: the parameters of a tiny torch model after every step, for several block switches.

What the package does (read from its block_optim.py; the facts the tests below rely on are asserted in
`test_package_facts`):
  * blocks: by default one per "layers.<i>." prefix (regex on parameter names), plus an "embed…" block first if
    include_embedding and one last block of every remaining parameter if include_lm_head; `active_modules`
    (substrings) train at every step.
  * at a switch (once in __init__, then after update n when (n + 1) % switch_block_every == 0) it sets requires_grad
    on the new block only, makes fresh float32 master copies of its parameters (`clone().float()`), rebuilds the
    wrapped optimizer's param_groups over them and replaces its state by an empty dict: Adam's m, v and step count
    restart. Each step copies the gradients to the masters (`.float()`), steps, copies the masters back.
  * orders: descending (default, from the last block), ascending, fixed (needs start_block), random (a
    torch.randperm per block-epoch, popped from its end).

Because of the float32 masters the oracle computes in float32 whatever the model's dtype, so both sides run in
float32. Gradients: each step torch computes the loss's gradient w.r.t. every parameter at the package's current
parameters; the package runs its own backward (through the frozen layers, into the active block only) and ours gets
those very numbers for the active block and the full gradient elsewhere, which it must ignore. (Each side
differentiating its own float32 copy does not isolate the optimizer: Adam divides by |g|, and entries with |g| ~ 1e-4
computed by two float32 graphs differ by ~1e-3 relative, which moved a parameter 2e-5 apart within two steps.)

Where the package and ours differ (`test_package_facts` pins the package's side; the trajectories compare the rest):
  * weight decay reaches every active parameter: its no-decay group {"weight_decay": 0.0, **defaults} is overwritten
    by the defaults' weight_decay, and its LayerNorm test looks at tensors, never modules. So the JAX side decays
    every leaf (mask all True) instead of the house `decay_mask` (no decay on norms and biases).
  * include_lm_head without include_embedding puts the embedding into the last ("lm_head and others") block: its
    embed test only applies when include_embedding. optim.badam freezes the embedding then; that grouping is
    compared through a label_fn that reproduces it.
  * random order: the streams (torch.randperm on torch's global generator vs jax.random.permutation keyed by
    (seed, block-epoch)) cannot be made to agree, so only the shared contract is compared: switch timing and one
    permutation of the blocks per block-epoch.
"""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from badam import BlockOptimizer, block_optim

from optim.badam import badam, badam_adamw, block_index

V, D, L, B = 7, 5, 3, 6  # vocabulary, width, layers, batch
LR, B1, B2, EPS, WD = 2e-2, 0.9, 0.999, 1e-8, 0.1
# Float32 on both sides (the package's masters are float32), the same gradients: what differs is the rounding of
# the update, p·(1 − lr·wd) then p − (lr/bc1)·m/(√v/√bc2 + eps) there, p − lr·(m̂/(√v̂ + eps) + wd·p) here, about one
# ulp (1.2e-7 for |p| in [1, 2)) per step on a parameter; ≤ 10 steps on any one parameter here (measured max 1.1e-6).
# A wrong bias correction, a missed reset or a wrong block moves entries by ~LR = 2e-2.
ATOL = 2e-6
ALL = lambda tree: jax.tree.map(lambda _: True, tree)  # the package's decay: every trained parameter


class Norm(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.zeros(D))


class Layer(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.zeros(D, D))  # (in, out), as on the JAX side: h @ weight
    self.bias = torch.nn.Parameter(torch.zeros(D))
    self.norm = Norm()


class Table(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.zeros(V, D))


class Net(torch.nn.Module):
  """embed_tokens.weight, layers.<i>.{weight, bias, norm.weight}, final_norm.weight, lm_head.weight (this order)."""

  def __init__(self, dtype=torch.float32):
    super().__init__()
    self.embed_tokens, self.layers = Table(), torch.nn.ModuleList(Layer() for _ in range(L))
    self.final_norm, self.lm_head = Norm(), Table()
    self.to(dtype)

  def forward(self, ids, targets):
    rms = lambda h: h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6)
    h = self.embed_tokens.weight[ids]
    for layer in self.layers:
      h = h + torch.tanh((rms(h) * layer.norm.weight) @ layer.weight + layer.bias)
    logits = (rms(h) * self.final_norm.weight) @ self.lm_head.weight.T
    return torch.nn.functional.cross_entropy(logits, targets)


def full_grads(net, ids, targets):
  """The loss's gradient w.r.t. EVERY parameter at the net's current values (torch.func: requires_grad ignored)."""
  params = {n: p.detach().clone() for n, p in net.named_parameters()}
  return torch.func.grad(lambda ps: torch.func.functional_call(net, ps, (ids, targets)))(params)


# Torch name -> (path in the JAX tree, layer index on the stacked axis or None), for the two JAX layouts.
OTHERS = {"embed_tokens.weight": (("embed",), None), "final_norm.weight": (("final_norm",), None),
          "lm_head.weight": (("lm_head",), None)}
STACKED = OTHERS | {f"layers.{i}.{t}": (("blocks", j), i) for i in range(L)
                    for t, j in (("weight", "w"), ("bias", "b"), ("norm.weight", "norm"))}
LOOSE = OTHERS | {f"layers.{i}.{t}": ((f"l{i}", j), None) for i in range(L)
                  for t, j in (("weight", "w"), ("bias", "b"), ("norm.weight", "norm"))}


def to_jax(named, mapping):
  tree = {}
  for name, (path, i) in mapping.items():
    node = tree
    for k in path[:-1]:
      node = node.setdefault(k, {})
    if i is None:
      node[path[-1]] = named[name]
    else:
      node.setdefault(path[-1], [None] * L)[i] = named[name]
  return jax.tree.map(lambda x: jnp.asarray(np.stack(x) if isinstance(x, list) else x, jnp.float32), tree,
                      is_leaf=lambda x: isinstance(x, list))


def from_jax(tree, mapping):
  def get(path, i):
    x = tree
    for k in path:
      x = x[k]
    return np.asarray(x if i is None else x[i])
  return {name: get(path, i) for name, (path, i) in mapping.items()}


def init_named(seed):
  rng = np.random.default_rng(seed)
  return {n: (1.0 + 0.1 * rng.standard_normal(D) if "norm" in n else 0.5 * rng.standard_normal(s)).astype(np.float32)
          for n, s in [("embed_tokens.weight", (V, D)), ("final_norm.weight", (D,)), ("lm_head.weight", (V, D))]
          + [(f"layers.{i}.{t}", s) for i in range(L)
             for t, s in (("weight", (D, D)), ("bias", (D,)), ("norm.weight", (D,)))]}


@pytest.fixture(autouse=True)
def no_gc_at_switch(monkeypatch):
  """The package calls gc.collect() at every switch (memory housekeeping): ~0.7 s each in a process holding JAX."""
  monkeypatch.setattr(block_optim, "gc", types.SimpleNamespace(collect=lambda: 0))


def make_block_optimizer(named, schedule=None, dtype=torch.float32, **kwargs):
  """Net with `named` weights, its BlockOptimizer around AdamW, and an optional LambdaLR on the BlockOptimizer."""
  net = Net(dtype)
  with torch.no_grad():
    for n, p in net.named_parameters():
      p.copy_(torch.from_numpy(named[n]))
  adamw = torch.optim.AdamW(net.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="BAdam expect model")  # its fp16/bf16 advice: float32 on purpose
    opt = BlockOptimizer(adamw, list(net.named_parameters()), verbose=0, **kwargs)
  sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, lambda t: schedule(t) / LR)
  return net, opt, sched


def batches(seed, steps):
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, V, B), rng.integers(0, V, B)) for _ in range(steps)]


CASES = {  # name: (package kwargs, JAX layout, JAX transform's kwargs or a label_fn case, steps, LR schedule)
    "descending_layers": (dict(switch_block_every=2), STACKED, dict(switch_every=2), 9, None),
    "ascending_layers_schedule": (dict(switch_block_every=2, switch_mode="ascending"), STACKED,
                                  dict(switch_every=2, order="ascending"), 9, lambda t: LR * (1 - t / 16)),
    "ascending_embedding_head": (dict(switch_block_every=3, switch_mode="ascending", include_embedding=True,
                                      include_lm_head=True), STACKED,
                                 dict(switch_every=3, order="ascending", include_embedding=True, include_head=True),
                                 14, None),
    "descending_from_1_embedding_active_norm": (
        dict(switch_block_every=2, start_block=1, include_embedding=True, active_modules=["final_norm"]), STACKED,
        dict(switch_every=2, start_block=1, include_embedding=True, always_active=("final_norm",)), 10, None),
    "fixed_block_resets_anyway": (dict(switch_block_every=3, switch_mode="fixed", start_block=2), STACKED,
                                  dict(switch_every=3, order="fixed", start_block=2), 8, None),
    "every_step_k1": (dict(switch_block_every=1), STACKED, dict(switch_every=1), 7, None),
    # include_lm_head alone: the package's last block is lm_head, final_norm AND the embedding (see the docstring)
    "head_block_with_embedding_label_fn": (dict(switch_block_every=2, include_lm_head=True), LOOSE,
                                           "label_fn", 11, None),
}


def jax_transform(spec, schedule):
  lr = LR if schedule is None else schedule
  if spec != "label_fn":
    return badam_adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=ALL, **spec)
  labels = lambda p: {"embed": L, "final_norm": L, "lm_head": L} | {f"l{i}": {"w": i, "b": i, "norm": i}
                                                                     for i in range(L)}
  inner = optax.chain(optax.scale_by_adam(B1, B2, EPS), optax.add_decayed_weights(WD, ALL))
  return optax.chain(badam(inner, blocks=labels, switch_every=2), optax.scale_by_learning_rate(lr))


@pytest.mark.parametrize("case", sorted(CASES))
def test_badam_equals_badam_package(case):
  pkg_kwargs, mapping, spec, steps, schedule = CASES[case]
  named0, data = init_named(1), batches(2, steps)
  net, opt, sched = make_block_optimizer(named0, schedule, **pkg_kwargs)
  tx = jax_transform(spec, schedule)
  params = to_jax(named0, mapping)
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  prev, prev_got = dict(named0), dict(named0)
  for t, (ids, targets) in enumerate(data):
    ids, targets = torch.from_numpy(ids), torch.from_numpy(targets)
    grads = full_grads(net, ids, targets)
    net(ids, targets).backward()  # the package's own backward: the active block only
    for n, p in net.named_parameters():
      assert (p.grad is not None) == p.requires_grad, (case, t, n)
      if p.grad is not None:  # ours sees the very numbers the package steps with
        grads[n] = p.grad.clone()
    params, state = step(params, state, to_jax({n: g.numpy() for n, g in grads.items()}, mapping))
    opt.step()
    if sched is not None:
      sched.step()
    got = from_jax(params, mapping)
    want = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    assert all(x.dtype == np.float32 for x in [*got.values(), *want.values()])
    for n in want:
      np.testing.assert_allclose(got[n], want[n], rtol=0, atol=ATOL, err_msg=f"{case} step {t} {n}")
      moved = np.abs(want[n] - prev[n]).max()
      if moved == 0:  # off the active block: bitwise unchanged on both sides
        np.testing.assert_array_equal(got[n], prev_got[n], err_msg=f"{case} step {t} {n}")
      elif n != "embed_tokens.weight":  # (rows not in the batch keep only their decay)
        assert moved > 100 * ATOL, (case, t, n, moved)  # the comparison is not swamped by the tolerance
    # Adam's bias-correction count: the package's state is empty right after a switch, ours restarts at 0
    counts = {int(s["step"]) for s in opt.base_optimizer.state.values()} or {0}
    assert counts == {int(state[0].inner_state[0].count)}, (case, t, counts)
    prev, prev_got = want, got
  untouched = ["embed_tokens.weight", "final_norm.weight", "lm_head.weight"]
  frozen = {"descending_layers": untouched, "ascending_layers_schedule": untouched, "every_step_k1": untouched,
            "descending_from_1_embedding_active_norm": ["lm_head.weight"],
            "fixed_block_resets_anyway": untouched + [f"layers.{i}.{t}" for i in (0, 1)
                                                      for t in ("weight", "bias", "norm.weight")]}
  for n in frozen.get(case, []):
    np.testing.assert_array_equal(want[n], named0[n], err_msg=f"{case}: {n} should be frozen")


def test_package_facts():
  """The package behaviour the comparison relies on (a newer package that changes one of them fails here)."""
  named = init_named(1)
  # float64 model: the masters (what AdamW steps) are float32 all the same
  net, opt, _ = make_block_optimizer({n: x.astype(np.float64) for n, x in named.items()}, dtype=torch.float64)
  assert {p.dtype for p in opt.param_idx2hp.values()} == {torch.float32}
  assert all(p.dtype == torch.float64 for p in net.parameters())
  # the "no decay" group (biases) decays: **defaults after "weight_decay": 0.0 overwrites it
  groups = opt.base_optimizer.param_groups
  assert len(groups) == 2 and [g["weight_decay"] for g in groups] == [WD, WD]
  # default partition (descending: the last layer first, requires_grad on it only)
  _, opt, _ = make_block_optimizer(named, include_lm_head=True)
  assert opt.block_prefix_list == [["layers.0."], ["layers.1."], ["layers.2."],
                                   ["embed_tokens.weight", "final_norm.weight", "lm_head.weight"]]
  assert opt.active_param_prefixs == ["embed_tokens.weight", "final_norm.weight", "lm_head.weight"]
  _, opt, _ = make_block_optimizer(named, include_embedding=True)
  assert opt.block_prefix_list == [["embed_tokens."], ["layers.0."], ["layers.1."], ["layers.2."]]
  net, opt, _ = make_block_optimizer(named)
  assert [n for n, p in net.named_parameters() if p.requires_grad] == [f"layers.2.{t}" for t in
                                                                       ("weight", "bias", "norm.weight")]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_random_order_contract(k):
  """Random order: the package's visits (read from requires_grad each step, over 4 block-epochs) and ours (several
  seeds) have the same switch steps and one permutation of the D blocks per block-epoch."""
  steps = 4 * L * k - (k > 1)  # the first block runs K − 1 updates (K = 1: one), then K each: 4·D switches
  j = (np.arange(steps) + 1) // k - 1 // k  # switches before step t (block_index's count)

  def epochs(seq):
    visits = [seq[0]] + [seq[t] for t in range(1, steps) if j[t] != j[t - 1]]  # one entry per switch
    assert len(visits) == 4 * L
    return [sorted(visits[e * L:(e + 1) * L]) for e in range(4)]

  with torch.random.fork_rng():
    torch.manual_seed(0)
    net, opt, _ = make_block_optimizer(init_named(1), switch_block_every=k, switch_mode="random")
    seq, data = [], batches(3, steps)
    for ids, targets in data:
      seq.append({int(n.split(".")[1]) for n, p in net.named_parameters() if p.requires_grad})
      net(torch.from_numpy(ids), torch.from_numpy(targets)).backward()
      opt.step()
  assert all(len(s) == 1 for s in seq)
  seq = [s.pop() for s in seq]
  # the block changes only at our switch steps
  assert all(seq[t] == seq[t - 1] for t in range(1, steps) if j[t] == j[t - 1])
  assert epochs(seq) == [list(range(L))] * 4
  draw = jax.jit(jax.vmap(lambda t, seed: block_index(t, L, switch_every=k, order="random", seed=seed),
                          in_axes=(0, None)))
  for seed in range(3):
    ours = np.asarray(draw(jnp.arange(steps), seed)).tolist()
    assert all(ours[t] == ours[t - 1] for t in range(1, steps) if j[t] == j[t - 1])
    assert epochs(ours) == [list(range(L))] * 4
