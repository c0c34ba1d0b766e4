"""Whether gossip keeps the push-sum average when the runtime runs its threads.

With learning rate 0 only gossip moves the replicas, and push-sum must keep each stage's average
`sum_i w_{i,s} x_{i,s} / sum_i w_{i,s}`. Each run: the digits task on `--num-devices` devices,
replicas made distinct (Gaussian noise of `--noise` added to every parameter through
`state_dict`/`load_state_dict`), then `--iterations` iterations per device with the threads.
Printed per algorithm and `layup.push_sum`: the relative L2 distance between the average before
and after (median and largest over repeats), how far the replicas moved towards it (the
consensus distance after over before), and the per-stage weight sums.

  python scripts/bench_pushsum.py --repeats 4 --out docs/results/bench_pushsum.json
"""

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax

from configs import digits
from layup_jax import algorithms, data, models, optim
from layup_jax.measure import provenance
from layup_jax.pushsum import consensus

# AD-PSGD averages pairs without push-sum weights: `layup.push_sum` does not apply to it.
VARIANTS = [("layup", "per_stage"), ("layup", "per_model"), ("gosgd", "per_stage"),
            ("gosgd", "per_model"), ("adpsgd", "per_stage")]


def _average_and_params(runtime):
  params = [jax.device_get(list(r.params)) for r in runtime.replicas]
  return consensus.consensus(params, np.asarray(runtime.store.weights.values)), params


def run(algorithm: str, push_sum: str, num_devices: int, iterations: int, noise: float,
        seed: int) -> dict:
  config = digits.get_config()
  config.algorithm, config.num_devices, config.seed = algorithm, num_devices, seed
  config.layup.push_sum = push_sum
  config.optimizer.learning_rate, config.optimizer.weight_decay = 0.0, 0.0
  dataset = data.make_dataset(config.data, num_devices, config.seed)
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000, dataset.steps_per_epoch)
  runtime = algorithms.build_runtime(config, model, tx, jax.devices()[:num_devices], dataset)
  arrays, meta = runtime.checkpoint.state_dict()
  rng = np.random.default_rng(seed)
  for replica in arrays["replicas"]:
    replica["params"] = [np.asarray(p) + noise * rng.normal(size=p.shape).astype(np.float32)
                         for p in replica["params"]]
  runtime.checkpoint.load_state_dict(arrays, meta)
  start, params = _average_and_params(runtime)
  spread = float(consensus.consensus_distance(params, start))
  runtime.compile()
  runtime.run_until(num_devices * iterations, lambda done: None)
  runtime.close()
  dataset.close()
  end, params = _average_and_params(runtime)
  moved = float(optax.tree.norm(optax.tree.sub(end, start)) / optax.tree.norm(start))
  return {"algorithm": algorithm, "push_sum": push_sum, "seed": seed,
          "average_moved_relative": moved,
          "consensus_distance_ratio": float(consensus.consensus_distance(params, end)) / spread,
          "weight_sums": runtime.stats.weight_sums(),
          "iterations_per_device": runtime.stats.iterations_per_device()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--iterations", type=int, default=300, help="iterations per device")
  parser.add_argument("--noise", type=float, default=0.5)
  parser.add_argument("--repeats", type=int, default=4)
  parser.add_argument("--out", default="bench_pushsum.json")
  args = parser.parse_args()
  stamp = provenance.stamp()  # before the output file exists

  runs = []
  for repeat in range(args.repeats):
    for algorithm, push_sum in VARIANTS:
      result = run(algorithm, push_sum, args.num_devices, args.iterations, args.noise, repeat)
      runs.append(result)
      print(f"repeat {repeat} {algorithm:>6} {push_sum:>9}: average moved "
            f"{result['average_moved_relative']:.2e}, weight sums "
            f"{min(result['weight_sums']):.15f}..{max(result['weight_sums']):.15f}", flush=True)

  table = []
  print(f"\n{'algorithm':<10}{'push_sum':<11}{'average moved (median)':>24}{'largest':>11}"
        f"{'distance after/before':>23}{'weight sums min..max':>26}")
  for algorithm, push_sum in VARIANTS:
    mine = [r for r in runs if r["algorithm"] == algorithm and r["push_sum"] == push_sum]
    moved = [r["average_moved_relative"] for r in mine]
    sums = [s for r in mine for s in r["weight_sums"]]
    row = {"algorithm": algorithm, "push_sum": push_sum,
           "average_moved_median": statistics.median(moved), "average_moved_max": max(moved),
           "consensus_distance_ratio_median": statistics.median(
               r["consensus_distance_ratio"] for r in mine),
           "weight_sum_min": min(sums), "weight_sum_max": max(sums)}
    table.append(row)
    print(f"{algorithm:<10}{push_sum:<11}{row['average_moved_median']:>24.2e}"
          f"{row['average_moved_max']:>11.2e}{row['consensus_distance_ratio_median']:>23.2e}"
          f"{row['weight_sum_min']:>16.12f}..{row['weight_sum_max']:.12f}")
  print(f"({args.num_devices} devices, {args.iterations} iterations each, learning rate 0, "
        f"{args.repeats} repeats, {jax.devices()[0].device_kind})")
  with open(args.out, "w") as f:
    json.dump({**stamp, "args": vars(args), "table": table, "runs": runs}, f, indent=2)


if __name__ == "__main__":
  main()
