"""sharding.audit: collectives read from compiled HLO with exact bytes and groups, and the textbook byte formulas.

Expected values are worked out by hand from the programs' shapes (f32 = 4 bytes) and the mesh's device order:
on make_mesh("data=2,fsdp=4") device id = 4·data + fsdp, so `fsdp` groups are {0..3},{4..7} and `data` groups
{0,4},{1,5},{2,6},{3,7}.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import AuditError, analytic_bytes, collectives, make_mesh, matmul_flops
from sharding.audit import KindTotal

FSDP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DATA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))
ALL8 = (tuple(range(8)),)


@pytest.fixture(scope="module")
def mesh():
  return make_mesh("data=2,fsdp=4")


def compiled(mesh, f, in_specs, out_specs, *args):
  g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return jax.jit(g).lower(*args).compile()


X = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)  # local (16, 4) = 256 bytes when split over fsdp


@pytest.mark.parametrize("case", ["psum", "pmax_bool", "all_gather", "psum_scatter", "ppermute"])
def test_shard_map_collectives_exact(mesh, case):
  # (function, in_specs, out_specs, argument, kind, operand bytes, result bytes, groups, dtypes, wire bytes)
  cases = {
      "psum": (lambda v: jax.lax.psum(v, "data"), P("fsdp"), P("fsdp"), X,
               "all-reduce", 256, 256, DATA_GROUPS, ("f32",), 2 * (1 / 2) * 256),
      "pmax_bool": (lambda v: jax.lax.pmax(v, "fsdp"), P("fsdp"), P(), X > 7,
                    "all-reduce", 64, 64, FSDP_GROUPS, ("pred",), 2 * (3 / 4) * 64),
      "all_gather": (lambda v: jax.lax.all_gather(v, "fsdp", tiled=True), P("fsdp"), P(), X,
                     "all-gather", 256, 1024, FSDP_GROUPS, ("f32",), (3 / 4) * 1024),
      "psum_scatter": (lambda v: jax.lax.psum_scatter(v, ("data", "fsdp"), tiled=True), P(), P(("data", "fsdp")), X,
                       "reduce-scatter", 1024, 128, ALL8, ("f32",), (7 / 8) * 1024),
      "ppermute": (lambda v: jax.lax.ppermute(v, "fsdp", [(i, (i + 1) % 4) for i in range(4)]), P("fsdp"), P("fsdp"),
                   X, "collective-permute", 256, 256, ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4)),
                   ("f32",), 256),
  }
  f, i, o, x, kind, operand, result, groups, dtypes, wire = cases[case]
  audit = collectives(compiled(mesh, f, i, o, x))
  assert [op.kind for op in audit.ops] == [kind]
  (op,) = audit.ops
  assert (op.operand_bytes, op.result_bytes, op.groups, op.dtypes) == (operand, result, groups, dtypes)
  assert op.wire_bytes == pytest.approx(wire)
  assert (op.count, op.in_loop, op.is_async, op.scatter) == (1, False, False, False)
  assert audit.summary()[kind].count == 1 and audit.num_devices == 8


def test_all_to_all_of_two_arrays_is_two_tuple_all_to_alls(mesh):
  # XLA:CPU prints an all-to-all over 4 devices as a tuple of 4 operands (one piece per peer); two arrays, two ops.
  c = compiled(mesh, lambda v, w: jax.lax.all_to_all((v, w), "fsdp", 0, 1, tiled=True), (P("fsdp"), P("fsdp")),
               (P(None, "fsdp"), P(None, "fsdp")), X, X.astype(np.int32))
  audit = collectives(c)
  assert [op.kind for op in audit.ops] == ["all-to-all", "all-to-all"]
  assert sorted(op.dtypes for op in audit.ops) == [("f32",) * 4, ("s32",) * 4]
  for op in audit.ops:
    assert (op.operand_bytes, op.result_bytes, op.groups, op.group_size) == (256, 256, FSDP_GROUPS, 4)
  s = audit.summary()["all-to-all"]
  assert (s.count, s.operand_bytes, s.result_bytes, s.wire_bytes) == (2, 512, 512, pytest.approx(2 * 3 / 4 * 256))


def test_loop_body_collective_is_multiplied_by_the_trip_count(mesh):
  # Compiled only, never run: a collective inside a while loop deadlocks XLA:CPU's simulated devices.
  def body(c, _):
    return jax.lax.psum(c @ c, "fsdp"), None
  c = compiled(mesh, lambda v: jax.lax.scan(body, v, None, length=5)[0], P("fsdp"), P("fsdp"), np.ones((32, 8),
                                                                                                       np.float32))
  (op,) = collectives(c).ops
  assert (op.kind, op.count, op.in_loop, op.trip_count_known, op.operand_bytes) == ("all-reduce", 5, True, True, 256)
  assert collectives(c).summary()["all-reduce"].operand_bytes == 5 * 256
  assert matmul_flops(c) == 5 * 2 * 8 * 8 * 8  # the (8, 8) @ (8, 8) in the body, 5 times


def test_cpu_reduce_scatter_shows_as_all_reduce_plus_dynamic_slice():
  # GSPMD on XLA:CPU: the FSDP weight gradient is an all-reduce of the full (64, 32) buffer, then a slice.
  mesh = make_mesh("fsdp=8")
  w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("fsdp")))
  x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("fsdp")))
  grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))), out_shardings=NamedSharding(mesh, P("fsdp")))
  with jax.set_mesh(mesh):
    audit = collectives(grad.lower(w, x).compile())
  folded = audit.summary(fold_scatter=True)
  full = 64 * 32 * 4
  assert folded["reduce-scatter"].operand_bytes == full and folded["reduce-scatter"].result_bytes == full // 8
  assert folded["reduce-scatter"].wire_bytes == pytest.approx(7 / 8 * full)
  assert "all-reduce" not in folded
  assert all(op.scatter for op in audit.ops if op.kind == "all-reduce")
  assert folded["all-gather"].result_bytes == full  # the forward gathers the weight (or this test needs a look)


def test_hand_written_zero1_step_matches_the_analytic_bytes():
  mesh = make_mesh("data=8")
  n = 1024

  def step(p, g):  # p: local (128,), g: this device's full gradient (1024,)
    g_shard = jax.lax.psum_scatter(g, "data", tiled=True)
    return jax.lax.all_gather(p - 0.1 * g_shard, "data", tiled=True)

  c = compiled(mesh, step, (P("data"), P()), P(), np.zeros(n, np.float32), np.ones(n, np.float32))
  audit = collectives(c)
  assert audit.wire_bytes() == pytest.approx(analytic_bytes(n, "data=8", zero1=True)["total"])
  assert audit.wire_bytes() == pytest.approx(2 * 7 / 8 * n * 4)


ASYNC_HLO = """
HloModule snippet, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%async_computation (p0: bf16[2,8]) -> bf16[2,8] {
  %p0 = bf16[2,8]{1,0} parameter(0)
  ROOT %a2a = bf16[2,8]{1,0} all-to-all(%p0), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (c.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %c.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%c.1), index=0
  %v = f32[4]{0} get-tuple-element(%c.1), index=1
  %ar = f32[4]{0} all-reduce(%v), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[4]{0}) tuple(%i.1, %ar)
}

