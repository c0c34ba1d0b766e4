"""Training time with checkpoints every N steps against the same run without checkpoints.

Each repeat runs both back to back (in alternating order), so each ratio compares runs taken
side by side; the table reports medians over repeats. Time per step is the run's training time
(`wall_time_s`: compilation and evaluation excluded, the time training waits for a checkpoint
save included) over its steps. Evaluation only at the end, so every checkpoint adds its own
pause of the threads.

  python scripts/bench_checkpoint.py --every 50 --repeats 3 --out bench_checkpoint.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import allocator_choice
import jax

from configs import digits
from layup_jax.run import runner


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--algorithms", nargs="+", default=["layup", "ddp"])
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  allocator_choice.add_option(parser)
  parser.add_argument("--out", default="bench_checkpoint.json")
  args = parser.parse_args()
  host_allocator = allocator_choice.use(args.allocator)
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="layup_jax_cache_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

  runs = []
  for repeat in range(args.repeats):
    for algorithm in args.algorithms:
      order = ["none", "every"] if repeat % 2 == 0 else ["every", "none"]
      for mode in order:
        config = digits.get_config(algorithm)
        config.num_devices, config.eval_every, config.progress_bar = args.num_devices, 0, False
        config.checkpoint.enabled = mode == "every"
        config.checkpoint.every = args.every
        with tempfile.TemporaryDirectory() as workdir:
          summary = runner.run(config, workdir)
        per_step = summary["wall_time_s"] / summary["num_steps"]
        runs.append({"repeat": repeat, "algorithm": algorithm, "mode": mode,
                     "seconds_per_step": per_step, **summary})
        print(f"repeat {repeat} {algorithm:>6} checkpoints {mode:>5}: {1e3 * per_step:.2f} ms/step",
              flush=True)

  def per_step(algorithm, mode, repeat):
    return next(r["seconds_per_step"] for r in runs if r["algorithm"] == algorithm
                and r["mode"] == mode and r["repeat"] == repeat)

  table = []
  print(f"\n{'algorithm':<10}{'none ms/step':>14}{f'every {args.every} ms/step':>20}"
        f"{'ratio':>8}")
  for algorithm in args.algorithms:
    ratios = [per_step(algorithm, "every", r) / per_step(algorithm, "none", r)
              for r in range(args.repeats)]
    row = {"algorithm": algorithm, "every": args.every,
           "none_ms_per_step": 1e3 * statistics.median(
               per_step(algorithm, "none", r) for r in range(args.repeats)),
           "every_ms_per_step": 1e3 * statistics.median(
               per_step(algorithm, "every", r) for r in range(args.repeats)),
           "ratio_median": statistics.median(ratios), "ratios": ratios}
    table.append(row)
    print(f"{algorithm:<10}{row['none_ms_per_step']:>14.2f}{row['every_ms_per_step']:>20.2f}"
          f"{row['ratio_median']:>8.3f}")
  with open(args.out, "w") as f:
    json.dump({"host_allocator": host_allocator, "table": table, "runs": runs,
               "devices": [str(d) for d in jax.devices()]}, f, indent=2)


if __name__ == "__main__":
  main()
