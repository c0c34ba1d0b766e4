"""Host time per device-iteration of the threaded runtime: can one host feed eight GPUs?

On a GPU a device-iteration of LayUp costs the host what it takes to dispatch it: the stage
programs, the updates, the copies to peers and the merges, from the runtime's dispatcher and
updater threads (layup_jax/runtime/engine.py; `--updater-thread off` runs the updater's tasks on the
dispatcher's thread; `--granularity per_layer` the models' finer stages; `--pin-threads on`
the two threads on one CPU, `tuning.pin_host_threads`). Here the paper's model *structures*
(their stage counts and the kinds of stage) are shrunk until the device's own work
is negligible (widths 2, batch 2, 8x8 images or 4 tokens; the `fused_step_ms` column is one
device's whole jitted training step on the same model, an upper bound on its device time), so
that the wall time of a run on 8 fake CPU devices is the host's time:

  host_ms_per_iteration = wall time / (steps x devices)    (median over --repeats blocks)

and its inverse is the ceiling on device-iterations per second each of 8 devices can be fed,
shown next to what the paper's A100s ran at (appendix Table A5: forward+backward of ResNet-18
CIFAR at batch 128 in 15.1 ms, 66 per second; ResNet-50 in 46.5 ms, 21.5 per second; so a host
must spend <= 1.9 ms and <= 5.8 ms per device-iteration to keep 8 of them busy). `cpu_ms` is the
process's CPU time over the same blocks (on 2 cores it may exceed the wall time; it includes
the fake devices' execution), `threads` the CPU time of the dispatcher and updater threads
alone (the host's dispatching, without the device work that XLA's CPU client runs on threads
of its own), and `serial_ms` (LayUp and GoSGD) the same iterations dispatched from one
thread, device after device, each waiting for its loss (`iterate_serial`, before the threads
start). Launches and
transfers per device-iteration are counted in a separate block with every jitted function of
the runtime and every copy to a device wrapped in a counter (the wrappers cost host time, so
that block is not timed). Batches cycle through 4 prepared ones: reading data is the input
pipeline's budget (`scripts/bench_input.py`), not this one. Latency sampling is off.

  python scripts/bench_host.py --out docs/results/bench_host.json
  python scripts/bench_host.py --cases resnet18-cifar --algorithms layup --repeats 5
  python scripts/bench_host.py --cases resnet18-cifar --algorithms layup --stages-per-group 1 2 5
  python scripts/bench_host.py --cases resnet18-cifar resnet50-cifar --algorithms layup \
      --updater-thread on off
  python scripts/bench_host.py --cases resnet18-cifar --algorithms layup --split-cores

`--split-cores` measures what the budget asks of a host whose devices are not its CPUs: XLA's
threads (the fake devices' work) are started on the first of the process's CPUs and the rest of
the process, the runtime's dispatcher and updater threads and the serial block's thread among
them, runs on the others, so no device work shares a core with the dispatching. On a 2-core
machine that is one core each, and the devices' work on its one core is then slower than the
host's: `host ms/it` is the host's figure only while the devices keep up (the `threads` column,
the dispatching's own CPU time, is the figure either way). Where the threads may run is counted
after each row (`thread_cpus` in the JSON: how many of the process's threads on which CPUs), so a
thread XLA started later on the dispatching side would show.

`--stages-per-group` runs the model with consecutive stages grouped (`model.stages_per_group`):
fewer, larger stages, so fewer programs, sends and merges per iteration. `--fuse-local-step on
off` runs each algorithm with and without the local step in the backward's program
(`tuning.fuse_local_step`), one row after the other; `--chain-forwards on off` with an
iteration's forwards as one program and stage by stage (`tuning.chain_forwards`). `--allocator
system` runs the script under the C library's malloc; the default, `auto`, starts it again
under TCMalloc or jemalloc where one is installed, as `python -m layup_jax.train` does
(`host_allocator`, docs/host.md).
"""

import argparse
import dataclasses
import functools
import itertools
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
import jax
import numpy as np
import optax

from configs import base
from layup_jax import algorithms
from layup_jax.algorithms import ddp
from layup_jax.algorithms.base import init_model
from layup_jax.data import TrainStreams
from layup_jax.data.pipeline import Batch
from layup_jax.measure import provenance, sidebyside
from layup_jax.models import gpt2, resnet, staged
from layup_jax.runtime import transfer

# The paper's A100 rates (appendix Table A5), device-iterations per second per device.
PAPER_RATE = {"resnet18-cifar": 1e3 / 15.1, "resnet50-cifar": 1e3 / 46.5}
CASES = ("resnet18-cifar", "resnet50-cifar", "gpt2-124m", "digits")
ALGORITHMS = ("layup", "gosgd", "adpsgd", "local_sgd")
SERIAL = ("layup", "gosgd")  # also timed with every iteration dispatched from one thread


