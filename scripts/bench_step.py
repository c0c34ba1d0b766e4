"""Per-device iteration time of LayUp's staged step against one fused jitted step.

Fused: one jitted `value_and_grad` + Optax step of the model, batch and optimizer; it waits for
the loss every iteration. Staged, three ways, all on one device without a peer:
  runtime:  LayUp's threaded runtime (compute thread + updater thread), stages packed into one
            flat vector each (the default); iterations run back to back, as in training.
  ahead2:   the runtime with `tuning.max_dispatch_ahead=2`: the compute task dispatches the next
            iteration before reading the last one's loss (the default, 1, reads it first).
  noremat:  the runtime with `tuning.remat="none"`: a stage's forward keeps every residual for
            its backward (the default, "dots", keeps the matrix products' and convolutions'
            outputs and recomputes the elementwise work; the fused step recomputes nothing)
  chained:  the runtime with `tuning.chain_forwards=True`: an iteration's forwards as one
            program (the backwards, updates and sends stay per stage).
  unfused:  the runtime with `tuning.fuse_local_step=False`: the updater thread applies each
            gradient in a program of its own instead of the backward's program applying it.
  serial:   the same per-stage functions dispatched from one thread (`iterate_serial`: forwards
            returning VJPs, VJPs in reverse, one Optax update per stage), waiting for the loss
            and the gradient checks every iteration.
  pytrees:  serial, with each stage's params kept as a pytree (`tuning.pack_stages=False`).
Every round runs a short block of each side back to back (alternating the order), so
each ratio is measured side by side; medians of the per-round ratios are reported. FLOPs per
iteration come from XLA's `compiled.cost_analysis()` (summed over the stage functions for the
staged step); MFU is given where the device's peak is known.

`--trace DIR` then runs each side once more for a block inside `jax.profiler.trace` (no Python
tracer) and reads the trace back: per process of the trace (on a GPU, the device's own
"/device:GPU:0" besides the host's) the time its events cover per iteration (their union) and
how many there are (on a GPU, kernels), and its events with the most time. On a GPU that says
where the staged step's device time goes against the fused step's, which the wall times alone
cannot (docs/host.md, "On a GPU node").

  python scripts/bench_step.py --cases digits resnet18-cifar gpt2-tiny --out bench_step.json
  python scripts/bench_step.py --cases gpt2-124m-bf16     # on a GPU
  python scripts/bench_step.py --cases resnet18-cifar-b128 --sides staged fused --trace /tmp/tr
"""

import argparse
import collections
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
from collections.abc import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from layup_jax import data, defaults, models, optim
from layup_jax.algorithms import ddp
from layup_jax.algorithms.base import init_model
from layup_jax.algorithms.layup import LayUp
from layup_jax.data.pipeline import Batch, random_image_batches
from layup_jax.measure import bench_options, provenance
from layup_jax.measure.flops import PEAK_FLOPS, compiled, flops_of
from layup_jax.measure.sidebyside import interleaved, median_ratio, serial_block, threaded_block
from layup_jax.runtime.engine import AsyncRuntime
from layup_jax.runtime.options import RuntimeOptions

CASES = {  # "iters": iterations per timed block (short: the sides alternate often)
    "digits": {"data.batch_size": 16, "data.read_threads": 0, "iters": 10},  # as configs/digits.py
    "resnet18-cifar": {"model.name": "resnet18", "model.num_classes": 100, "data.batch_size": 32,
                       "input_size": 32, "iters": 2},
    # The paper's per-device batch (appendix Table A5: 15.1 ms forward+backward on an A100).
    "resnet18-cifar-b128": {"model.name": "resnet18", "model.num_classes": 100,
                            "data.batch_size": 128, "input_size": 32, "iters": 10},
    "gpt2-tiny": {"model.name": "gpt2", "model.size": "tiny", "model.vocab_size": 256,
                  "model.max_len": 128, "data.batch_size": 8, "seq_len": 128,
                  "optimizer.name": "adamw", "iters": 20},
    "gpt2-124m-bf16": {"model.name": "gpt2", "model.size": "gpt2", "model.dtype": "bfloat16",
                       "model.max_len": 1024, "data.batch_size": 8, "seq_len": 1024,
                       "optimizer.name": "adamw", "iters": 20},
    # The same with XLA's attention (the case above takes cuDNN's flash attention on a GPU).
    "gpt2-124m-bf16-xla": {"model.name": "gpt2", "model.size": "gpt2", "model.dtype": "bfloat16",
                           "model.attention": "xla", "model.max_len": 1024,
                           "data.batch_size": 8, "seq_len": 1024, "optimizer.name": "adamw",
                           "iters": 20},
    # A batch that fills an 80-141 GB GPU, the vocabulary padded to 50,304 (public
    # single-GPU figures for this model use 32-64 x 1024 and that padding).
    "gpt2-124m-bf16-b32": {"model.name": "gpt2", "model.size": "gpt2", "model.dtype": "bfloat16",
                           "model.vocab_multiple": 64, "model.max_len": 1024,
                           "data.batch_size": 32, "seq_len": 1024, "optimizer.name": "adamw",
                           "iters": 5},
}


