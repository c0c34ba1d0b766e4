"""What the threaded runtime costs the host, in four modes (first argument; default `iteration`).

  iteration  host time per device-iteration: can one host feed eight GPUs?
  dispatch   what one program's dispatch costs the host inside a LayUp run, against the same
             call alone
  runtime    what LayUp's threads and gossip cost: two ratios measured side by side, and how
             far a compute thread dispatches ahead (`--ahead`)
  profile    a `jax.profiler` trace of LayUp's threaded runtime, and where its time goes

    python scripts/bench_host.py --out runs/bench_host.json                 # iteration
    python scripts/bench_host.py dispatch --case resnet50-cifar --updater-thread off
    python scripts/bench_host.py runtime --repeats 15 --gossip-cases digits resnet18-cifar
    python scripts/bench_host.py profile --num-devices 1 --iterations 100 --out runs/profile

`python scripts/bench_host.py MODE --help` lists a mode's options. Every mode takes
`--allocator`: `system` runs the script under the C library's malloc; the default, `auto`,
starts it again under TCMalloc or jemalloc where one is installed, as `python -m
layup_jax.train` does (`tuning.host_allocator`, layup_jax/measure/bench_options.py).

## iteration (was scripts/bench_host.py)

On a GPU a device-iteration of LayUp costs the host what it takes to dispatch it: the stage
programs, the updates, the copies to peers and the merges, from the runtime's dispatcher and
updater threads (layup_jax/runtime/engine.py; `--updater-thread off` runs the updater's tasks on
the dispatcher's thread; `--granularity per_layer` the models' finer stages; `--pin-threads on`
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
start). Launches and transfers per device-iteration are counted in a separate block with every
jitted function of the runtime and every copy to a device wrapped in a counter (the wrappers
cost host time, so that block is not timed). Batches cycle through 4 prepared ones: reading data
is the input pipeline's budget (`scripts/bench_io.py input`), not this one. Latency sampling is
off.

  python scripts/bench_host.py --cases resnet18-cifar --algorithms layup --repeats 5
  python scripts/bench_host.py --cases resnet18-cifar --algorithms layup --stages-per-group 1 2 5
  python scripts/bench_host.py --cases resnet18-cifar resnet50-cifar --algorithms layup \\
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
iteration's forwards as one program and stage by stage (`tuning.chain_forwards`).

## dispatch (was scripts/bench_dispatch.py)

`iteration` gives the host's time per device-iteration; this splits it by program. On the
shrunk model structures above (8 fake CPU devices, latency sampling off), every jitted function
of the runtime is wrapped to record the CPU time of the calling thread (`time.thread_time`) over
each call, by the function's name (`forward`, `backward_update`, `backward_update_mix`,
`loss_update`, `merge`, ...), during a threaded run of `--iterations` device-iterations (one row
per `--updater-thread` value). Afterwards, with the runtime's threads stopped, the first recorded
call of each kind is made again `--alone` times from this thread, its inputs computed and
nothing else running: the same program, the same arguments.

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
so the run's wall time here is not `iteration`'s figure. Medians over `--repeats` runs, each on
a fresh runtime, alternating the `--updater-thread` rows. `--split-cores` (as `iteration`'s)
starts XLA's threads on the first CPU and runs the runtime's threads, and the calls alone, on
the others: whether a call costs more in a run because the devices' work shares the
dispatching thread's cores.

  python scripts/bench_host.py dispatch
  python scripts/bench_host.py dispatch --split-cores

## runtime (was scripts/bench_runtime.py)

  one device: the full runtime (compute thread + updater thread, no peer) against the bare
              staged step (`iterate_serial`: the same per-stage functions on one thread), time
              per iteration. Target <= 1.05.
  gossip:     LayUp on `--num-devices` devices, time per step with gossip on against off (local
              steps only, `layup.gossip=False`). Target <= 1.10: communication is hidden.
              For each of `--gossip-cases`: the digits task, where a step's compute is small
              against a send's fixed costs, and ResNet-18 on CIFAR-shaped random batches of 32.
  ahead:      with `--ahead 1 2 4`, the digits task on `--num-devices` devices for each value of
              `tuning.max_dispatch_ahead` (how many iterations a compute thread may dispatch
              before its device has produced the oldest one's loss): time per step, and the
              consensus test accuracy after the run's 70 steps (fresher parameters against
              more overlap).

Compilation excluded: both sides of a ratio are built, compiled and warmed up once, then timed
in short blocks (`--iterations` iterations on one device; 10 steps of digits, 1 of ResNet-18),
alternating sides, `--repeats` rounds; the ratio is the median of the per-round ratios, so both
sides see the same moments of a shared machine. `--ahead` runs each value `--repeats` times.

  python scripts/bench_host.py runtime --repeats 3 --gossip-cases digits --ahead 1 2 4 \\
      --out docs/results/bench_ahead.json

## profile (was scripts/profile_step.py)

Trains the digits task (or `--model resnet18` on CIFAR-shaped random batches) on
`--num-devices` devices inside `jax.profiler.trace`, writes the trace to `--out` (open it in
Perfetto, ui.perfetto.dev, or TensorBoard's profile plugin) and prints the events that took the
most time in total, per thread: jitted stage functions (`PjitFunction(forward)`, ...),
transfers, the XLA executors' work, and Python functions (the trace includes a Python tracer, so
times are inflated; read them as shares).
"""

