"""Every allocation failure is one line with the fix, whatever XLA's status code, on every command line: the train CLI
(`command.failure`) and every other command (`entry.command`, which benches, tools, sweeps and experiments run
under)."""

import subprocess
import sys
import warnings

import jax
import pytest

from research import entry
from research.train import command


@pytest.fixture(autouse=True)
def process_untouched(monkeypatch):  # entry.command installs a SIGINT handler and a warnings hook: not in pytest's
  monkeypatch.setattr(entry.signal, "signal", lambda *args: None)
  monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


INTERNAL = "INTERNAL: RET_CHECK failure ... Out of memory allocating 68719476736 bytes for a buffer of shape f32[...]"


def one_line(capsys, e):
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: out of memory ("), err
  return err[0]


def test_the_train_cli_says_out_of_memory_for_an_internal_status(tmp_path, capsys, monkeypatch):
  def fail(cfg):  # what XLA's CPU client raised at --memory-limit 0 with a model too big (a 19-line traceback)
    raise jax.errors.JaxRuntimeError(INTERNAL)
  monkeypatch.setattr(command, "run", fail)
  with pytest.raises(SystemExit) as e:
    command.main(["--model", "tiny", "--out", str(tmp_path / "run"), "--no-progress"])
  assert "lower --batch-size or --seq-len" in one_line(capsys, e)


CHILD = """
import jax, jax.numpy as jnp
from research import entry
entry.command(lambda: jax.jit(lambda: jnp.ones((2 ** 40,), jnp.float32))().block_until_ready())
"""


def test_any_command_says_out_of_memory_for_a_real_allocation():
  """4 TiB on this machine's CPU, which XLA refuses; in a child process, so that a host that would grant it (memory
  overcommitted) loses that process, not the test run."""
  p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
  err = p.stderr.strip().splitlines()
  assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error: out of memory ("), (p.returncode, err)


def test_any_command_says_out_of_memory_for_an_internal_status(capsys):
  def main():
    raise jax.errors.JaxRuntimeError(INTERNAL)
  with pytest.raises(SystemExit) as e:
    entry.command(main)
  assert "INTERNAL" in one_line(capsys, e)


def test_other_runtime_errors_keep_their_traceback():  # a bug is not dressed up as bad input
  def main():
    raise jax.errors.JaxRuntimeError("INTERNAL: a compiler bug")
  with pytest.raises(jax.errors.JaxRuntimeError):
    entry.command(main)
