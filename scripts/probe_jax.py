"""The facts about jax on CPU that the runtime's design rests on, measured on the jax that runs it.

    python scripts/probe_jax.py --out docs/results/probe_jax_<python>.json

docs/runtime.md ("Facts about XLA on CPU") lists them; a new jax may move any of them, so this
script measures each on 8 fake CPU devices and prints one table row per fact:

- `programs_in_flight`: how many programs a device admits behind a long one before dispatching
  the next blocks the dispatching thread (transport.CONGESTED_AT is a quarter of it);
- `donated_sharded_dispatch_s` / `donated_single_dispatch_s`: the time to dispatch a program that
  donates a buffer sharded over every device, or one device's buffer, while device 0 runs a long
  program (DDP's step waits for it; LayUp's updates and merges must not);
- `stage_copy_us` / `device_put_us`: one 8-array ResNet-sized stage copied to another device by
  `transfer.to_device` (the batched copy) and by `jax.device_put` (medians of 5 x 200 copies);
- `compile_s` / `cached_compile_s`: compiling a program in a fresh process, without and with the
  persistent compilation cache filled by an earlier process.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from layup_jax.measure import provenance
from layup_jax.runtime import transfer

_busy = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda _, y: jnp.tanh(y @ y), x))
_tiny = jax.jit(lambda x: x + 1)


def _long_program(device) -> jax.Array:
  """Starts a program of about half a second on `device` and returns its (pending) result."""
  x = jax.device_put(np.full((256, 256), 0.01, np.float32), device)
  _busy(x).block_until_ready()  # compiled and warm
  return _busy(x)


def programs_in_flight(limit: int = 200) -> int:
  device = jax.devices()[1]
  small = jax.device_put(np.zeros(4, np.float32), device)
  _tiny(small).block_until_ready()
  pending = _long_program(device)
  for count in range(1, limit + 1):
    started = time.perf_counter()
    small = _tiny(small)
    if time.perf_counter() - started > 0.05:  # this dispatch waited for the device
      pending.block_until_ready()
      return count
  pending.block_until_ready()
  return limit


def donated_dispatch_s() -> tuple[float, float]:
  devices = jax.devices()
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)),
                                        jax.sharding.PartitionSpec("d"))
  step = jax.jit(lambda x: x * 0.5, donate_argnums=0)
  sharded = jax.device_put(np.ones(8 * 1024, np.float32), sharding)
  single = jax.device_put(np.ones(1024, np.float32), devices[0])
  sharded, single = step(sharded), step(single)  # compiled
  jax.block_until_ready((sharded, single))
  times = []
  for x in (sharded, single):
    pending = _long_program(devices[0])
    started = time.perf_counter()
    step(x)
    times.append(time.perf_counter() - started)
    pending.block_until_ready()
  return times[0], times[1]


def stage_copy_us() -> tuple[float, float]:
  devices = jax.devices()
  shapes = [(3, 3, 64, 64), (64,), (64,), (3, 3, 64, 64), (64,), (64,), (64,), (64,)]
  stage = [jax.device_put(np.ones(s, np.float32), devices[0]) for s in shapes]
  results = []
  for copy in (transfer.to_device, jax.device_put):
    rounds = []
    for _ in range(5):
      started = time.perf_counter()
      for _ in range(200):
        copy(stage, devices[1])
      jax.block_until_ready(copy(stage, devices[1]))
      rounds.append((time.perf_counter() - started) / 201 * 1e6)
    results.append(statistics.median(rounds))
  return results[0], results[1]


_COMPILE = r"""
import os, sys, time
import jax, jax.numpy as jnp
from layup_jax.platform import compile_cache
compile_cache.enable(sys.argv[1])
f = jax.jit(lambda x: jax.lax.fori_loop(0, 8, lambda _, y: jnp.tanh(y @ y.T) + y, x))
started = time.perf_counter()
f.lower(jnp.ones((64, 64))).compile()
print(time.perf_counter() - started)
"""


def compile_times() -> tuple[float, float]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as cache:
    runs = [float(subprocess.run([sys.executable, "-c", _COMPILE, cache], cwd=root, check=True,
                                 capture_output=True, text=True).stdout.split()[-1])
            for _ in range(2)]
  return runs[0], runs[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="write the figures as JSON here")
  args = parser.parse_args()
  sharded, single = donated_dispatch_s()
  copy, put = stage_copy_us()
  compile_s, cached_s = compile_times()
  facts = {"programs_in_flight": programs_in_flight(),
           "donated_sharded_dispatch_s": sharded, "donated_single_dispatch_s": single,
           "transfer_implementation": transfer.implementation().__name__,
           "stage_copy_us": copy, "device_put_us": put,
           "compile_s": compile_s, "cached_compile_s": cached_s}
  where = (f"Python {sys.version.split()[0]}, jax {jax.__version__}, {provenance.machine()}, "
           f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
  print(f"| fact | {where} |\n|---|---|")
  for key, value in facts.items():
    print(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"measured": where, "code_version": provenance.code_version(), "facts": facts},
                f, indent=1)


if __name__ == "__main__":
  main()