import argparse
import collections
import dataclasses
import functools
import glob
import itertools
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax

from configs import digits
from layup_jax import algorithms, data, defaults, models, optim
from layup_jax.algorithms import ddp
from layup_jax.algorithms.base import init_model
from layup_jax.data import TrainStreams
from layup_jax.data.pipeline import Batch, random_image_batches
from layup_jax.measure import bench_options, provenance, sidebyside
from layup_jax.measure.bench_options import split_cores, thread_cpus
from layup_jax.models import gpt2, resnet, staged
from layup_jax.run.evaluation import Evaluator
from layup_jax.runtime import transfer

MODES = ("iteration", "dispatch", "runtime", "profile")

# --- shared: the shrunk model structures and their runtimes ------------------------------------

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


def set_tuning(config, name: str, value) -> None:
  """`config.tuning.<name> = value`. An older checkout measured with this script
  (`scripts/bench_gpu.sh BEFORE`) may keep the key under `layup`, or not have it: it is set
  there, or left out."""
  for section in ("tuning", "layup"):
    if section in config and name in config[section]:
      config[section][name] = value
      return


def bench_config(algorithm: str, num_devices: int, fuse: bool = True,
                 updater_thread: bool = True, pin: str = "off", chain: bool = False):
  config = defaults.get_config()
  config.algorithm, config.num_devices = algorithm, num_devices
  set_tuning(config, "fuse_local_step", fuse)
  set_tuning(config, "updater_thread", updater_thread)
  set_tuning(config, "pin_host_threads", pin)
  set_tuning(config, "chain_forwards", chain)
  config.metrics.latency_every = 0
  config.baselines.tau = config.baselines.out_freq = 4
  config.faults.nonfinite = "skip"  # widths 2 can make a gradient non-finite; the run goes on
  return config


# --- iteration ----------------------------------------------------------------------------------

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


def main_iteration(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_host.py [iteration]",
      description="Host time per device-iteration of the threaded runtime on shrunk models.")
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
  bench_options.add_option(parser)
  parser.add_argument("--out", default="bench_host.json")
  args = parser.parse_args(argv)
  host_allocator = bench_options.use(args.allocator)
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


# --- dispatch -----------------------------------------------------------------------------------

CHEAP_FLOPS = 1000  # XLA's CPU client: below this a program runs on the calling thread


class CallClock(Counter):
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


@functools.cache
def cache_bytes() -> dict[int, int]:
  """The first CPU's cache sizes by level (Linux's sysfs; the largest of a level's caches),
  read once per process."""
  sizes = {}
  for folder in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
    with open(os.path.join(folder, "level")) as f, open(os.path.join(folder, "size")) as g:
      level, text = int(f.read()), g.read().strip()
    size = int(text.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    sizes[level] = max(size, sizes.get(level, 0))
  return sizes or {2: 1 << 20, 3: 32 << 20}


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


def dispatch_once(case: str, updater_thread: bool, iterations: int, alone_calls: int,
                  read_ready: bool) -> dict:
  model, kind = shrunk_model(case)
  devices = jax.devices()[:8]
  streams = TrainStreams([batches(kind, seed) for seed in range(len(devices))],
                         next(batches(kind, 0)))
  config = bench_config("layup", len(devices), True, updater_thread)
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
  caches = cache_bytes()
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
                              2 * caches.get(2, caches[max(caches)])),
        "cold_us": cold_us(*clock.first_call(name), max(alone_calls // 10, 10),
                           2 * caches[max(caches)]),
    }
  return rows


