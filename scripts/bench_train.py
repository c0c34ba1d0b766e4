"""The user's command, side by side: training time and samples/s of each algorithm on one task.

Runs `python -m layup_jax.train --config <config>:<algorithm>` for every algorithm in turn,
`--repeats` rounds, alternating (round r runs every algorithm once before round r+1 starts), each
in its own process with its own workdir; reads each run's summary.json. Training time is the
summary's `wall_time_s` (compilation and evaluations excluded, waits for checkpoint saves
included, as the command runs them); samples/s is `train_samples_per_s`; "threads s" is
`host_threads_cpu_s`, the CPU time of the runtime's own dispatching threads (none for DDP).
The table gives medians over rounds and, per algorithm, the median over rounds of its time divided by the first algorithm's in the
same round, so both sides see the same moments of a shared machine.

  python scripts/bench_train.py --config configs/digits.py --algorithms layup ddp --repeats 3
  python scripts/bench_train.py --config configs/fashion_mnist.py --algorithms layup ddp \
      --set num_steps=234 --repeats 3 --out bench_train_fashion.json
  python scripts/bench_train.py --algorithms layup ddp --variant "chain tuning.chain_forwards=True"
  python scripts/bench_train.py --config configs/digits.py --algorithms layup ddp --split-cores

`--split-cores` runs each command with the fake devices' work on the first of its CPUs and
everything else (the runtime's dispatcher and updater threads, DDP's dispatching thread, the
input pipeline) on the others, as `bench_host.py --split-cores` does: the nearest this machine
comes to a node whose devices are not its CPUs. It tells what the host's work costs a run when
it does not take the devices' cores; it is not the shared machine's figure, which the default
gives. Each command starts under the allocator `auto` picks, as the plain command does.

A variant is "NAME KEY=VALUE ..." (config overrides), run as `<algorithm>:NAME` beside the plain
algorithm for every algorithm but DDP, in the same rounds; `--set` overrides every run's config.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from layup_jax.measure import provenance

# `python -c SPLIT_CORES <module> <its arguments>`: the module run as `python -m` runs it, after
# the process has started again under the allocator (as the command itself would) and split its
# cores (layup_jax.measure.bench_options.split_cores) before anything of JAX's backend exists:
# with the fake devices the command would make (layup_jax/train.py's default, which it sets on
# import, once the backend here has started).
SPLIT_CORES = """
import os, runpy, sys
from layup_jax.platform import allocator
allocator.use("auto")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
from layup_jax.measure import bench_options
bench_options.split_cores()
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def command_for(module_args: list[str], split_cores: bool = False) -> list[str]:
  """The interpreter's command that runs `module_args` (a module and its arguments) as
  `python -m` does, its cores split when `split_cores`."""
  if split_cores:
    return [sys.executable, "-c", SPLIT_CORES, *module_args]
  return [sys.executable, "-m", *module_args]


def run_once(config: str, algorithm: str, overrides: list[str], workdir: str,
             label: str | None = None, split_cores: bool = False) -> dict:
  module_args = ["layup_jax.train", "--config", f"{config}:{algorithm}", "--workdir", workdir,
                 "--config.progress_bar=False", *[f"--config.{o}" for o in overrides]]
  command = command_for(module_args, split_cores)
  started = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise SystemExit(f"python -m {' '.join(module_args)} failed:\n{done.stderr[-3000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  return {"algorithm": label or algorithm, "wall_time_s": summary["wall_time_s"],
          "samples_per_s": summary["train_samples_per_s"],
          "accuracy": summary["final_eval_accuracy"], "compile_s": summary["compile_s"],
          "host_threads_cpu_s": summary.get("host_threads_cpu_s"),
          "host_allocator": summary.get("host_allocator"),
          "process_s": time.perf_counter() - started}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--algorithms", nargs="+", default=["layup", "ddp"])
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="config overrides for every run, e.g. num_steps=234")
  parser.add_argument("--variant", action="append", default=[],
                      help='"NAME KEY=VALUE ...": config overrides, run beside the algorithms')
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--split-cores", action="store_true",
                      help="the devices' work on the first CPU, the rest of each run on the others")
  parser.add_argument("--out", default="bench_train.json")
  args = parser.parse_args()

  cases = [(a, a, []) for a in args.algorithms]
  for variant in args.variant:
    name, *overrides = variant.split()
    cases += [(f"{a}:{name}", a, overrides) for a in args.algorithms if a != "ddp"]
  runs = []
  with tempfile.TemporaryDirectory() as scratch:
    for repeat in range(args.repeats):
      for label, algorithm, overrides in cases:
        row = run_once(args.config, algorithm, args.set + overrides,
                       os.path.join(scratch, f"{label.replace(':', '-')}-{repeat}"), label,
                       args.split_cores)
        runs.append({"repeat": repeat, **row})
        print(json.dumps(runs[-1]), flush=True)

  first = args.algorithms[0]
  by_round = {(r["repeat"], r["algorithm"]): r for r in runs}
  table = []
  for label, _, _ in cases:  # a run's "algorithm" is its case's label
    mine = [r for r in runs if r["algorithm"] == label]
    time_ratio = [by_round[(r["repeat"], label)]["wall_time_s"]
                  / by_round[(r["repeat"], first)]["wall_time_s"] for r in mine]
    table.append({
        "algorithm": label,
        "wall_time_s": statistics.median(r["wall_time_s"] for r in mine),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in mine),
        "accuracy": statistics.median(r["accuracy"] for r in mine),
        "host_threads_cpu_s": (statistics.median(r["host_threads_cpu_s"] for r in mine)
                               if all(r.get("host_threads_cpu_s") is not None for r in mine)
                               else None),
        f"time_vs_{first}": statistics.median(time_ratio),
        "wall_time_all": [r["wall_time_s"] for r in mine],
    })
  print(f"\n{args.config} {' '.join(args.set)}, {args.repeats} alternated rounds (medians)"
        f"{', cores split' if args.split_cores else ''}")
  print(f"{'algorithm':<14} {'train s':>8} {'samples/s':>10} {'accuracy':>9} "
        f"{'time / ' + first:>12} {'threads s':>9}  all train s")
  for row in table:
    print(f"{row['algorithm']:<14} {row['wall_time_s']:>8.2f} {row['samples_per_s']:>10.0f} "
          f"{row['accuracy']:>9.4f} {row[f'time_vs_{first}']:>12.3f} "
          f"{'-' if row['host_threads_cpu_s'] is None else format(row['host_threads_cpu_s'], '.2f'):>9}  "
          f"{', '.join(f'{t:.2f}' for t in row['wall_time_all'])}")
  result = {"benchmark": "bench_train", "config": args.config, "overrides": args.set,
            "variants": args.variant,
            "repeats": args.repeats, "cores": os.cpu_count(), "split_cores": args.split_cores,
            "code_version": provenance.code_version(),
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "table": table, "runs": runs}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