def case_config(case: str):
  config = defaults.get_config()
  extras = {}
  for key, value in CASES[case].items():
    if "." not in key:
      extras[key] = value
      continue
    section, name = key.split(".")
    config[section][name] = value
  return config, extras


def synthetic_batches(config, extras, seed: int):
  """Endless random batches of the model's input shape (the digits case reads the digits)."""
  rng = np.random.default_rng(seed)
  batch, model = config.data.batch_size, config.model
  while True:
    if model.name == "gpt2":
      tokens = rng.integers(0, model.vocab_size, (batch, extras["seq_len"] + 1), dtype=np.int32)
      yield Batch(tokens[:, :-1], tokens[:, 1:])
    else:
      yield from random_image_batches(batch, extras["input_size"], model.num_classes, seed)


def transformer_flops(config, params, batch: int, seq_len: int) -> float | None:
  """nanoGPT's estimate for GPT-2: (6 N + 12 L D T) FLOPs per token, N without `wpe`.

  A cross-check on XLA's count, which leaves out work done in library calls (cuDNN, cuBLAS).
  """
  if config.model.name != "gpt2":
    return None
  leaves = jax.tree.leaves(params)
  wte = params[0]["wte"]["embedding"]
  padding = (wte.shape[0] - config.model.vocab_size) * wte.shape[1]  # the vocabulary's padding
  n = sum(leaf.size for leaf in leaves) - params[0]["wpe"]["embedding"].size - padding
  spec = models.gpt2.SIZES[config.model.size]
  return batch * seq_len * (6 * n + 12 * spec.num_layers * spec.embed_dim * seq_len)


SIDES = ("runtime", "ahead2", "noremat", "chained", "unfused", "staged", "pytrees", "fused")


def thread_clocks(runtime: AsyncRuntime) -> dict[str, float]:
  """Seconds so far of the runtime's threads: CPU, asleep with nothing to run, and waiting for
  the other thread's turn (layup_jax/runtime/scheduler.py), per thread."""
  return {f"{s.name}_{what}": getattr(s, what) for s in {runtime.dispatcher, runtime.updater}
          for what in ("cpu_s", "idle_s", "turn_wait_s")}


def clocked_block(runtime: AsyncRuntime, iters: int, log: list) -> float:
  """`threaded_block`, logging the threads' milliseconds per iteration in the block: a slow
  block with the dispatcher asleep waited on the device, one with it busy was the host."""
  before = thread_clocks(runtime)
  seconds = threaded_block(runtime, iters)
  after = thread_clocks(runtime)
  log.append({"wall_ms": 1e3 * seconds / iters,
              **{k.removesuffix("_s") + "_ms": 1e3 * (after[k] - before[k]) / iters for k in after}})
  return seconds


def covered_us(spans: list[tuple[float, float]]) -> float:
  """Microseconds covered by the union of (start, duration) spans: a device's busy time, where
  its streams' events may overlap."""
  total, end = 0.0, float("-inf")
  for start, duration in sorted(spans):
    stop = start + duration
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def trace_summary(trace_dir: pathlib.Path, iters: int, top: int = 8) -> dict:
  """Per process of the newest perfetto trace under `trace_dir`: milliseconds per iteration its
  events cover, events per iteration, and its `top` event names by total time (ms and count per
  iteration)."""
  _, events = bench_options.newest_perfetto(trace_dir)
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  spans, by_name = collections.defaultdict(list), collections.defaultdict(collections.Counter)
  counts = collections.defaultdict(collections.Counter)
  for e in events:
    if e.get("ph") == "X":
      process, name = names.get(e["pid"], str(e["pid"])), e["name"][:80]
      duration = e.get("dur", 0.0)
      spans[process].append((e["ts"], duration))
      by_name[process][name] += duration
      counts[process][name] += 1
  return {process: {"busy_ms_per_iteration": covered_us(spans[process]) / 1e3 / iters,
                    "events_per_iteration": len(spans[process]) / iters,
                    "top": [[name, us / 1e3 / iters, counts[process][name] / iters]
                            for name, us in by_name[process].most_common(top)]}
          for process in spans}


