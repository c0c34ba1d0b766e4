"""A run turns on jax's persistent compilation cache, unless one is already set or it is off,
and every process writes its own CPU devices' programs to it."""

import jax
import numpy as np
import pytest
from jax._src import compilation_cache, compiler
from jax._src import distributed as jax_distributed

from layup_jax import compat, compile_cache


def _with_cache_dir(value, body):
  keep = (jax.config.jax_compilation_cache_dir,
          jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", value)
  try:
    return body()
  finally:
    jax.config.update("jax_compilation_cache_dir", keep[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", keep[1])


def test_the_configured_folder_is_used_when_jax_has_none(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))

  def body():
    folder = compile_cache.enable("~/cache/jax")
    return folder, jax.config.jax_compilation_cache_dir, \
        jax.config.jax_persistent_cache_min_compile_time_secs

  folder, in_use, min_secs = _with_cache_dir(None, body)
  assert folder == in_use == str(tmp_path / "cache" / "jax")
  assert (tmp_path / "cache" / "jax").is_dir()
  assert min_secs == 0.0  # the many quick compilations are cached too


def test_an_empty_folder_turns_the_cache_off():
  assert _with_cache_dir(None, lambda: (compile_cache.enable(""),
                                        jax.config.jax_compilation_cache_dir)) == (None, None)


def test_a_cache_folder_set_before_the_run_is_kept(tmp_path):
  def body():
    return compile_cache.enable(str(tmp_path / "other")), jax.config.jax_compilation_cache_dir

  assert _with_cache_dir(str(tmp_path / "set"), body) == (str(tmp_path / "set"),) * 2
  assert not (tmp_path / "other").exists()


@pytest.fixture
def cache_folder(tmp_path):
  """jax's persistent cache at `tmp_path` for one test (it keeps one cache per process)."""
  keep = jax.config.jax_compilation_cache_dir
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  try:
    yield tmp_path
  finally:
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", keep)


def _compile_on(device, scale: float) -> None:
  """Compiles a program no other test compiles (`scale` in its text) on `device`."""
  jax.jit(lambda x: x * scale + 0.25)(jax.device_put(np.ones(3, np.float32), device))


def test_a_process_other_than_0_writes_its_own_devices_programs_to_the_cache(
    cache_folder, monkeypatch):
  """jax writes cache entries from process 0 only; on CPU devices every process writes its own,
  whose keys hold its devices and no other process computes (the next run of the process, or a
  process restarted in its place, reads them instead of compiling again)."""
  compile_cache.enable("")
  monkeypatch.setattr(jax_distributed.global_state, "process_id", 1)
  _compile_on(jax.devices()[3], 1.0078125)
  written = set(cache_folder.iterdir())
  assert written, "process 1 wrote no entry"

  monkeypatch.setattr(compiler, "_cache_write", compiler._cache_write.jax_write)
  _compile_on(jax.devices()[3], 1.015625)
  assert set(cache_folder.iterdir()) == written  # jax's own write: nothing from process 1


def test_the_writer_is_installed_once():
  compat.write_compilation_cache_from_every_process()
  installed = compiler._cache_write
  compat.write_compilation_cache_from_every_process()
  assert compiler._cache_write is installed and installed.every_process