def shrunk_model(case: str, granularity: str = "per_block") -> tuple[staged.StagedModel, str]:
  """The case's stage structure at negligible size, and its input kind; `granularity` is
  `model.granularity` (per_layer: every convolution, or each half of a transformer block, a
  stage of its own). The default granularity is passed by omission, so that this script also
  measures an older checkout of the package (`scripts/bench_gpu.sh BEFORE`)."""
  fine = {} if granularity == "per_block" else {"granularity": granularity}
  if case == "resnet18-cifar":
    return staged.StagedModel(resnet.resnet((2, 2, 2, 2), (2, 2, 2, 2), 10, **fine)), "image"
  if case == "resnet50-cifar":
    return staged.StagedModel(resnet.resnet((3, 4, 6, 3), (2, 2, 2, 2), 10, bottleneck=True,
                                            **fine)), "image"
  if case == "digits":  # configs/digits.py's structure: widths (16, 32), one block each
    return staged.StagedModel(resnet.small_resnet((2, 2), 1, 10, **fine)), "image"
  if case == "gpt2-124m":  # 12 blocks between the embedding and the tied head: 14 stages
    gpt2.SIZES["bench-124m-shape"] = gpt2.GPT2Size(num_layers=12, embed_dim=8, num_heads=2)
    return gpt2.gpt2("bench-124m-shape", vocab_size=16, max_len=4, **fine), "tokens"
  raise ValueError(case)


def threads_cpu_s(runtime) -> float | None:
  """CPU time of the runtime's threads so far (None: a runtime that does not count it, as in
  checkouts before the statistics object)."""
  host_cpu_s = getattr(getattr(runtime, "stats", None), "host_cpu_s", None)
  return host_cpu_s() if host_cpu_s is not None else None


def batches(kind: str, seed: int, count: int = 4):
  rng = np.random.default_rng(seed)
  if kind == "image":
    made = [Batch(rng.normal(size=(2, 8, 8, 3)).astype(np.float32),
                  rng.integers(0, 10, 2).astype(np.int32)) for _ in range(count)]
  else:
    tokens = [rng.integers(0, 16, (2, 5)).astype(np.int32) for _ in range(count)]
    made = [Batch(t[:, :-1], t[:, 1:]) for t in tokens]
  return itertools.cycle(made)


def bench_config(algorithm: str, num_devices: int, fuse: bool = True,
                 updater_thread: bool = True, pin: str = "off", chain: bool = False):
  config = base.get_config()
  config.algorithm, config.num_devices = algorithm, num_devices
  config.tuning.fuse_local_step = fuse
  if "updater_thread" in config.layup:  # (an earlier runtime, benchmarked side by side, has none)
    config.tuning.updater_thread = updater_thread
  if "pin_host_threads" in config.layup:
    config.tuning.pin_host_threads = pin
  if "chain_forwards" in config.layup:
    config.tuning.chain_forwards = chain
  config.metrics.latency_every = 0
  config.baselines.tau = config.baselines.out_freq = 4
  config.faults.nonfinite = "skip"  # widths 2 can make a gradient non-finite; the run goes on
  return config


def fused_step_ms(model, kind: str, repeats: int = 30) -> float:
  """One device's fused jitted training step on the shrunk model, waited for: an upper bound
  on the device time of one iteration (it includes one dispatch)."""
  device = jax.devices()[0]
  train = batches(kind, 0)
  example = next(train)
  config = bench_config("ddp", 1)
  params, state = init_model(config, model, example)
  tx = optax.sgd(0.01)
  step = jax.jit(functools.partial(ddp.train_step, model, tx))
  carry = jax.device_put((params, state, tx.init(params)), device)
  key, iteration = jax.device_put((jax.random.key(0), np.int32(0)), device)
  times = []
  for r in range(repeats + 3):
    batch = jax.device_put((example.inputs, example.targets), device)
    start = time.perf_counter()
    *carry, loss, _ = step(*carry, *batch, key, iteration)
    jax.block_until_ready(loss)
    if r >= 3:
      times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