def main_dispatch(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_host.py dispatch",
      description="What one program's dispatch costs the host inside a LayUp run, against the "
                  "same call alone.")
  parser.add_argument("--case", default="resnet18-cifar", choices=CASES)
  parser.add_argument("--iterations", type=int, default=480, help="device-iterations recorded")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--alone", type=int, default=300, help="calls of each program alone")
  parser.add_argument("--updater-thread", nargs="+", default=["on", "off"], choices=["on", "off"])
  parser.add_argument("--inputs-ready", action="store_true",
                      help="record whether each call's inputs were computed (touches them first)")
  parser.add_argument("--split-cores", action="store_true",
                      help="XLA's threads on the first CPU, the dispatching on the others")
  bench_options.add_option(parser)
  parser.add_argument("--out", default="bench_dispatch.json")
  args = parser.parse_args(argv)
  host_allocator = bench_options.use(args.allocator)
  split = split_cores() if args.split_cores else None

  runs = collections.defaultdict(list)
  for r in range(args.repeats):
    order = args.updater_thread if r % 2 == 0 else args.updater_thread[::-1]
    for thread in order:
      runs[thread].append(dispatch_once(args.case, thread == "on", args.iterations, args.alone,
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
            "host_allocator": host_allocator, "cache_bytes": cache_bytes(),
            "split_cores": None if split is None else {"devices": sorted(split[0]),
                                                       "host": sorted(split[1]),
                                                       "thread_cpus": thread_cpus()},
            "table": table}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


# --- runtime ------------------------------------------------------------------------------------

STEPS = {"digits": 10, "resnet18-cifar": 1}  # steps per timed block


class _NoData:
  def close(self) -> None:
    pass


def build(num_devices: int, gossip: bool = True, case: str = "digits", ahead: int = 1):
  """A compiled LayUp runtime of `case` and its dataset (something to close)."""
  if case == "resnet18-cifar":
    return build_resnet18(num_devices, gossip)
  config = digits.get_config()
  config.num_devices, config.layup.gossip = num_devices, gossip
  config.tuning.max_dispatch_ahead = ahead
  dataset = data.make_dataset(config.data, num_devices, config.seed)
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000, dataset.steps_per_epoch)
  runtime = algorithms.build_runtime(config, model, tx, jax.devices()[:num_devices], dataset)
  runtime.compile()
  return runtime, dataset


def build_resnet18(num_devices: int, gossip: bool):
  config = defaults.get_config()
  config.model.name, config.model.num_classes, config.data.batch_size = "resnet18", 100, 32
  config.num_devices, config.layup.gossip, config.metrics.latency_every = num_devices, gossip, 0
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000)
  image_batches = [random_image_batches(32, 32, 100, seed) for seed in range(num_devices)]
  streams = data.TrainStreams(image_batches, next(random_image_batches(32, 32, 100, 0)))
  runtime = algorithms.build_runtime(config, model, tx, jax.devices()[:num_devices], streams)
  runtime.compile()
  return runtime, _NoData()


def ahead_run(num_devices: int, ahead: int, warmup: int = 10, steps: int = 60):
  """Seconds per step of digits with `max_dispatch_ahead=ahead`, and the final test accuracy."""
  runtime, dataset = build(num_devices, ahead=ahead)
  runtime.run_until(warmup * num_devices, lambda done: None)
  start = time.perf_counter()
  runtime.run_until((warmup + steps) * num_devices, lambda done: None)
  elapsed = time.perf_counter() - start
  evaluator = Evaluator(models.make_model(digits.get_config().model), dataset.test,
                        jax.devices()[0])
  accuracy = evaluator.evaluate(runtime.stats.snapshot())["accuracy"]
  runtime.close()
  dataset.close()
  return elapsed / steps, accuracy


