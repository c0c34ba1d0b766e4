"""What the benchmark scripts (scripts/bench_*.py) share about the host they measure on.

- `--allocator` (`add_option`, `use`): the host's malloc a benchmark runs under. `use(choice)`
  starts the calling script again under `choice` (`layup_jax.platform.allocator.use`, what
  `python -m layup_jax.train` does with `tuning.host_allocator`) unless it already runs under
  it, and returns the allocator in use, for the benchmark's JSON. An older checkout measured
  with this tree's scripts (`scripts/bench_gpu.sh BEFORE`) may have no
  `layup_jax.platform.allocator`: the script then runs as it was started, and the allocator it
  reports is read from the libraries it mapped.
- `--split-cores` (`split_cores`, `thread_affinities`, `thread_cpus`): XLA's threads (the fake
  devices' work) on the first of the process's CPUs, everything else on the others, and where
  the process's threads may run.
- `newest_perfetto`: the events of the newest perfetto trace `jax.profiler.trace` wrote under a
  folder (`scripts/bench_host.py profile`, `scripts/bench_step.py --trace`).

Imports only the standard library, jax and `layup_jax.platform`.
"""

import gzip
import json
import os
import pathlib
import sys

CHOICES = ("auto", "tcmalloc", "jemalloc", "system")  # layup_jax.platform.allocator.CHOICES,
# which an older checkout lacks (tests/test_allocator.py holds the two equal)


def use(choice: str) -> str:
  """Runs the calling script under `choice` (starting it again if need be); the allocator in
  use."""
  try:
    from layup_jax.platform import allocator
  except ImportError:
    with open("/proc/self/maps") as maps:
      text = maps.read()
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in text), "system")
  try:
    note = allocator.use(choice)
  except ValueError as error:  # a named allocator that is not installed: one line, as train's
    raise SystemExit(f"error: {error}") from None
  if note:
    print(note, file=sys.stderr)
  return allocator.in_use()


def add_option(parser) -> None:
  """The `--allocator` option."""
  parser.add_argument("--allocator", default="auto", choices=CHOICES,
                      help="the host's malloc (config.tuning.host_allocator): the script starts "
                           "again under it (layup_jax/platform/allocator.py)")


def split_cores() -> tuple[set[int], set[int]]:
  """Starts XLA's threads on the first allowed CPU and moves this thread, and every thread it
  starts from now on, to the others (`--split-cores`); returns (devices' CPUs, host's CPUs).
  Must run before anything touches a JAX backend."""
  import jax  # here: importing this module must not start a backend

  allowed = sorted(os.sched_getaffinity(0))
  if len(allowed) < 2:
    raise SystemExit("error: --split-cores needs two CPUs or more; this process may use "
                     f"{allowed}")
  devices_cpus, host_cpus = {allowed[0]}, set(allowed[1:])
  os.sched_setaffinity(0, devices_cpus)  # threads inherit their creator's CPUs
  for device in jax.devices():  # the client and each device's threads start here
    jax.block_until_ready(jax.device_put(jax.numpy.zeros(8, jax.numpy.float32), device) + 1)
  os.sched_setaffinity(0, host_cpus)
  return devices_cpus, host_cpus


def thread_affinities() -> dict[str, tuple[str, str]]:
  """This process's threads (Linux): thread id -> (its name, the CPU list it may run on)."""
  threads = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as comm, \
           open(f"/proc/self/task/{tid}/status") as status:
        name = comm.read().strip()
        cpus = next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list"))
    except FileNotFoundError:  # the thread ended meanwhile
      continue
    threads[tid] = (name, cpus)
  return threads


def thread_cpus() -> dict[str, int]:
  """How many of this process's threads may run on which CPUs, by CPU list."""
  counts: dict[str, int] = {}
  for _, cpus in thread_affinities().values():
    counts[cpus] = counts.get(cpus, 0) + 1
  return counts


def newest_perfetto(trace_dir: pathlib.Path) -> tuple[pathlib.Path, list[dict]]:
  """`(path, events)` of the newest `perfetto_trace.json.gz` under `trace_dir`."""
  path = max(pathlib.Path(trace_dir).glob("plugins/profile/*/perfetto_trace.json.gz"),
             key=os.path.getmtime)
  with gzip.open(path) as f:
    trace = json.load(f)
  return path, trace["traceEvents"] if isinstance(trace, dict) else trace
