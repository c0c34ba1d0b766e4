"""What one program's dispatch costs the host inside a LayUp run, against the same call alone.

bench_host.py gives the host's time per device-iteration; this splits it by program. On the
shrunk model structures of bench_host.py (8 fake CPU devices, latency sampling off), every
jitted function of the runtime is wrapped to record the CPU time of the calling thread
(`time.thread_time`) over each call, by the function's name (`forward`, `backward_update`,
`backward_update_mix`, `loss_update`, `merge`, ...), during a threaded run of `--iterations`
device-iterations (one row per `--updater-thread` value). Afterwards, with the runtime's threads
stopped, the first recorded call of each kind is made again `--alone` times from this thread,
its inputs computed and nothing else running: the same program, the same arguments.

  in_run_us   median over the run of the thread CPU per call, in microseconds
  ready       with `--inputs-ready`: the share of the run's calls whose input arrays were all
              computed when it was made (read just before the call, outside the time recorded,
              but touching the inputs the call then reads, so off by default); `in_run_ready_us`
              and `in_run_waiting_us` in the JSON are the medians of either kind
  alone_us    the same call alone (its inputs ready): the dispatch cost by itself
  rotated_us  the same call alone, every recorded kind of call made in turn as a run makes them
              (each program once per turn, inputs ready): the code and data of many programs
              in the caches instead of one
  l2_cold_us  the same call alone, after a write over twice the (per-core) L2 cache before
              each call (not counted): its code and data evicted from L1 and L2, not from L3
  cold_us     the same, over twice the last-level cache: every cache cold
  cheap       calls per device-iteration under 1,000 flops (XLA's cost analysis): XLA's CPU
              client runs such a program on the calling thread when its inputs are ready
              (`cheap_computation_` in xla/pjrt/cpu), so part of their cost is the device's work

The wrappers add their own host time (a few microseconds per call, outside what they record),
so the run's wall time here is not bench_host's figure. Medians over `--repeats` runs, each on
a fresh runtime, alternating the `--updater-thread` rows.

`--split-cores` (as bench_host.py's) starts XLA's threads on the first CPU and runs the
runtime's threads, and the calls alone, on the others: whether a call costs more in a run
because the devices' work shares the dispatching thread's cores.

  python scripts/bench_dispatch.py
  python scripts/bench_dispatch.py --case resnet50-cifar --updater-thread off
  python scripts/bench_dispatch.py --split-cores
"""

import argparse
import collections
import functools
import glob
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import allocator_choice
import bench_host
import jax
import numpy as np
import optax

from layup_jax import algorithms
from layup_jax.data import TrainStreams
from layup_jax.measure import provenance

CHEAP_FLOPS = 1000  # XLA's CPU client: below this a program runs on the calling thread


class CallClock(bench_host.Counter):
  """Wraps the runtime's jitted functions, recording the calling thread's CPU time per call."""

  def __init__(self, read_ready: bool = False):
    super().__init__()
    self.read_ready = read_ready
    self.seconds = collections.defaultdict(list)  # name -> thread CPU seconds per call
    self.ready = collections.defaultdict(list)  # name -> whether each call's inputs were computed
    self.signatures = collections.Counter()  # (name, argument shapes) -> calls
    self.examples = {}  # (name, argument shapes) -> (function, args, kwargs)

  def first_call(self, name: str) -> tuple:
    """(function, args, kwargs) of the first recorded call of `name`."""
    return next(call for (called, _), call in self.examples.items() if called == name)

  def wrap_jitted(self, fn):
    if not hasattr(fn, "lower"):
      return fn
    name = getattr(fn, "__name__", "program")

    @functools.wraps(fn)
    def timed(*args, **kwargs):
      if self.read_ready:  # (random keys have no `is_ready`: left out)
        self.ready[name].append(all(leaf.is_ready() for leaf in jax.tree.leaves(args)
                                    if hasattr(leaf, "is_ready")))
      start = time.thread_time()
      out = fn(*args, **kwargs)
      self.seconds[name].append(time.thread_time() - start)
      signature = (name, tuple((getattr(a, "shape", None), str(getattr(a, "dtype", "")))
                               for a in jax.tree.leaves(args)))
      self.signatures[signature] += 1
      if signature not in self.examples:
        self.examples[signature] = (fn, args, kwargs)
      return out
    return timed