ENTRY %main (x: f32[16,256], y: bf16[2,8], z: f32[4]) -> f32[64,256] {
  %x = f32[16,256]{1,0} parameter(0)
  %y = bf16[2,8]{1,0} parameter(1)
  %z = f32[4]{0} parameter(2)
  %ag-start = (f32[16,256]{1,0}, f32[64,256]{1,0}) all-gather-start(f32[16,256]{1,0} %x), channel_id=1,
      replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = f32[64,256]{1,0} all-gather-done(%ag-start)
  %ar-start = bf16[2,8]{1,0} all-reduce-start(%y), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ar-done = bf16[2,8]{1,0} all-reduce-done(%ar-start)
  %cp-start = (bf16[2,8]{1,0}, bf16[2,8]{1,0}, u32[], u32[]) collective-permute-start(%ar-done), channel_id=3,
      source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[2,8]{1,0} collective-permute-done(%cp-start)
  %a2a-start = ((bf16[2,8]{1,0}), bf16[2,8]{1,0}) async-start(%cp-done), calls=%async_computation
  %a2a-done = bf16[2,8]{1,0} async-done(%a2a-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %z)
  %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,256]{1,0} copy(%ag-done)
}
"""


def test_async_start_forms_iota_groups_and_unknown_loops_from_literal_hlo():
  audit = collectives(ASYNC_HLO)
  ops = {op.name: op for op in audit.ops}
  assert set(ops) == {"ag-start", "ar-start", "cp-start", "a2a", "ar"}  # -done forms are not counted again
  ag = ops["ag-start"]
  assert (ag.kind, ag.is_async, ag.operand_bytes, ag.result_bytes, ag.groups) == (
      "all-gather", True, 16 * 256 * 4, 64 * 256 * 4, FSDP_GROUPS)
  ar = ops["ar-start"]  # iota with a transpose: arange(8).reshape(2, 4).T -> rows of 2
  assert (ar.kind, ar.operand_bytes, ar.result_bytes, ar.dtypes, ar.groups) == (
      "all-reduce", 32, 32, ("bf16",), ((0, 4), (1, 5), (2, 6), (3, 7)))
  cp = ops["cp-start"]
  assert (cp.kind, cp.operand_bytes, cp.result_bytes, cp.groups, cp.wire_bytes) == (
      "collective-permute", 32, 32, ((0, 1), (1, 0)), 32)
  a2a = ops["a2a"]  # found inside the async wrapper's computation
  assert (a2a.kind, a2a.is_async, a2a.operand_bytes, a2a.groups) == ("all-to-all", True, 32, ((0, 1), (2, 3), (4, 5),
                                                                                               (6, 7)))
  loop = ops["ar"]  # no known_trip_count in the backend config: counted once, flagged
  assert (loop.in_loop, loop.trip_count_known, loop.count, loop.is_async) == (True, False, 1, False)
  assert audit.summary()["all-gather"].wire_bytes == pytest.approx(3 / 4 * 64 * 256 * 4)


@pytest.mark.parametrize("groups, expected", [
    ("{{0,1,2,3},{4,5,6,7}}", FSDP_GROUPS),
    ("{}", ALL8),
    ("[2,4]<=[8]", FSDP_GROUPS),
    ("[4,2]<=[2,4]T(1,0)", DATA_GROUPS),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", ALL8),
    ("mesh['data'=2,'fsdp'=4] {'data'}", DATA_GROUPS),
    ("mesh['data'=2,'fsdp'=4] {'fsdp':(1)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),  # the major half of fsdp
    # device ids arange(8).reshape(2, 4).T = 0,4,1,5,... laid out as the (4, 2) mesh: axis 'a' is jax's fsdp
    ("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}", FSDP_GROUPS),
    ("mesh['a'=4,'b'=1,'c'=2], device_ids=([2,4]T(1,0)) {'c'}", DATA_GROUPS),
    ("mesh['data'=2,'fsdp'=4] {'fsdp','data'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),  # listed order: fsdp-major
])
def test_replica_group_spellings(groups, expected):
  text = f"HloModule m, num_partitions=8\nENTRY %e (p: f32[8]) -> f32[8] {{\n  %p = f32[8]{{0}} parameter(0)\n" \
         f"  ROOT %r = f32[8]{{0}} all-reduce(%p), replica_groups={groups}, to_apply=%add\n}}\n"
  (op,) = collectives(text).ops
  assert op.groups == expected and op.operand_bytes == 32


def test_analytic_bytes_by_hand():
  # 1000 parameters, fp32, 4 devices: r = 3/4
  assert analytic_bytes(1000, "data=4") == {"data all-reduce grads": 6000.0, "total": 6000.0}
  z1 = analytic_bytes(1000, "data=4", zero1=True)
  assert z1 == {"data reduce-scatter grads": 3000.0, "data all-gather params": 3000.0, "total": 6000.0}
  fsdp = analytic_bytes(1000, {"fsdp": 4})
  assert fsdp["total"] == 9000.0 and fsdp["fsdp all-gather params (backward)"] == 3000.0  # 1.5x DP (ZeRO-3)
  # bf16 params, fp32 grads on fsdp=4: gathers 0.75*1000*2 each, the scatter 0.75*1000*4
  assert analytic_bytes(1000, "fsdp=4", param_bytes=2, grad_bytes=4)["total"] == 1500 + 1500 + 3000
  # TP=2 x DP=2, 2 layers, d_model 8, 32 tokens a step: each device's group sees 16 tokens;
  # one activation all-reduce = 2 * 1/2 * 16 * 8 * 4 = 512 bytes, 4 a layer -> 4096; grads: 2 * 1/2 * 500 * 4 = 2000
  tp = analytic_bytes(1000, "data=2,tensor=2", n_layers=2, d_model=8, tokens=32)
  assert tp == {"data all-reduce grads": 2000.0, "tensor all-reduce activations": 4096.0, "total": 6096.0}
  # hybrid FSDP x DP: fsdp terms on P, the data all-reduce on the 1/4 shard
  hy = analytic_bytes(1000, make_mesh("data=2,fsdp=4"))
  assert hy["data all-reduce grads"] == 2 * 0.5 * 250 * 4 and hy["total"] == 9000 + 1000


@pytest.mark.parametrize("call, message", [
    (lambda: analytic_bytes(10, "expert=2"), "models data, fsdp and tensor"),
    (lambda: analytic_bytes(10, "fsdp=8", zero1=True), "zero1=True shards"),
    (lambda: analytic_bytes(10, "tensor=2"), "needs n_layers"),
    (lambda: analytic_bytes(10, "data=two"), "must be axis=size"),
    (lambda: collectives(12), "expected a jax.stages.Compiled or HLO text"),
    (lambda: collectives("not hlo"), "no HLO instructions found"),
    (lambda: collectives(jax.jit(lambda x: x + 1).lower(1.0)), "pass lowered.compile"),
])
def test_bad_input_says_how_to_fix_it(call, message):
  with pytest.raises(AuditError, match=message):
    call()


TUPLE_AR_HLO = """
HloModule combined, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_slice (param_0: f32[8,4], param_1: s32[]) -> f32[4,2] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %t = f32[4,8]{1,0} transpose(%param_0), dimensions={1,0}
  %zero = s32[] constant(0)
  ROOT %ds = f32[4,2]{1,0} dynamic-slice(%t, %zero, %param_1), dynamic_slice_sizes={4,2}
}

