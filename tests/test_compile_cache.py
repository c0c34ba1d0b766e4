"""A run turns on jax's persistent compilation cache, unless one is already set or it is off."""

import jax

from layup_jax import compile_cache


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
