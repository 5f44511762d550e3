import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sharding import AXES, MeshError, ShardingError, logical_to_spec, make_mesh, mesh_spec, parse_mesh_spec


def test_spec_fills_omitted_axes_with_one():
  assert parse_mesh_spec("data=2,fsdp=2,tensor=2", 8) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1,
                                                          "tensor": 2}


def test_minus_one_takes_the_rest():
  assert parse_mesh_spec("tensor=2,fsdp=-1", 8)["fsdp"] == 4
  with pytest.raises(MeshError, match="needs 1 devices but 8"):
    parse_mesh_spec("", 8)


@pytest.mark.parametrize("spec, message", [
    ("model=8", "unknown mesh axis 'model'"),
    ("data=4", "needs 4 devices but 8 are available"),
    ("data=0,fsdp=-1", "must have a positive size"),
    ("data=-2,fsdp=4", "must have a positive size"),
    ("data=-1,fsdp=-1", "only one mesh axis may be -1"),
    ("data=3,fsdp=-1", "do not divide"),
    ("data", "not of the form axis=size"),
    ("data=two", "non-integer size"),
    ("data=2,data=4", "given twice"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
  with pytest.raises(MeshError, match=message):
    parse_mesh_spec(spec, 8)


@pytest.mark.parametrize("explicit, kind", [(False, AxisType.Auto), (True, AxisType.Explicit)])
def test_make_mesh_names_all_axes_with_explicit_types(explicit, kind):
  mesh = make_mesh("data=2,fsdp=2,tensor=2", explicit=explicit)
  assert mesh.axis_names == AXES
  assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  assert set(mesh.axis_types) == {kind}
  assert mesh_spec(mesh) == "data=2,fsdp=2,tensor=2"


def test_mesh_over_a_subset_of_devices():
  mesh = make_mesh("fsdp=4", devices=jax.devices()[4:])
  assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]


def test_rules_drop_size_one_axes_and_never_reuse_an_axis():
  mesh = make_mesh("data=2,fsdp=2,tensor=2")
  assert logical_to_spec(("embed", "mlp"), mesh) == P("fsdp", "tensor")
  assert logical_to_spec(("layers", "embed", "heads"), mesh) == P(None, "fsdp", "tensor")
  assert logical_to_spec(("batch", "seq"), mesh) == P(("data", "fsdp"))
  # heads and mlp both ask for `tensor`: the first dimension gets it, the second is replicated
  assert logical_to_spec(("heads", "mlp"), mesh) == P("tensor")
  assert logical_to_spec(("embed", "mlp"), make_mesh("data=8")) == P()


def test_rules_refuse_indivisible_dimensions_and_unknown_names():
  mesh = make_mesh("fsdp=8")
  with pytest.raises(ShardingError, match=r"size 12\) .* does not divide by mesh axes \('fsdp',\)"):
    logical_to_spec(("embed", "mlp"), mesh, (12, 64))
  with pytest.raises(ShardingError, match="no rule"):
    logical_to_spec(("embedding",), mesh)


def test_devices_for_takes_what_a_fixed_spec_needs():
  from sharding import devices_for
  assert [d.id for d in devices_for("data=2,tensor=2")] == [0, 1, 2, 3]
  assert len(devices_for("tensor=2,fsdp=-1")) == 8
  with pytest.raises(MeshError, match="needs 16 devices but 8 are available"):
    devices_for("data=16")
  with pytest.raises(MeshError, match="unknown mesh axis 'model'"):
    devices_for("model=2")