ENTRY %main (g: f32[8,4], h: f32[16], k: f32[16], i: s32[]) -> (f32[4,2], f32[16], f32[8]) {
  %g = f32[8,4]{1,0} parameter(0)
  %h = f32[16]{0} parameter(1)
  %k = f32[16]{0} parameter(2)
  %i = s32[] parameter(3)
  %ar = (f32[8,4]{1,0}, f32[16]{0}, f32[16]{0}) all-reduce(%g, %h, /*index=2*/%k), replica_groups={{0,1,2,3}},
      to_apply=%add
  %gte0 = f32[8,4]{1,0} get-tuple-element(%ar), index=0
  %gte1 = f32[16]{0} get-tuple-element(%ar), index=1
  %gte2 = f32[16]{0} get-tuple-element(%ar), index=2
  %sl = f32[4,2]{1,0} fusion(%gte0, %i), kind=kLoop, calls=%fused_slice
  %half = f32[8]{0} dynamic-slice(%gte2, %i), dynamic_slice_sizes={8}
  ROOT %out = (f32[4,2]{1,0}, f32[16]{0}, f32[8]{0}) tuple(%sl, %gte1, %half)
}
"""


def test_tuple_all_reduce_is_split_into_its_reduce_scatter_and_all_reduce_parts():
  # element 0 (128 B) is only kept as a 1/4 slice (inside a fusion, after a transpose): a reduce-scatter;
  # element 1 (64 B) is used whole and element 2 (64 B) is cut in half, not in quarters: all-reduce.
  audit = collectives(TUPLE_AR_HLO)
  (op,) = audit.ops
  assert (op.operand_bytes, op.scatter_bytes, op.scatter) == (256, 128, False)
  folded = audit.summary(fold_scatter=True)
  assert folded["reduce-scatter"] == KindTotal(count=1, operand_bytes=128, result_bytes=32, wire_bytes=3 / 4 * 128)
  assert folded["all-reduce"] == KindTotal(1, 128, 128, 2 * 3 / 4 * 128)
  assert audit.summary()["all-reduce"] == KindTotal(1, 256, 256, 2 * 3 / 4 * 256)


def test_distributed_muon_step_bytes_and_ns_flops_within_moonlight_bounds():
  """Moonlight (arXiv 2502.16982, §2.3): Distributed Muon communicates ≤ 1.25x a ZeRO-1 AdamW step, i.e. the
  optimizer may add ≤ 0.25x the ZeRO-1 bytes; its Newton–Schulz work is split, not repeated. On fsdp=8 with 16
  matrices of one shape class (w2's (128, 64) joins w1's (64, 128) transposed), each device orthogonalizes 2."""
  import optim
  mesh = make_mesh("fsdp=8")
  sh = {"w1": NamedSharding(mesh, P(None, "fsdp")), "w2": NamedSharding(mesh, P(None, None, "fsdp"))}
  rng = np.random.default_rng(0)
  grads = {"w1": jax.device_put(rng.normal(size=(8, 64, 128)).astype(np.float32), sh["w1"]),
           "w2": jax.device_put(rng.normal(size=(8, 128, 64)).astype(np.float32), sh["w2"])}
  n_params = 2 * 8 * 64 * 128
  zero1 = analytic_bytes(n_params, {"data": 8}, zero1=True)["total"]
  assert zero1 == 2 * 7 / 8 * n_params * 4

  def measure(distributed):
    tx = optim.scale_by_muon(distributed=distributed)
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(grads)
      c = jax.jit(lambda g, s: tx.update(g, s)[0], out_shardings=sh).lower(grads, state).compile()
    audit = collectives(c)
    assert not any(op.in_loop for op in audit.ops)  # nothing inside the Newton–Schulz loop
    return audit.wire_bytes(fold_scatter=True), matmul_flops(c)

  ns_total = 16 * optim.ns_flops(64, 128, 5)
  extra, flops = measure(distributed=True)
  assert (zero1 + extra) / zero1 <= 1.25
  assert flops == ns_total / 8  # 2 of the 16 matrices per device, no repeated work
  gathered, repeated = measure(distributed=False)  # each device gathers every matrix: the bound has teeth
  assert (zero1 + gathered) / zero1 > 1.25 and repeated == ns_total
