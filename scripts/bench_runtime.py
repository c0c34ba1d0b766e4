"""What LayUp's threads and gossip cost: two ratios, each measured side by side.

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

  python scripts/bench_runtime.py --repeats 15 --gossip-cases digits resnet18-cifar
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import allocator_choice
import jax

from configs import base, digits
from layup_jax import algorithms, data, models, optim
from layup_jax.data.pipeline import random_image_batches
from layup_jax.measure import provenance
from layup_jax.measure.sidebyside import interleaved, median_ratio, serial_block, threaded_block
from layup_jax.run.evaluation import Evaluator

STEPS = {"digits": 10, "resnet18-cifar": 1}  # steps per timed block


class _NoData:
  def close(self) -> None:
    pass


def build(num_devices: int, gossip: bool = True, case: str = "digits", ahead: int = 1):
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
  config = base.get_config()
  config.model.name, config.model.num_classes, config.data.batch_size = "resnet18", 100, 32
  config.num_devices, config.layup.gossip, config.metrics.latency_every = num_devices, gossip, 0
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000)
  batches = [random_image_batches(32, 32, 100, seed) for seed in range(num_devices)]
  streams = data.TrainStreams(batches, next(random_image_batches(32, 32, 100, 0)))
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--iterations", type=int, default=50,
                      help="one-device iterations per timed block")
  parser.add_argument("--gossip-cases", nargs="+", default=["digits"], choices=sorted(STEPS))
  parser.add_argument("--ahead", nargs="*", type=int, default=[],
                      help="values of tuning.max_dispatch_ahead to compare (digits)")
  parser.add_argument("--repeats", type=int, default=15, help="rounds of timed blocks")
  allocator_choice.add_option(parser)
  parser.add_argument("--out", default="bench_runtime.json")
  args = parser.parse_args()
  host_allocator = allocator_choice.use(args.allocator)
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="layup_jax_cache_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

  # One device: the threaded runtime against the bare staged step, both built once.
  (serial, serial_data), (threaded, threaded_data) = build(1), build(1)
  block = args.iterations
  one = interleaved({"serial": lambda: serial_block(lambda: serial.iterate_serial(0), block),
                     "threaded": lambda: threaded_block(threaded, block)},
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
    times = interleaved({side: (lambda rt=runtime, n=steps: threaded_block(rt, n * args.num_devices))
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


if __name__ == "__main__":
  main()
