"""Per-device iteration time of LayUp's staged step against one fused jitted step.

Staged: the per-stage jitted forwards (each returning its VJP), the per-stage VJPs in reverse,
and one Optax update per stage, dispatched from Python as LayUp's threads do (serial mode, one
device, no peer). Fused: one jitted `value_and_grad` + Optax step of the same model, batch and
optimizer. Both wait for the loss every iteration. Repeats alternate between the two, so the
ratio is measured side by side; medians are reported.

  python scripts/bench_step.py --config configs/digits.py --repeats 7 --iters 50 --out bench.json
"""

import argparse
import ast
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from layup_jax import data, models, optim  # noqa: E402
from layup_jax.algorithms import ddp  # noqa: E402
from layup_jax.algorithms.base import init_model  # noqa: E402
from layup_jax.runtime import LayUpRuntime  # noqa: E402


def load_config(path: str, overrides: list[str]):
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for override in overrides:
    key, value = override.split("=", 1)
    target = config
    *parents, leaf = key.split(".")
    for parent in parents:
      target = target[parent]
    target[leaf] = value if isinstance(target[leaf], str) else ast.literal_eval(value)
  return config


def time_iterations(step, iters: int) -> float:
  start = time.perf_counter()
  for _ in range(iters):
    step()
  return (time.perf_counter() - start) / iters


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--set", nargs="*", default=[], help="overrides such as data.batch_size=32")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--iters", type=int, default=50)
  parser.add_argument("--out", default="bench_step.json")
  args = parser.parse_args()

  config = load_config(args.config, args.set)
  device = jax.devices()[0]
  dataset = data.make_dataset(config.data, 1, config.seed)
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000)
  params, state = init_model(model, dataset.example_batch, config.seed)

  layup = LayUpRuntime(model, tx, [device], dataset.train, params, state,
                       dataset.example_batch, seed=config.seed)
  layup.compile()

  fused_step = jax.jit(functools.partial(ddp.train_step, model, tx), donate_argnums=(0, 1, 2))
  fused = {"carry": jax.device_put((params, state, tx.init(params)), device), "i": 0}
  key = jax.device_put(jax.random.key(0), device)
  batches = dataset.train[0]

  def fused_iteration():
    batch = next(batches)
    images, labels = jax.device_put((batch.inputs, batch.targets), device)
    iteration = jax.device_put(np.int32(fused["i"]), device)
    *carry, loss = fused_step(*fused["carry"], images, labels, key, iteration)
    fused["carry"], fused["i"] = tuple(carry), fused["i"] + 1
    float(loss)

  def staged_iteration():
    layup.iterate_serial(0, None)

  for step in (staged_iteration, fused_iteration):  # compile and warm up
    time_iterations(step, 3)

  staged_times, fused_times = [], []
  for _ in range(args.repeats):
    staged_times.append(time_iterations(staged_iteration, args.iters))
    fused_times.append(time_iterations(fused_iteration, args.iters))
  staged_ms = 1e3 * statistics.median(staged_times)
  fused_ms = 1e3 * statistics.median(fused_times)
  ratios = [f / s for s, f in zip(staged_times, fused_times)]
  result = {
      "config": args.config, "overrides": args.set, "model": config.model.name,
      "num_stages": model.num_stages, "batch_size": config.data.batch_size,
      "device": str(device.device_kind), "platform": platform.platform(),
      "jax": jax.__version__, "repeats": args.repeats, "iters_per_repeat": args.iters,
      "staged_ms_median": staged_ms, "fused_ms_median": fused_ms,
      "throughput_ratio_staged_over_fused_median": statistics.median(ratios),
      "staged_ms_all": [1e3 * t for t in staged_times], "fused_ms_all": [1e3 * t for t in fused_times],
  }
  print(f"{'step':<10}{'ms/iter (median)':>18}")
  print(f"{'staged':<10}{staged_ms:>18.3f}")
  print(f"{'fused':<10}{fused_ms:>18.3f}")
  print(f"throughput staged/fused: {result['throughput_ratio_staged_over_fused_median']:.3f} "
        f"(median of {args.repeats} side-by-side repeats; {model.num_stages} stages, "
        f"batch {config.data.batch_size}, {device.device_kind})")
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
