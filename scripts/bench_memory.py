"""Peak device memory per device, LayUp against DDP: LayUp keeps no receive buffers.

Each algorithm trains `--steps` steps on `--num-devices` devices in its own process, after a
warm-up. Memory of a device, two ways:
  CPU: the bytes of the live JAX arrays committed to it (`jax.live_arrays()`, sampled every
       millisecond on a thread while training), plus the largest scratch memory XLA allocates
       for one of the runtime's functions (`memory_analysis().temp_size_in_bytes`): DDP's
       activations live inside its one compiled step, where no array list sees them, while
       LayUp's stage residuals are arrays between its stage calls.
  GPU: `device.memory_stats()["peak_bytes_in_use"]` at the end (the allocator's own peak).
The claim checked: LayUp's peak <= DDP's peak + the largest stage's params (one stage of a
peer's params in flight, sent and merged, and nothing queued).

  python scripts/bench_memory.py --cases digits resnet18-cifar --num-devices 8
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax

from layup_jax.measure import provenance

CASES = {  # config values, and the steps measured after the warm-up
    "digits": ({}, 20),
    "resnet18-cifar": ({"model.name": "resnet18", "model.num_classes": 100,
                        "data.batch_size": 32}, 2),
}


def device_bytes(devices) -> dict:
  """Bytes of live arrays on each device (a sharded or replicated array counts its shard)."""
  totals = {d: 0 for d in devices}
  for array in jax.live_arrays():
    if array.is_deleted():
      continue
    shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    for device in array.sharding.device_set:
      if device in totals:
        totals[device] += shard
  return totals


def measure(case: str, algorithm: str, num_devices: int, steps: int) -> dict:
  """Runs in the child process: trains and returns the peaks per device."""

  from layup_jax import algorithms, data, defaults, models, optim
  from layup_jax.algorithms.base import init_model
  from layup_jax.data.pipeline import random_image_batches

  config = defaults.get_config()
  config.algorithm, config.num_devices = algorithm, num_devices
  for key, value in CASES[case][0].items():
    section, name = key.split(".")
    config[section][name] = value
  devices = jax.devices()[:num_devices]
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000)
  dataset = None
  if case == "digits":
    dataset = data.make_dataset(config.data, num_devices, config.seed)
    example = dataset.example_batch
    runtime = algorithms.build_runtime(config, model, tx, devices, dataset)
  else:  # random CIFAR-shaped batches (memory does not depend on the values)
    batches = lambda seed: random_image_batches(config.data.batch_size, 32, 100, seed)
    example = next(batches(0))
    streams = data.TrainStreams([batches(i) for i in range(num_devices)], example)
    runtime = algorithms.build_runtime(config, model, tx, devices, streams)
  largest_stage = max(sum(leaf.nbytes for leaf in jax.tree.leaves(p))
                      for p in init_model(config, model, example)[0])
  runtime.compile()
  temp = runtime.temp_bytes()
  runtime.run_until(2 * num_devices, lambda done: None)  # warm-up

  gpu = devices[0].platform != "cpu"
  peaks = {d: 0 for d in devices}
  stop = threading.Event()

  def sample():
    while not stop.is_set():
      try:
        totals = device_bytes(devices)
      except RuntimeError:  # an array deleted (donated) while it was read: sample again
        continue
      for device, total in totals.items():
        peaks[device] = max(peaks[device], total)
      time.sleep(0.001)

  sampler = threading.Thread(target=sample, daemon=True)
  if not gpu:
    sampler.start()
  runtime.run_until((2 + steps) * num_devices, lambda done: None)
  stop.set()
  if not gpu:
    sampler.join()
  runtime.close()
  if dataset is not None:
    dataset.close()
  if gpu:
    per_device = [d.memory_stats()["peak_bytes_in_use"] for d in devices]
  else:
    per_device = [peaks[d] + temp for d in devices]
  return {"case": case, "algorithm": algorithm, "num_devices": num_devices, "steps": steps,
          "platform": devices[0].platform, "device_kind": devices[0].device_kind,
          "peak_bytes_per_device": per_device, "temp_bytes": temp,
          "largest_stage_param_bytes": largest_stage}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=["digits"], choices=sorted(CASES))
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--steps", type=int, default=0, help="default: the case's own")
  parser.add_argument("--out", default="bench_memory.json")
  parser.add_argument("--child", nargs=2, metavar=("CASE", "ALGORITHM"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(measure(*args.child, args.num_devices, args.steps)))
    return

  rows = []
  for case in args.cases:
    result = {}
    for algorithm in ("layup", "ddp"):
      child = subprocess.run(
          [sys.executable, __file__, "--child", case, algorithm, "--num-devices",
           str(args.num_devices), "--steps", str(args.steps or CASES[case][1])],
          capture_output=True, text=True, check=True, cwd=ROOT)
      result[algorithm] = json.loads(child.stdout.strip().splitlines()[-1])
    layup, ddp = result["layup"], result["ddp"]
    layup_peak, ddp_peak = max(layup["peak_bytes_per_device"]), max(ddp["peak_bytes_per_device"])
    bound = ddp_peak + layup["largest_stage_param_bytes"]
    rows.append({"case": case, "layup": layup, "ddp": ddp, "layup_peak_bytes": layup_peak,
                 "ddp_peak_bytes": ddp_peak, "bound_bytes": bound,
                 "holds": layup_peak <= bound})

  mib = lambda b: f"{b / 2**20:.2f}"
  print(f"{'case':<16}{'LayUp MiB':>11}{'DDP MiB':>10}{'largest stage MiB':>19}"
        f"{'bound MiB':>11}{'LayUp <= bound':>16}")
  for r in rows:
    print(f"{r['case']:<16}{mib(r['layup_peak_bytes']):>11}{mib(r['ddp_peak_bytes']):>10}"
          f"{mib(r['layup']['largest_stage_param_bytes']):>19}{mib(r['bound_bytes']):>11}"
          f"{r['holds']!s:>16}")
  first = rows[0]["layup"]
  how = ("live arrays sampled every ms + largest XLA scratch allocation" if
         first["platform"] == "cpu" else "allocator peak_bytes_in_use")
  steps = ", ".join(f"{r['case']} {r['layup']['steps']}" for r in rows)
  print(f"(peak per device, the largest over {args.num_devices} devices; {how}; "
        f"{first['device_kind']}; {steps} steps after a warm-up of 2)")
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "platform": platform.platform(), "args": vars(args),
               "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
