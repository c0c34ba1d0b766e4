"""A persistent compilation cache for every run, so a rerun compiles in seconds.

A run compiles each per-stage function once per device (tens of seconds for the small models,
minutes for the paper's); jax can keep the compiled programs on disk and reuse them when the
same program is compiled again, in this process or the next. `config.compilation_cache_dir`
names the folder ("" turns it off). Where jax already has a cache folder (the environment
variable `JAX_COMPILATION_CACHE_DIR`, or a script that set one), that one is kept: the tests
and the sweeps share theirs. With the cache on, a program on one device is keyed without
which device, as jax keys it on GPU: compiled for device 0, a stage's program is read for the
process's other devices (on CPU jax's key holds the device, and each device compiled its own
copy). In a run across processes on CPU devices every process writes its own programs (jax
writes from process 0 only, and on CPU its keys hold the process's devices: a process other
than 0 would compile every program afresh in every run). Both in `compat.py`.
"""

import os

import jax

from layup_jax.platform import compat


def enable(path: str) -> str | None:
  """Turns the cache on at `path` (`~` expanded) unless jax already has one or `path` is "";
  returns the folder in use, or None. Every program is cached, however quick its compilation:
  a run is hundreds of small ones."""
  folder = jax.config.jax_compilation_cache_dir
  if not folder:
    if not path:
      return None
    folder = os.path.expanduser(path)
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  compat.key_single_device_programs_without_their_device()
  compat.write_compilation_cache_from_every_process()
  return folder
