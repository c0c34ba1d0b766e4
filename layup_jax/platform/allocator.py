"""The host's memory allocator: TCMalloc or jemalloc instead of the C library's malloc.

Every dispatch of a stage program allocates and frees small host objects (the buffers' records,
their events, the arrays' Python wrappers), many freed by XLA's threads rather than the thread
that allocated them. With glibc's malloc that was a fifth of the dispatching thread's CPU time
(`malloc_consolidate`, `unlink_chunk`, `_int_free` in a profile), and under TCMalloc a run of
the ResNet-18 structure took 10 % less host time per device-iteration with the updater thread,
23 % less on one thread (docs/records/host.md "The allocator"). An allocator can only replace malloc
from the process's start (`LD_PRELOAD`), so `use` starts the process again, once, under the one
chosen (`config.tuning.host_allocator`); the Debian packages `libtcmalloc-minimal4` and `libjemalloc2`
provide them. A leaf: no jax, nothing of the project.
"""

import ctypes.util
import glob
import os
import sys

CHOICES = ("auto", "tcmalloc", "jemalloc", "system")  # config.tuning.host_allocator
_LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
_PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
_STARTED_AGAIN = "LAYUP_JAX_ALLOCATOR_PRELOADED"  # set in the process started again: no loop
# TCMalloc reports every allocation over 1 GiB on stderr by default; a model's buffers are.
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 62)}


def in_use(maps_path: str = "/proc/self/maps") -> str:
  """"tcmalloc", "jemalloc" or "system": the allocator this process runs with."""
  try:
    with open(maps_path) as maps:
      text = maps.read()
  except OSError:
    return "system"
  return next((name for name in _LIBRARIES if f"lib{name}" in text), "system")


def library(name: str) -> str | None:
  """The shared library of allocator `name`, or None: the first in a folder of `LD_LIBRARY_PATH`
  (an allocator installed outside the system's folders, e.g. in a conda environment), else the
  one the dynamic linker's cache names."""
  for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
    for lib in _LIBRARIES[name]:
      found = sorted(glob.glob(os.path.join(glob.escape(folder), f"lib{lib}.so*")))
      if found:
        return found[0]
  return next(filter(None, (ctypes.util.find_library(lib) for lib in _LIBRARIES[name])), None)


def preload_environment(name: str, lib: str, environ: dict[str, str]) -> dict[str, str]:
  """`environ` for a process started under `lib` (allocator `name`)."""
  preload = " ".join(filter(None, (lib, environ.get("LD_PRELOAD", ""))))
  quiet = _QUIET if name == "tcmalloc" else {}
  return {**quiet, **environ, "LD_PRELOAD": preload, _STARTED_AGAIN: name}


def use(choice: str, argv: list[str] | None = None) -> str | None:
  """Starts this process again under `choice`'s allocator (`auto`: TCMalloc, else jemalloc)
  unless it already runs under one or `choice` is "system"; returns without starting again
  only with a line to show, or None when there is nothing to say. `argv` is the interpreter's
  arguments (default `sys.orig_argv[1:]`: the same command). Raises ValueError, in one line,
  when the allocator asked for by name is not installed."""
  if choice not in CHOICES:
    raise ValueError(f"config.tuning.host_allocator={choice}: must be one of "
                     f"{', '.join(CHOICES)}")
  current = in_use()
  if choice == "system" or current != "system":
    return None
  if os.environ.get(_STARTED_AGAIN):
    return (f"host allocator: {os.environ[_STARTED_AGAIN]} was preloaded but is not in use; "
            f"running on the system's malloc")
  names = ("tcmalloc", "jemalloc") if choice == "auto" else (choice,)
  found = next(((name, lib) for name in names if (lib := library(name))), None)
  if found is None:
    if choice != "auto":
      raise ValueError(f"config.tuning.host_allocator={choice}: no lib{choice} found; install "
                       f"it (apt-get install {_PACKAGES[choice]}) or choose auto or system")
    return (f"host allocator: the system's malloc (no TCMalloc or jemalloc found; `apt-get "
            f"install {_PACKAGES['tcmalloc']}` took a tenth to a quarter off the host's time per "
            f"stage on a 2-core machine, docs/guide/performance.md; "
            f"--config.tuning.host_allocator=system silences this line)")
  name, lib = found
  sys.stdout.flush()
  sys.stderr.flush()
  arguments = sys.orig_argv[1:] if argv is None else argv
  os.execve(sys.executable, [sys.executable, *arguments],
            preload_environment(name, lib, dict(os.environ)))
  raise AssertionError("unreachable")  # execve returns only by raising