class Counter:
  """Wraps the runtime's jitted functions and copies to a device, counting calls."""

  def __init__(self):
    self.launches = 0
    self.transfers = 0

  def wrap_jitted(self, fn):
    if not hasattr(fn, "lower"):
      return fn

    @functools.wraps(fn)
    def counted(*args, **kwargs):
      self.launches += 1
      return fn(*args, **kwargs)
    return counted

  def install(self, runtime) -> callable:
    """Counts from now on; returns a function that undoes it."""
    undo = []

    def swap(owner, name, new):
      old = getattr(owner, name)
      setattr(owner, name, new)
      undo.append((owner, name, old))

    store = runtime.store

    def wrapped(value):
      if isinstance(value, tuple):
        return tuple(map(self.wrap_jitted, value))
      if isinstance(value, dict):
        return {k: self.wrap_jitted(v) for k, v in value.items()}
      return self.wrap_jitted(value)

    swap(store, "steps", dataclasses.replace(store.steps, **{
        field.name: wrapped(getattr(store.steps, field.name))
        for field in dataclasses.fields(store.steps)}))
    for owner in (store, runtime.exchange):
      for name, value in list(vars(owner).items()):
        if hasattr(value, "lower") and callable(value):
          swap(owner, name, self.wrap_jitted(value))
        elif isinstance(value, dict) and value and all(hasattr(v, "lower") for v in value.values()):
          swap(owner, name, {k: self.wrap_jitted(v) for k, v in value.items()})
    for clock in getattr(runtime, "clocks", None) or runtime._clocks:
      for name, value in list(vars(clock).items()):
        if hasattr(value, "lower") and callable(value):
          swap(clock, name, self.wrap_jitted(value))
    to_device = transfer.to_device

    def counted_to_device(tree, device):
      self.transfers += len(jax.tree.leaves(tree))
      return to_device(tree, device)
    swap(transfer, "to_device", counted_to_device)

    def restore():
      for owner, name, old in reversed(undo):
        setattr(owner, name, old)
    return restore


def bench(case: str, algorithm: str, num_devices: int, steps: int, repeats: int,
          per_group: int = 1, fuse: bool = True, updater_thread: bool = True,
          granularity: str = "per_block", pin: str = "off", chain: bool = False) -> dict:
  model, kind = shrunk_model(case, granularity)
  if per_group > 1:
    model = staged.group_stages(model, per_group)
  devices = jax.devices()[:num_devices]
  streams = TrainStreams([batches(kind, seed) for seed in range(num_devices)],
                         next(batches(kind, 0)))
  config = bench_config(algorithm, num_devices, fuse, updater_thread, pin, chain)
  runtime = algorithms.build_runtime(config, model, optax.sgd(1e-3), devices, streams)
  start = time.perf_counter()
  runtime.compile()
  compile_s = time.perf_counter() - start
  per_block = steps * num_devices
  serial = []  # the same iterations dispatched by one thread, device after device
  if algorithm in SERIAL:
    one_step = lambda: [runtime.iterate_serial(i) for i in range(num_devices)]
    serial = [sidebyside.serial_block(one_step, steps) for _ in range(repeats + 1)][1:]
  runtime.run_until(runtime.iterations_done() + per_block, lambda done: None)  # warm-up
  walls, cpus, threads = [], [], []
  for _ in range(repeats):
    target = runtime.iterations_done() + per_block
    wall, cpu, thread = time.perf_counter(), time.process_time(), threads_cpu_s(runtime)
    runtime.run_until(target, lambda done: None)
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
    if thread is not None:
      threads.append(threads_cpu_s(runtime) - thread)
  counter = Counter()
  restore = counter.install(runtime)
  runtime.run_until(runtime.iterations_done() + per_block, lambda done: None)
  restore()
  runtime.close()
  host_ms = 1e3 * statistics.median(walls) / per_block
  ceiling = 1e3 / (host_ms * num_devices)
  return {
      "case": case, "algorithm": algorithm, "num_stages": model.num_stages,
      "stages_per_group": per_group, "granularity": granularity, "fuse_local_step": fuse,
      "updater_thread": updater_thread, "pin_host_threads": pin == "on",
      "chain_forwards": chain,
      "num_devices": num_devices, "steps_per_block": steps, "repeats": repeats,
      "host_ms_per_iteration": host_ms,
      "host_ms_all": [1e3 * w / per_block for w in walls],
      "cpu_ms_per_iteration": 1e3 * statistics.median(cpus) / per_block,
      "thread_cpu_ms_per_iteration": (1e3 * statistics.median(threads) / per_block if threads
                                      else None),
      "serial_ms_per_iteration": (1e3 * statistics.median(serial) / per_block if serial
                                  else None),
      "launches_per_iteration": counter.launches / per_block,
      "transfers_per_iteration": counter.transfers / per_block,
      "ceiling_iterations_per_s_per_device": ceiling,
      "paper_a100_iterations_per_s": PAPER_RATE.get(case),
      "budget_ms_per_iteration": (1e3 / (PAPER_RATE[case] * num_devices)
                                  if case in PAPER_RATE else None),
      "compile_s": compile_s,
  }


