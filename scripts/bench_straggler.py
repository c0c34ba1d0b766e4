"""Training throughput with one straggling device against the same run without one.

For each repeat, every (algorithm, delay) pair runs back to back, so each ratio compares runs
taken side by side; the table reports medians over repeats. Throughput is training samples per
second (compilation and evaluation excluded), over all devices and over the devices other than
the straggler (from each device's own iteration count: under LayUp the others do not wait).

`--mode` is `straggler.mode`: `host` idles the straggler's compute thread, `device` keeps its
device busy with a delay program while the thread goes on dispatching (layup_jax/runtime/straggler.py).
On fake CPU devices that program also takes a core from the other devices; the algorithm
`layup-nogossip` (LayUp with `layup.gossip=False`: no device ever receives from another) shows
that CPU effect alone, and the column "vs no gossip" divides LayUp's others-ratio by it, round by
round: what remains is the other devices waiting on the straggler.

  python scripts/bench_straggler.py --num-devices 8 --delays 0 1 2 4 --repeats 3 --out s.json
  python scripts/bench_straggler.py --mode device --algorithms layup layup-nogossip ddp \
      --num-devices 8 --delays 0 1 2 4 --repeats 3
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from layup_jax import defaults
from layup_jax.measure import bench_options, provenance
from layup_jax.run import runner


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--algorithms", nargs="+", default=["layup", "ddp"],
                      help="algorithm names, or layup-nogossip (LayUp, layup.gossip=False)")
  parser.add_argument("--mode", choices=["host", "device"], default="host",
                      help="straggler.mode")
  parser.add_argument("--delays", nargs="+", type=float, default=[0.0, 2.0])
  parser.add_argument("--num-devices", type=int, default=4)
  parser.add_argument("--straggler", type=int, default=0)
  parser.add_argument("--num-steps", type=int, default=150)
  parser.add_argument("--repeats", type=int, default=3)
  bench_options.add_option(parser)
  parser.add_argument("--out", default="bench_straggler.json")
  args = parser.parse_args()
  host_allocator = bench_options.use(args.allocator)

  runs = []
  for repeat in range(args.repeats):
    for algorithm in args.algorithms:
      for delay in args.delays:
        config = defaults.get_config()
        config.algorithm = algorithm.removesuffix("-nogossip")
        config.num_devices = args.num_devices
        config.layup.gossip = not algorithm.endswith("-nogossip")
        config.straggler.mode = args.mode
        config.num_steps, config.eval_every, config.progress_bar = args.num_steps, 0, False
        config.checkpoint.enabled = False
        config.straggler.device = args.straggler if delay > 0 else -1
        config.straggler.delay_iters = delay
        with tempfile.TemporaryDirectory() as workdir:
          summary = runner.run(config, workdir)
        runs.append({**summary, "repeat": repeat, "algorithm": algorithm, "delay_iters": delay})
        print(f"repeat {repeat} {algorithm:>6} delay {delay:g}: "
              f"{summary['train_samples_per_s']:.0f} samples/s, "
              f"accuracy {summary['final_eval_accuracy']:.4f}", flush=True)

  def throughput(algorithm, delay, repeat, key="train_samples_per_s"):
    return next(r[key] for r in runs if r["algorithm"] == algorithm
                and r["delay_iters"] == delay and r["repeat"] == repeat)

  def others(algorithm, delay, repeat):
    per_device = throughput(algorithm, delay, repeat, "device_samples_per_s")
    return sum(v for i, v in enumerate(per_device) if i != args.straggler)

  def others_ratios(algorithm, delay):
    return [others(algorithm, delay, r) / others(algorithm, args.delays[0], r)
            for r in range(args.repeats)]

  table = []
  print(f"\n{'algorithm':<16}{'delay':>6}{'samples/s':>12}{'vs delay 0':>12}"
        f"{'others/s':>10}{'others vs 0':>13}{'vs no gossip':>14}{'1/(1+delay)':>13}")
  for algorithm in args.algorithms:
    for delay in args.delays:
      speeds = [throughput(algorithm, delay, r) for r in range(args.repeats)]
      ratios = [s / throughput(algorithm, args.delays[0], r) for r, s in enumerate(speeds)]
      other_speeds = [others(algorithm, delay, r) for r in range(args.repeats)]
      other_ratios = others_ratios(algorithm, delay)
      separated = None  # others-ratio over the same ratio without gossip, round by round
      if algorithm == "layup" and "layup-nogossip" in args.algorithms:
        separated = statistics.median(
            a / b for a, b in zip(other_ratios, others_ratios("layup-nogossip", delay)))
      row = {"algorithm": algorithm, "mode": args.mode, "delay_iters": delay,
             "others_vs_no_gossip_median": separated,
             "samples_per_s_median": statistics.median(speeds),
             "ratio_to_no_delay_median": statistics.median(ratios),
             "others_samples_per_s_median": statistics.median(other_speeds),
             "others_ratio_to_no_delay_median": statistics.median(other_ratios),
             "others_ratios": other_ratios}
      table.append(row)
      separated_text = "-" if separated is None else f"{separated:.3f}"
      print(f"{algorithm:<16}{delay:>6g}{row['samples_per_s_median']:>12.0f}"
            f"{row['ratio_to_no_delay_median']:>12.3f}{row['others_samples_per_s_median']:>10.0f}"
            f"{row['others_ratio_to_no_delay_median']:>13.3f}{separated_text:>14}"
            f"{1 / (1 + delay):>13.3f}")
  print(f"({args.num_devices} devices, straggler device {args.straggler} in {args.mode} mode, "
        f"{args.num_steps} steps, medians of {args.repeats} repeats, "
        f"{jax.devices()[0].device_kind})")
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "args": vars(args), "host_allocator": host_allocator,
               "table": table, "runs": runs}, f, indent=2)


if __name__ == "__main__":
  main()
