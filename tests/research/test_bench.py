"""The benchmark CLI dispatches and refuses bad input; the optimizer tree is the one the issue names."""

import jax
import pytest

from research import bench, bench_optim


def test_benchmarks_are_registered():
  assert set(bench.BENCHMARKS) >= {"train", "optim", "ckpt"}


def test_ckpt_bench_times_checksums_against_save_and_restore(tmp_path):
  row, = bench.ckpt_bench(presets=("tiny",), mesh="fsdp=4", rounds=1, tmp_dir=str(tmp_path),
                          out=str(tmp_path / "t.md"))
  assert row["arrays"] > 10 and row["state_bytes"] > 1e5
  assert 0 < row["one_pass_s"] and 0 < row["checksums_s"] < row["save_s"] and row["checksums_s"] < row["restore_s"]
  assert "| tiny | 0.1M |" in (tmp_path / "t.md").read_text()


def test_optim_bench_tree_is_43m_params_with_36_muon_matrices():
  params = bench_optim.param_tree()
  assert 42e6 < sum(x.size for x in jax.tree.leaves(params)) < 44e6
  muon = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if bench_optim.is_muon(p, x)]
  assert len(muon) == 36 and {x.shape for x in muon} == {(768, 768), (768, 3072), (3072, 768)}


def test_bad_mesh_exits_with_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(["train", "--presets", "tiny", "--meshes", "data=3"])
  assert e.value.code == 2 and "error:" in capsys.readouterr().err
