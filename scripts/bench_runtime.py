"""What LayUp's threads and gossip cost: two ratios, each measured side by side.

  one device: the full runtime (compute thread + updater thread, no peer) against the bare
              staged step (`iterate_serial`: the same per-stage functions on one thread), time
              per iteration. Target <= 1.05.
  gossip:     LayUp on `--num-devices` devices, time per step with gossip on against off (local
              steps only, `layup.gossip=False`). Target <= 1.10: communication is hidden.

Digits task, compilation excluded (each runtime is compiled and warmed up first); medians of
`--repeats` repeats, the two sides of a ratio run back to back in alternating order.

  python scripts/bench_runtime.py --repeats 5 --out bench_runtime.json
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

import jax

from configs import digits
from layup_jax import algorithms, data, models, optim


def build(num_devices: int, gossip: bool = True):
  config = digits.get_config()
  config.num_devices, config.layup.gossip = num_devices, gossip
  dataset = data.make_dataset(config.data, num_devices, config.seed)
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000, dataset.steps_per_epoch)
  runtime = algorithms.build_runtime(config, model, tx, jax.devices()[:num_devices], dataset)
  runtime.compile()
  return runtime, dataset


def serial_seconds(iterations: int, warmup: int) -> float:
  runtime, dataset = build(1)
  for _ in range(warmup):
    runtime.iterate_serial(0)
  start = time.perf_counter()
  for _ in range(iterations):
    runtime.iterate_serial(0)
  elapsed = time.perf_counter() - start
  dataset.close()
  return elapsed / iterations


def threaded_seconds(num_devices: int, steps: int, warmup: int, gossip: bool = True) -> float:
  """Seconds per step (num_devices iterations) of the threaded runtime."""
  runtime, dataset = build(num_devices, gossip)
  runtime.run_until(warmup * num_devices, lambda done: None)
  start = time.perf_counter()
  runtime.run_until((warmup + steps) * num_devices, lambda done: None)
  elapsed = time.perf_counter() - start
  runtime.close()
  dataset.close()
  return elapsed / steps


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--iterations", type=int, default=200, help="one-device iterations")
  parser.add_argument("--steps", type=int, default=60, help="steps of the multi-device runs")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="bench_runtime.json")
  args = parser.parse_args()
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="layup_jax_cache_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

  runs = []
  for repeat in range(args.repeats):
    flip = repeat % 2 == 1
    one = {}
    for side in (["threaded", "serial"] if flip else ["serial", "threaded"]):
      one[side] = (serial_seconds(args.iterations, 20) if side == "serial"
                   else threaded_seconds(1, args.iterations, 20))
    gossip = {}
    for side in ([False, True] if flip else [True, False]):
      gossip[side] = threaded_seconds(args.num_devices, args.steps, 10, gossip=side)
    run = {"repeat": repeat, "serial_ms": 1e3 * one["serial"],
           "one_device_threaded_ms": 1e3 * one["threaded"],
           "one_device_ratio": one["threaded"] / one["serial"],
           "gossip_on_ms_per_step": 1e3 * gossip[True],
           "gossip_off_ms_per_step": 1e3 * gossip[False],
           "gossip_ratio": gossip[True] / gossip[False]}
    runs.append(run)
    print(f"repeat {repeat}: one device {run['one_device_threaded_ms']:.2f} ms threaded vs "
          f"{run['serial_ms']:.2f} ms serial ({run['one_device_ratio']:.3f}); "
          f"{args.num_devices} devices gossip on {run['gossip_on_ms_per_step']:.1f} vs off "
          f"{run['gossip_off_ms_per_step']:.1f} ms/step ({run['gossip_ratio']:.3f})", flush=True)

  table = {key: statistics.median(r[key] for r in runs)
           for key in runs[0] if key != "repeat"}
  print(f"\n{'measure':<44}{'median':>10}{'target':>9}")
  print(f"{'one device: runtime / bare staged step':<44}{table['one_device_ratio']:>10.3f}"
        f"{'<= 1.05':>9}")
  print(f"{f'{args.num_devices} devices: gossip on / gossip off':<44}"
        f"{table['gossip_ratio']:>10.3f}{'<= 1.10':>9}")
  print(f"(digits task, medians of {args.repeats} repeats, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__})")
  with open(args.out, "w") as f:
    json.dump({"args": vars(args), "table": table, "runs": runs}, f, indent=2)


if __name__ == "__main__":
  main()
