"""A `jax.profiler` trace of LayUp's threaded runtime, and where its time goes.

Trains the digits task (or `--model resnet18` on CIFAR-shaped random batches) on
`--num-devices` devices inside `jax.profiler.trace`, writes the trace to `--out` (open it in
Perfetto, ui.perfetto.dev, or TensorBoard's profile plugin) and prints the events that took the
most time in total, per thread: jitted stage functions (`PjitFunction(forward)`, ...),
transfers, the XLA executors' work, and Python functions (the trace includes a Python tracer, so
times are inflated; read them as shares).

  python scripts/profile_step.py --num-devices 1 --iterations 100 --out runs/profile
"""

import argparse
import collections
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import allocator_choice
import jax
import perfetto_events

from configs import digits
from layup_jax import algorithms, data, models, optim
from layup_jax.data.pipeline import random_image_batches


def build(model_name: str, num_devices: int, gossip: bool):
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
  path, events = perfetto_events.newest(trace_dir)
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="digits", choices=["digits", "resnet18"])
  parser.add_argument("--num-devices", type=int, default=1)
  parser.add_argument("--iterations", type=int, default=100, help="per device, traced")
  parser.add_argument("--no-gossip", action="store_true")
  parser.add_argument("--top", type=int, default=30)
  allocator_choice.add_option(parser)
  parser.add_argument("--out", default="runs/profile")
  args = parser.parse_args()
  host_allocator = allocator_choice.use(args.allocator)
  runtime, dataset = build(args.model, args.num_devices, not args.no_gossip)
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


if __name__ == "__main__":
  main()