def main_runtime(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_host.py runtime",
      description="What LayUp's threads and gossip cost: two ratios, each measured side by side.")
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--iterations", type=int, default=50,
                      help="one-device iterations per timed block")
  parser.add_argument("--gossip-cases", nargs="+", default=["digits"], choices=sorted(STEPS))
  parser.add_argument("--ahead", nargs="*", type=int, default=[],
                      help="values of tuning.max_dispatch_ahead to compare (digits)")
  parser.add_argument("--repeats", type=int, default=15, help="rounds of timed blocks")
  bench_options.add_option(parser)
  parser.add_argument("--out", default="bench_runtime.json")
  args = parser.parse_args(argv)
  host_allocator = bench_options.use(args.allocator)
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="layup_jax_cache_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  interleaved, median_ratio = sidebyside.interleaved, sidebyside.median_ratio

  # One device: the threaded runtime against the bare staged step, both built once.
  (serial, serial_data), (threaded, threaded_data) = build(1), build(1)
  block = args.iterations
  one = interleaved(
      {"serial": lambda: sidebyside.serial_block(lambda: serial.iterate_serial(0), block),
       "threaded": lambda: sidebyside.threaded_block(threaded, block)},
      args.repeats, {"serial": block, "threaded": block})
  threaded.close()
  for closing in (serial_data, threaded_data):
    closing.close()
  table = {"serial_ms": 1e3 * statistics.median(one["serial"]),
           "one_device_threaded_ms": 1e3 * statistics.median(one["threaded"]),
           "one_device_ratio": median_ratio(one["threaded"], one["serial"])}
  runs = {"one_device_serial_ms": [1e3 * t for t in one["serial"]],
          "one_device_threaded_ms": [1e3 * t for t in one["threaded"]]}
  print(f"one device: {table['one_device_threaded_ms']:.2f} ms threaded vs "
        f"{table['serial_ms']:.2f} ms serial per iteration ({table['one_device_ratio']:.3f})",
        flush=True)
  for case in args.gossip_cases:  # gossip on and off, both runtimes built once
    steps = STEPS[case]
    built = {side: build(args.num_devices, side == "on", case) for side in ("on", "off")}
    units = {side: steps for side in built}
    times = interleaved(
        {side: (lambda rt=runtime, n=steps: sidebyside.threaded_block(rt, n * args.num_devices))
         for side, (runtime, _) in built.items()},
        args.repeats, units)
    for runtime, dataset in built.values():
      runtime.close()
      dataset.close()
    table.update({f"{case}_gossip_on_ms_per_step": 1e3 * statistics.median(times["on"]),
                  f"{case}_gossip_off_ms_per_step": 1e3 * statistics.median(times["off"]),
                  f"{case}_gossip_ratio": median_ratio(times["on"], times["off"])})
    runs.update({f"{case}_gossip_{side}_ms_per_step": [1e3 * t for t in times[side]]
                 for side in times})
    print(f"{case}, {args.num_devices} devices: gossip on "
          f"{table[f'{case}_gossip_on_ms_per_step']:.1f} vs off "
          f"{table[f'{case}_gossip_off_ms_per_step']:.1f} ms/step "
          f"({table[f'{case}_gossip_ratio']:.3f})", flush=True)
  ahead_runs = []
  for repeat in range(args.repeats if args.ahead else 0):
    for ahead in (args.ahead[::-1] if repeat % 2 else args.ahead):
      seconds, accuracy = ahead_run(args.num_devices, ahead)
      ahead_runs.append({"ahead": ahead, "ms_per_step": 1e3 * seconds, "accuracy": accuracy})
      print(f"  max_dispatch_ahead {ahead}: {1e3 * seconds:.1f} ms/step, test accuracy "
            f"{accuracy:.4f} after 70 steps", flush=True)
  for ahead in args.ahead:
    mine = [r for r in ahead_runs if r["ahead"] == ahead]
    table[f"ahead{ahead}_ms_per_step"] = statistics.median(r["ms_per_step"] for r in mine)
    table[f"ahead{ahead}_accuracy"] = statistics.median(r["accuracy"] for r in mine)

  print(f"\n{'measure':<48}{'median':>10}{'target':>9}")
  print(f"{'one device (digits): runtime / bare staged step':<48}"
        f"{table['one_device_ratio']:>10.3f}{'<= 1.05':>9}")
  gossip_rows = []
  for case in args.gossip_cases:
    gossip_rows.append({"case": case, "ratio": table[f"{case}_gossip_ratio"],
                        "on_ms_per_step": table[f"{case}_gossip_on_ms_per_step"],
                        "off_ms_per_step": table[f"{case}_gossip_off_ms_per_step"]})
    print(f"{f'{case}, {args.num_devices} devices: gossip on / off':<48}"
          f"{table[f'{case}_gossip_ratio']:>10.3f}{'<= 1.10':>9}")
  ahead_rows = []
  for ahead in args.ahead:
    ahead_rows.append({"ahead": ahead, "ms_per_step": table[f"ahead{ahead}_ms_per_step"],
                       "accuracy": table[f"ahead{ahead}_accuracy"]})
    print(f"{f'digits, max_dispatch_ahead {ahead}: ms/step, accuracy':<48}"
          f"{table[f'ahead{ahead}_ms_per_step']:>10.1f}{table[f'ahead{ahead}_accuracy']:>9.4f}")
  print(f"(medians of {args.repeats} repeats, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__})")
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "args": vars(args), "host_allocator": host_allocator,
               "table": table, "gossip": gossip_rows,
               "ahead": ahead_rows, "runs": runs, "ahead_runs": ahead_runs}, f, indent=2)