def traced(block: Callable[[], float], trace_dir: pathlib.Path, iters: int) -> dict:
  """`block` (one timed block of `iters` iterations) inside a profiler trace without the Python
  tracer, summarised by `trace_summary`; a profiler that fails (no CUPTI on the machine, say)
  gives its error instead, after the timed rounds have their figures."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  try:
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True,
                            profiler_options=options):
      block()
    return trace_summary(trace_dir, iters)
  except Exception as error:  # noqa: BLE001 - reported in the output, the timings kept
    return {"error": {"busy_ms_per_iteration": float("nan"), "events_per_iteration": 0,
                      "top": [[f"{type(error).__name__}: {error}"[:200], 0.0, 0.0]]}}


def bench_case(case: str, repeats: int, iters: int | None, sides=SIDES,
               trace_dir: pathlib.Path | None = None) -> dict:
  config, extras = case_config(case)
  iters = iters or extras["iters"]
  device = jax.devices()[0]
  if case == "digits":
    train = data.make_dataset(config.data, 1, config.seed).train[0]
  else:
    train = synthetic_batches(config, extras, config.seed)
  example = next(train)
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000)
  params, state = init_model(config, model, example)

  def runtime(pack: bool, fuse: bool = True, ahead: int = 1, remat: str = "dots",
              chain: bool = False) -> AsyncRuntime:
    options = RuntimeOptions.from_config(config).replace(
        pack_stages=pack, fuse_local_step=fuse, max_dispatch_ahead=ahead, remat=remat,
        chain_forwards=chain)
    built = AsyncRuntime(model, tx, [device], [train], params, state, example, LayUp, options)
    built.compile()
    return built

  layup = runtime(True)
  threaded = runtime(True) if "runtime" in sides else None
  ahead2 = runtime(True, ahead=2) if "ahead2" in sides else None
  unpacked = runtime(False) if "pytrees" in sides else None
  unfused = runtime(True, fuse=False) if "unfused" in sides else None
  noremat = runtime(True, remat="none") if "noremat" in sides else None
  chained = runtime(True, chain=True) if "chained" in sides else None
  key = jax.device_put(jax.random.key(0), device)
  iteration = jax.device_put(np.int32(0), device)
  inputs = Batch(*jax.device_put((example.inputs, example.targets), device))
  flops_staged = layup.flops_per_iteration(analyse=compiled)

  fused_step = jax.jit(functools.partial(ddp.train_step, model, tx), donate_argnums=(0, 1, 2))
  # Fresh buffers: the fused step donates its carry, which must not be the runtimes' arrays.
  carry = jax.tree.map(np.asarray, (params, state, tx.init(params)))
  fused = {"carry": jax.device_put(carry, device), "i": 0}
  flops_fused = flops_of(fused_step.lower(*fused["carry"], inputs.inputs, inputs.targets, key,
                                          iteration).compile())

  def fused_iteration():
    batch = next(train)
    batch = Batch(*jax.device_put((batch.inputs, batch.targets), device))
    step_idx = jax.device_put(np.int32(fused["i"]), device)
    *carry, loss, _ = fused_step(*fused["carry"], batch.inputs, batch.targets, key, step_idx)
    fused["carry"], fused["i"] = tuple(carry), fused["i"] + 1
    float(loss)

  def staged_iteration():
    layup.iterate_serial(0, None)

  def pytree_iteration():
    unpacked.iterate_serial(0, None)

  # Each side is warmed up (and its first calls compiled) by `interleaved`'s first block.
  clocks = {"runtime": [], "ahead2": []}  # per block, the warm-up block first
  blocks = {"runtime": lambda: clocked_block(threaded, iters, clocks["runtime"]),
            "ahead2": lambda: clocked_block(ahead2, iters, clocks["ahead2"]),
            "noremat": lambda: threaded_block(noremat, iters),
            "chained": lambda: threaded_block(chained, iters),
            "unfused": lambda: threaded_block(unfused, iters),
            "staged": lambda: serial_block(staged_iteration, iters),
            "pytrees": lambda: serial_block(pytree_iteration, iters),
            "fused": lambda: serial_block(fused_iteration, iters)}
  blocks = {side: block for side, block in blocks.items() if side in sides}
  times = interleaved(blocks, repeats, {side: iters for side in blocks})
  traces = ({side: traced(block, trace_dir / case / side, iters) for side, block in blocks.items()}
            if trace_dir is not None else {})
  for side in SIDES:  # a side not run reads as NaN
    times.setdefault(side, [float("nan")])
  runtime_times, staged_times = times["runtime"], times["staged"]
  pytree_times, fused_times = times["pytrees"], times["fused"]
  for built in (threaded, ahead2, noremat, chained, unfused, layup, unpacked):
    if built is not None:
      built.close()
  staged_s, fused_s = statistics.median(staged_times), statistics.median(fused_times)
  runtime_s = statistics.median(runtime_times)
  ratio = lambda times: (median_ratio(fused_times, times) if not np.isnan(times[0])
                         else float("nan"))  # throughput: fused time / time
  peak = PEAK_FLOPS.get(device.device_kind)
  estimate = transformer_flops(config, params, config.data.batch_size, extras.get("seq_len", 0))
  return {
      "case": case, "model": config.model.name, "num_stages": model.num_stages, "iters": iters,
      "batch_size": config.data.batch_size, "device": device.device_kind,
      "runtime_ms_median": 1e3 * runtime_s, "staged_ms_median": 1e3 * staged_s,
      "runtime_ahead2_ms_median": 1e3 * statistics.median(times["ahead2"]),
      "runtime_unfused_ms_median": 1e3 * statistics.median(times["unfused"]),
      "runtime_noremat_ms_median": 1e3 * statistics.median(times["noremat"]),
      "runtime_chained_ms_median": 1e3 * statistics.median(times["chained"]),
      "pytrees_ms_median": 1e3 * statistics.median(pytree_times),
      "fused_ms_median": 1e3 * fused_s,
      "throughput_ratio_runtime_over_fused_median": ratio(runtime_times),
      "throughput_ratio_runtime_ahead2_over_fused_median": ratio(times["ahead2"]),
      "throughput_ratio_runtime_unfused_over_fused_median": ratio(times["unfused"]),
      "throughput_ratio_runtime_noremat_over_fused_median": ratio(times["noremat"]),
      "throughput_ratio_runtime_chained_over_fused_median": ratio(times["chained"]),
      "throughput_ratio_staged_over_fused_median": ratio(staged_times),
      "throughput_ratio_pytrees_over_fused_median": ratio(pytree_times),
      "flops_staged": flops_staged, "flops_fused": flops_fused,
      "mfu_runtime": flops_staged / runtime_s / peak if peak else None,
      "mfu_staged": flops_staged / staged_s / peak if peak else None,
      "mfu_fused": flops_fused / fused_s / peak if peak else None,
      "flops_estimate_6nt": estimate,
      "mfu_estimate_runtime": estimate / runtime_s / peak if peak and estimate else None,
      "mfu_estimate_staged": estimate / staged_s / peak if peak and estimate else None,
      "mfu_estimate_fused": estimate / fused_s / peak if peak and estimate else None,
      "runtime_ms_all": [1e3 * t for t in runtime_times],
      "runtime_ahead2_ms_all": [1e3 * t for t in times["ahead2"]],
      "runtime_threads_ms_per_iteration_blocks": clocks["runtime"],
      "runtime_ahead2_threads_ms_per_iteration_blocks": clocks["ahead2"],
      "runtime_unfused_ms_all": [1e3 * t for t in times["unfused"]],
      "runtime_noremat_ms_all": [1e3 * t for t in times["noremat"]],
      "runtime_chained_ms_all": [1e3 * t for t in times["chained"]],
      "staged_ms_all": [1e3 * t for t in staged_times],
      "pytrees_ms_all": [1e3 * t for t in pytree_times],
      "fused_ms_all": [1e3 * t for t in fused_times],
      "traces": traces,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=["digits", "resnet18-cifar", "gpt2-tiny"],
                      choices=sorted(CASES))
  parser.add_argument("--repeats", type=int, default=21, help="rounds of timed blocks")
  parser.add_argument("--iters", type=int, default=None,
                      help="iterations per timed repeat (default: the case's own)")
  parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES,
                      help="which ways of running the step to time (fused is always timed)")
  parser.add_argument("--trace", type=pathlib.Path, default=None, metavar="DIR",
                      help="after the timed rounds, trace one block of each side into DIR and "
                           "report each trace's processes (on a GPU, the device's kernels)")
  bench_options.add_option(parser)
  parser.add_argument("--out", default="bench_step.json")
  args = parser.parse_args()
  host_allocator = bench_options.use(args.allocator)

  sides = set(args.sides) | {"fused"}
  rows = [bench_case(case, args.repeats, args.iters, sides, args.trace) for case in args.cases]
  mfu = lambda v: f"{100 * v:.1f}%" if v is not None else "-"
  print(f"{'case':<16}{'stages':>7}{'batch':>6}{'fused ms':>10}{'runtime ms':>12}{'ahead2 ms':>10}"
        f"{'unfused ms':>11}{'serial ms':>11}{'pytrees ms':>12}   throughput vs fused: runtime"
        f" ahead2 unfused serial pytrees"
        f"{'GFLOP/it':>10}{'MFU rt.':>9}{'MFU fu.':>9}")
  for r in rows:
    print(f"{r['case']:<16}{r['num_stages']:>7}{r['batch_size']:>6}{r['fused_ms_median']:>10.3f}"
          f"{r['runtime_ms_median']:>12.3f}{r['runtime_ahead2_ms_median']:>10.3f}"
          f"{r['runtime_unfused_ms_median']:>11.3f}"
          f"{r['staged_ms_median']:>11.3f}"
          f"{r['pytrees_ms_median']:>12.3f}{'':>22}"
          f"{r['throughput_ratio_runtime_over_fused_median']:>8.3f}"
          f"{r['throughput_ratio_runtime_ahead2_over_fused_median']:>7.3f}"
          f"{r['throughput_ratio_runtime_unfused_over_fused_median']:>8.3f}"
          f"{r['throughput_ratio_staged_over_fused_median']:>7.3f}"
          f"{r['throughput_ratio_pytrees_over_fused_median']:>8.3f}"
          f"{r['flops_fused'] / 1e9:>10.2f}{mfu(r['mfu_runtime']):>9}{mfu(r['mfu_fused']):>9}")
  for r in rows:
    if r["flops_estimate_6nt"]:
      print(f"{r['case']}: 6NT estimate {r['flops_estimate_6nt'] / 1e9:.0f} GFLOP/it, MFU "
            f"runtime {mfu(r['mfu_estimate_runtime'])}, fused {mfu(r['mfu_estimate_fused'])}")
  for r in rows:  # where each runtime block's time went (its first block is the warm-up)
    for blocks in ("runtime_threads_ms_per_iteration_blocks",
                   "runtime_ahead2_threads_ms_per_iteration_blocks"):
      if r[blocks]:
        print(f"{r['case']} {blocks.split('_threads')[0]}, ms per iteration per block (wall, "
              f"dispatcher cpu / asleep / waiting for the turn): " + "; ".join(
                  f"{b['wall_ms']:.1f} ({b['dispatcher_cpu_ms']:.1f} / "
                  f"{b['dispatcher_idle_ms']:.1f} / {b['dispatcher_turn_wait_ms']:.1f})"
                  for b in r[blocks]))
  for r in rows:
    for side, what in (("noremat", "tuning.remat=none"), ("chained", "tuning.chain_forwards")):
      if not np.isnan(r[f"runtime_{side}_ms_median"]):
        print(f"{r['case']} runtime with {what}: {r[f'runtime_{side}_ms_median']:.3f} ms, "
              f"throughput vs fused "
              f"{r[f'throughput_ratio_runtime_{side}_over_fused_median']:.3f}")
  for r in rows:  # the traced blocks: per side and process, busy ms and events per iteration
    for side, processes in r["traces"].items():
      for process, summary in sorted(processes.items()):
        top = "; ".join(f"{name[:40]} {ms:.2f} ms x{n:.0f}" for name, ms, n in summary["top"][:3])
        print(f"{r['case']} {side} trace, {process[:40]}: {summary['busy_ms_per_iteration']:.2f} "
              f"ms covered, {summary['events_per_iteration']:.0f} events per iteration; top: {top}")
  iterations = ", ".join(f"{r['case']} {r['iters']}" for r in rows)
  print(f"(throughput ratio: median over {args.repeats} repeats of the ratio within a repeat, "
        f"{iterations} iterations each; {rows[0]['device']}; jax {jax.__version__}; XLA's FLOPs "
        f"leave out library calls such as cuDNN convolutions; host allocator {host_allocator})")
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "platform": platform.platform(), "jax": jax.__version__,
               "command": "python scripts/bench_step.py " + " ".join(sys.argv[1:]),
               "host_allocator": host_allocator, "rows": rows},
              f, indent=2)


if __name__ == "__main__":
  main()