def flops(fn, args, kwargs) -> float | None:
  try:
    analysis = fn.lower(*args, **kwargs).compile().cost_analysis()
  except Exception:  # noqa: BLE001 - a function that cannot be lowered again: no figure
    return None
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  return analysis.get("flops") if analysis else None


def alone_us(fn, args, kwargs, calls: int) -> float | None:
  """Thread CPU per call of `fn(*args)` repeated, its inputs ready (None if it cannot be
  called again, e.g. a donated argument)."""
  try:
    jax.block_until_ready([fn(*args, **kwargs) for _ in range(5)])
    start = time.thread_time()
    outs = [fn(*args, **kwargs) for _ in range(calls)]
    seconds = time.thread_time() - start
    jax.block_until_ready(outs)
  except Exception:  # noqa: BLE001
    return None
  return 1e6 * seconds / calls


def cache_bytes() -> dict[int, int]:
  """The first CPU's cache sizes by level (Linux's sysfs; the largest of a level's caches)."""
  sizes = {}
  for folder in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
    with open(os.path.join(folder, "level")) as f, open(os.path.join(folder, "size")) as g:
      level, text = int(f.read()), g.read().strip()
    size = int(text.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    sizes[level] = max(size, sizes.get(level, 0))
  return sizes or {2: 1 << 20, 3: 32 << 20}


CACHES = cache_bytes()


def rotated_us(calls: dict, rounds: int) -> dict:
  """Thread CPU per call of each kind, every kind called once per round in turn."""
  seconds = collections.defaultdict(float)
  try:
    jax.block_until_ready([fn(*a, **k) for fn, a, k in calls.values()])
    for _ in range(rounds):
      outs = []
      for name, (fn, a, k) in calls.items():
        start = time.thread_time()
        outs.append(fn(*a, **k))
        seconds[name] += time.thread_time() - start
      jax.block_until_ready(outs)
  except Exception:  # noqa: BLE001 - a call that cannot be made again: no figures
    return {}
  return {name: 1e6 * total / rounds for name, total in seconds.items()}


def cold_us(fn, args, kwargs, calls: int, sweep_bytes: int) -> float | None:
  """Thread CPU per call of `fn(*args)`, `sweep_bytes` written over before each call."""
  sweep = np.ones(sweep_bytes // 8)
  total = 0.0
  try:
    jax.block_until_ready(fn(*args, **kwargs))
    for _ in range(calls):
      sweep += 1.0  # every cache line written: the call finds its code and data evicted
      start = time.thread_time()
      out = fn(*args, **kwargs)
      total += time.thread_time() - start
      jax.block_until_ready(out)
  except Exception:  # noqa: BLE001
    return None
  return 1e6 * total / calls


def _median_us(seconds: list, ready: list, which: bool) -> float | None:
  picked = [t for t, r in zip(seconds, ready) if r == which]
  return 1e6 * statistics.median(picked) if picked else None


def run_once(case: str, updater_thread: bool, iterations: int, alone_calls: int,
             read_ready: bool) -> dict:
  model, kind = bench_host.shrunk_model(case)
  devices = jax.devices()[:8]
  streams = TrainStreams([bench_host.batches(kind, seed) for seed in range(len(devices))],
                         next(bench_host.batches(kind, 0)))
  config = bench_host.bench_config("layup", len(devices), True, updater_thread)
  runtime = algorithms.build_runtime(config, model, optax.sgd(1e-3), devices, streams)
  runtime.compile()
  runtime.run_until(runtime.iterations_done() + 20 * len(devices), lambda done: None)
  clock = CallClock(read_ready)
  restore = clock.install(runtime)
  runtime.run_until(runtime.iterations_done() + iterations, lambda done: None)
  restore()
  runtime.close()
  cheap = collections.Counter()
  for signature, count in clock.signatures.items():
    f = flops(*clock.examples[signature])
    if f is not None and f < CHEAP_FLOPS:
      cheap[signature[0]] += count
  rotated = rotated_us({name: clock.first_call(name) for name in clock.seconds}, alone_calls)
  rows = {}
  for name, seconds in clock.seconds.items():
    rows[name] = {
        "calls_per_iteration": len(seconds) / iterations,
        "cheap_per_iteration": cheap[name] / iterations,
        "in_run_us": 1e6 * statistics.median(seconds),
        "inputs_ready_share": sum(clock.ready[name]) / len(seconds) if read_ready else None,
        "in_run_ready_us": _median_us(seconds, clock.ready[name], True),
        "in_run_waiting_us": _median_us(seconds, clock.ready[name], False),
        "alone_us": alone_us(*clock.first_call(name), alone_calls),
        "rotated_us": rotated.get(name),
        "l2_cold_us": cold_us(*clock.first_call(name), max(alone_calls // 10, 10),
                              2 * CACHES.get(2, CACHES[max(CACHES)])),
        "cold_us": cold_us(*clock.first_call(name), max(alone_calls // 10, 10),
                           2 * CACHES[max(CACHES)]),
    }
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--case", default="resnet18-cifar", choices=bench_host.CASES)
  parser.add_argument("--iterations", type=int, default=480, help="device-iterations recorded")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--alone", type=int, default=300, help="calls of each program alone")
  parser.add_argument("--updater-thread", nargs="+", default=["on", "off"], choices=["on", "off"])
  parser.add_argument("--inputs-ready", action="store_true",
                      help="record whether each call's inputs were computed (touches them first)")
  parser.add_argument("--split-cores", action="store_true",
                      help="XLA's threads on the first CPU, the dispatching on the others")
  allocator_choice.add_option(parser)
  parser.add_argument("--out", default="bench_dispatch.json")
  args = parser.parse_args()
  host_allocator = allocator_choice.use(args.allocator)
  split = bench_host.split_cores() if args.split_cores else None

  runs = collections.defaultdict(list)
  for r in range(args.repeats):
    order = args.updater_thread if r % 2 == 0 else args.updater_thread[::-1]
    for thread in order:
      runs[thread].append(run_once(args.case, thread == "on", args.iterations, args.alone,
                                        args.inputs_ready))
      print(f"repeat {r + 1}, updater thread {thread}: done", flush=True)

  table = []
  for thread, repeats in runs.items():
    for name in sorted({n for rows in repeats for n in rows}):
      got = [rows[name] for rows in repeats if name in rows]
      median = lambda key, got=got: (
          statistics.median(g[key] for g in got if g[key] is not None)
          if any(g[key] is not None for g in got) else None)
      row = {"updater_thread": thread == "on", "program": name,
             **{key: median(key) for key in ("calls_per_iteration", "cheap_per_iteration",
                                             "in_run_us", "inputs_ready_share", "in_run_ready_us",
                                             "in_run_waiting_us", "alone_us", "rotated_us",
                                             "l2_cold_us", "cold_us")},
             "in_run_us_all": [g["in_run_us"] for g in got]}
      row["run_over_alone"] = (row["in_run_us"] / row["alone_us"] if row["alone_us"] else None)
      table.append(row)

  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  print(f"\n{args.case}, {args.iterations} device-iterations per run, medians of {args.repeats}, "
        f"host allocator {host_allocator}"
        + ("" if split is None else f", XLA's threads on CPUs {sorted(split[0])}, the "
                                     f"dispatching on {sorted(split[1])}"))
  print(f"{'upd.th':<7}{'program':<22}{'calls/it':>9}{'cheap/it':>9}{'in run us':>10}"
        f"{'ready':>6}{'alone us':>9}{'rotated':>8}{'L2 cold':>8}{'cold us':>8}{'run/alone':>10}")
  for row in table:
    print(f"{'on' if row['updater_thread'] else 'off':<7}{row['program']:<22}"
          f"{row['calls_per_iteration']:>9.2f}{row['cheap_per_iteration']:>9.2f}"
          f"{row['in_run_us']:>10.1f}{fmt(row['inputs_ready_share'], '.2f'):>6}"
          f"{fmt(row['alone_us'], '.1f'):>9}"
          f"{fmt(row['rotated_us'], '.1f'):>8}{fmt(row['l2_cold_us'], '.1f'):>8}"
          f"{fmt(row['cold_us'], '.1f'):>8}"
          f"{fmt(row['run_over_alone'], '.2f'):>10}")
  result = {"benchmark": "bench_dispatch", "case": args.case, "iterations": args.iterations,
            "repeats": args.repeats, "machine": platform.machine(), "cores": os.cpu_count(),
            "jax": jax.__version__, "python": platform.python_version(),
            "code_version": provenance.code_version(), "measured": time.strftime("%Y-%m-%d %H:%M"),
            "host_allocator": host_allocator, "cache_bytes": CACHES,
            "split_cores": None if split is None else {"devices": sorted(split[0]),
                                                       "host": sorted(split[1]),
                                                       "thread_cpus": bench_host.thread_cpus()},
            "table": table}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