def split_cores() -> tuple[set[int], set[int]]:
  """Starts XLA's threads on the first allowed CPU and moves this thread, and every thread it
  starts from now on, to the others (`--split-cores`); returns (devices' CPUs, host's CPUs).
  Must run before anything touches a JAX backend."""
  allowed = sorted(os.sched_getaffinity(0))
  if len(allowed) < 2:
    raise SystemExit("error: --split-cores needs two CPUs or more; this process may use "
                     f"{allowed}")
  devices_cpus, host_cpus = {allowed[0]}, set(allowed[1:])
  os.sched_setaffinity(0, devices_cpus)  # threads inherit their creator's CPUs
  for device in jax.devices():  # the client and each device's threads start here
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32), device) + 1)
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
  parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--steps", type=int, default=20, help="steps (all devices) per block")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--stages-per-group", type=int, nargs="+", default=[1],
                      help="model.stages_per_group values to run (1: the paper's stages)")
  parser.add_argument("--fuse-local-step", nargs="+", default=["on"], choices=["on", "off"],
                      help="tuning.fuse_local_step values to run, one row each (adjacent)")
  parser.add_argument("--updater-thread", nargs="+", default=["on"], choices=["on", "off"],
                      help="tuning.updater_thread values to run, one row each (adjacent)")
  parser.add_argument("--granularity", nargs="+", default=["per_block"],
                      choices=["per_block", "per_layer"],
                      help="model.granularity values to run, one row each (adjacent)")
  parser.add_argument("--pin-threads", nargs="+", default=["off"], choices=["on", "off"],
                      help="tuning.pin_host_threads values to run, one row each (adjacent)")
  parser.add_argument("--chain-forwards", nargs="+", default=["off"], choices=["on", "off"],
                      help="tuning.chain_forwards values to run, one row each (adjacent)")
  parser.add_argument("--split-cores", action="store_true",
                      help="XLA's threads on the first CPU, the dispatching on the others")
  allocator_choice.add_option(parser)
  parser.add_argument("--out", default="bench_host.json")
  args = parser.parse_args()
  host_allocator = allocator_choice.use(args.allocator)
  split = split_cores() if args.split_cores else None

  rows = []
  fused = {}
  for case in args.cases:
    fused[case] = fused_step_ms(*shrunk_model(case))
    for algorithm, per_group, fuse, thread, granularity, pin, chain in itertools.product(
        args.algorithms, args.stages_per_group, args.fuse_local_step, args.updater_thread,
        args.granularity, args.pin_threads, args.chain_forwards):
      row = bench(case, algorithm, args.num_devices, args.steps, args.repeats, per_group,
                  fuse == "on", thread == "on", granularity, pin, chain == "on")
      row["fused_step_ms"] = fused[case]
      row["host_allocator"] = host_allocator
      row["split_cores"] = split is not None
      if split is not None:
        row["thread_cpus"] = thread_cpus()
      rows.append(row)
      print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)

  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  print(f"\nhost allocator: {host_allocator}")
  if split is not None:
    print(f"split cores: XLA's threads on CPUs {sorted(split[0])}, the dispatching on "
          f"{sorted(split[1])}; threads by CPUs allowed at the end: {thread_cpus()}")
  print(f"{'case':<16}{'algorithm':<11}{'stages':>7}{'fused':>6}{'upd.th':>7}{'pin':>4}"
        f"{'chain':>6}"
        f"{'host ms/it':>11}{'serial':>8}{'threads':>8}"
        f"{'cpu ms/it':>10}"
        f"{'launches':>9}{'transfers':>10}{'ceiling/s':>10}{'A100/s':>8}{'budget ms':>10}"
        f"{'fused ms':>9}")
  for r in rows:
    print(f"{r['case']:<16}{r['algorithm']:<11}{r['num_stages']:>7}"
          f"{'on' if r['fuse_local_step'] else 'off':>6}{'on' if r['updater_thread'] else 'off':>7}"
          f"{'on' if r.get('pin_host_threads') else 'off':>4}"
          f"{'on' if r.get('chain_forwards') else 'off':>6}"
          f"{r['host_ms_per_iteration']:>11.2f}{fmt(r.get('serial_ms_per_iteration'), '.2f'):>8}"
          f"{fmt(r.get('thread_cpu_ms_per_iteration'), '.2f'):>8}"
          f"{r['cpu_ms_per_iteration']:>10.2f}"
          f"{r['launches_per_iteration']:>9.1f}{r['transfers_per_iteration']:>10.1f}"
          f"{r['ceiling_iterations_per_s_per_device']:>10.1f}"
          f"{fmt(r['paper_a100_iterations_per_s'], '.1f'):>8}"
          f"{fmt(r['budget_ms_per_iteration'], '.2f'):>10}{r['fused_step_ms']:>9.3f}")
  result = {"benchmark": "bench_host", "machine": platform.machine(),
            "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
            "device": jax.devices()[0].device_kind, "code_version": provenance.code_version(),
            "measured": time.strftime("%Y-%m-%d"),
            "split_cores": None if split is None else {"devices": sorted(split[0]),
                                                       "host": sorted(split[1])},
            "table": rows}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
