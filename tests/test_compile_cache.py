"""A run turns on jax's persistent compilation cache, unless one is already set or it is off;
a program on one device is compiled once for all of them, and every process writes its own CPU
devices' programs to it."""

import jax
import numpy as np
import pytest
from jax._src import cache_key, compilation_cache, compiler
from jax._src import distributed as jax_distributed

from layup_jax.platform import compat, compile_cache
from tests.helpers import backend_compilations


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


def _entries(folder) -> set:
  return {path.name for path in folder.iterdir()}


def test_a_program_on_one_device_is_compiled_once_and_read_for_every_other_device(
    cache_folder, monkeypatch):
  """Each stage's program runs on every device: compiled for device 0, it is read from the
  cache for devices 1-3, loaded for the device asked for, and computes the same result there;
  with jax's own key (the device in it, on CPU) each device compiles and writes its own."""
  compile_cache.enable("")
  program = jax.jit(lambda x: jax.numpy.tanh(x) * 1.03125)
  x = np.linspace(-2.0, 2.0, 7, dtype=np.float32)
  results = []
  for device in jax.devices()[:4]:
    compiled = program.lower(jax.device_put(x, device)).compile()
    assert compiled.runtime_executable().local_devices() == [device]
    out = compiled(jax.device_put(x, device))
    assert out.addressable_shards[0].data.devices() == {device}
    results.append(np.asarray(out))
  assert len(_entries(cache_folder)) == 1
  for result in results[1:]:
    np.testing.assert_array_equal(result, results[0])

  monkeypatch.setattr(cache_key, "_hash_serialized_compile_options",
                      cache_key._hash_serialized_compile_options.jax_hash)
  for device in jax.devices()[:4]:
    jax.jit(lambda x: jax.numpy.tanh(x) * 1.046875).lower(jax.device_put(x, device)).compile()
  assert len(_entries(cache_folder)) == 1 + 4


def test_programs_on_several_devices_keep_their_devices_in_the_key(cache_folder):
  """Which devices a collective spans is part of the program: the same sum over two pairs of
  devices is two entries."""
  compile_cache.enable("")
  for pair in (jax.devices()[0:2], jax.devices()[2:4]):
    mesh = jax.sharding.Mesh(np.array(pair), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(np.arange(4, dtype=np.float32), sharding)
    assert float(jax.jit(lambda x: (x * 1.0625).sum())(x)) == pytest.approx(6 * 1.0625)
  assert len(_entries(cache_folder)) == 2


def test_the_key_is_installed_once():
  compat.key_single_device_programs_without_their_device()
  installed = cache_key._hash_serialized_compile_options
  compat.key_single_device_programs_without_their_device()
  assert cache_key._hash_serialized_compile_options is installed and installed.strips_one_device


def test_a_program_read_from_the_cache_counts_as_a_compilation(cache_folder):
  """The tests that no compilation happens in a training loop count jax's compile events
  (`tests/helpers.backend_compilations`); a program read from the persistent cache must count
  too, or a compilation there could hide behind a cache hit."""
  compile_cache.enable("")
  hits = []

  def on_event(name, **_):
    if name.endswith("cache_hits"):
      hits.append(name)

  jax.monitoring.register_event_listener(on_event)
  try:
    _compile_on(jax.devices()[0], 1.109375)
    assert _entries(cache_folder) and not hits
    with backend_compilations() as compiles:  # a new function of the same program: read from
      _compile_on(jax.devices()[0], 1.109375)  # the persistent cache, not the in-memory ones
  finally:
    jax.monitoring.unregister_event_listener(on_event)
  assert hits and compiles