# --- profile ------------------------------------------------------------------------------------

def build_profiled(model_name: str, num_devices: int, gossip: bool):
  config = digits.get_config()
  config.num_devices, config.layup.gossip = num_devices, gossip
  devices = jax.devices()[:num_devices]
  if model_name == "digits":
    dataset = data.make_dataset(config.data, num_devices, config.seed)
    model = models.make_model(config.model)
    tx = optim.make_optimizer(config.optimizer, 10_000, dataset.steps_per_epoch)
    return algorithms.build_runtime(config, model, tx, devices, dataset), dataset
  config.model.name, config.model.num_classes = "resnet18", 100
  model, tx = models.make_model(config.model), optim.make_optimizer(config.optimizer, 10_000)
  config.metrics.latency_every = 0
  streams = data.TrainStreams([random_image_batches(32, 32, 100, i) for i in range(num_devices)],
                              next(random_image_batches(32, 32, 100, 0)))
  runtime = algorithms.build_runtime(config, model, tx, devices, streams)
  return runtime, None


def summarize(trace_dir: pathlib.Path, top: int) -> None:
  """Prints the events with the largest total duration, by thread and name."""
  path, events = bench_options.newest_perfetto(trace_dir)
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  total, count = collections.defaultdict(float), collections.Counter()
  for event in events:
    if event.get("ph") == "X":
      key = (threads.get((event["pid"], event["tid"]), str(event["tid"])), event["name"][:70])
      total[key] += event.get("dur", 0.0)
      count[key] += 1
  print(f"{'total ms':>10}{'calls':>8}  thread / event   (trace: {path})")
  for key, micros in sorted(total.items(), key=lambda item: -item[1])[:top]:
    print(f"{micros / 1e3:>10.1f}{count[key]:>8}  {key[0][:28]:<28} {key[1]}")


def main_profile(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_host.py profile",
      description="A jax.profiler trace of LayUp's threaded runtime, and where its time goes.")
  parser.add_argument("--model", default="digits", choices=["digits", "resnet18"])
  parser.add_argument("--num-devices", type=int, default=1)
  parser.add_argument("--iterations", type=int, default=100, help="per device, traced")
  parser.add_argument("--no-gossip", action="store_true")
  parser.add_argument("--top", type=int, default=30)
  bench_options.add_option(parser)
  parser.add_argument("--out", default="runs/profile")
  args = parser.parse_args(argv)
  host_allocator = bench_options.use(args.allocator)
  runtime, dataset = build_profiled(args.model, args.num_devices, not args.no_gossip)
  runtime.compile()
  warmup = 10 * args.num_devices
  runtime.run_until(warmup, lambda done: None)
  with jax.profiler.trace(args.out, create_perfetto_trace=True):
    start = time.perf_counter()
    runtime.run_until(warmup + args.iterations * args.num_devices, lambda done: None)
    seconds = time.perf_counter() - start
  runtime.close()
  if dataset is not None:
    dataset.close()
  print(f"{1e3 * seconds / args.iterations:.2f} ms per step while tracing "
        f"({args.num_devices} devices, {args.model}, host allocator {host_allocator})")
  summarize(pathlib.Path(args.out), args.top)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return
  mode, argv = (argv[0], argv[1:]) if argv and argv[0] in MODES else ("iteration", argv)
  {"iteration": main_iteration, "dispatch": main_dispatch, "runtime": main_runtime,
   "profile": main_profile}[mode](argv)


if __name__ == "__main__":
  main()
