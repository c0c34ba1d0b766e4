"""Training throughput of a run split over processes against the same run in one process.

Each repeat runs every (algorithm, layout) back to back: `1x8` is one process with 8 devices
(`python -m layup_jax.train`), `2x4` two processes with 4 devices each, joined by JAX's
distributed runtime on 127.0.0.1 (`python -m layup_jax.launch`); the table reports medians
over repeats of training samples per second (compilation and evaluation excluded, from
`summary.json`) and the ratio 2x4 / 1x8 of each repeat. On one machine the two processes share
its cores, so the ratio measures what crossing processes costs (collectives over gloo's TCP,
the coordination service), not what a second host adds. `2x4-netns` runs the two processes in
two network namespaces joined by a veth pair (`scripts/netns_drill.sh`, as root): every byte
between them crosses a network interface, as between hosts.

For LayUp and GoSGD the table also gives the per-send latency between processes (median over
the run of the time from a stage's offer to its merge dispatched on the peer's process,
`remote_send_latency_ms` of the summary) and, beside it, the update latency of the sends within
a process (`stage_update_latency_ms`, sampled every `metrics.latency_every` iterations: from the
gradient computed to the merge computed on the peer).

  python scripts/bench_multihost.py --algorithms ddp layup --num-steps 60 --repeats 3 --out m.json
  sudo python scripts/bench_multihost.py --layouts 1x8 2x4 2x4-netns --out m.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from layup_jax.measure import provenance


def run(layout: str, algorithm: str, args, workdir: str) -> dict:
  processes, per_process = (int(n) for n in layout.removesuffix("-netns").split("x"))
  train = ["--config", f"{args.config}:{algorithm}", "--workdir", workdir,  # its column
           f"--config.num_steps={args.num_steps}", "--config.eval_every=0",
           "--config.checkpoint.enabled=False", "--config.progress_bar=False",
           f"--config.compilation_cache_dir={args.cache}"]
  if layout.endswith("-netns"):  # one process per network namespace, over a veth pair (root)
    env = dict(os.environ)
    command = ["bash", "scripts/netns_drill.sh", "--devices-per-process", str(per_process),
               "--", *train]
  elif processes == 1:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={per_process}"}
    command = [sys.executable, "-m", "layup_jax.train", *train]
  else:
    env = dict(os.environ)
    command = [sys.executable, "-m", "layup_jax.launch", "--processes", str(processes),
               "--devices-per-process", str(per_process), "--", *train]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
  if result.returncode:
    sys.exit(f"{layout} {algorithm} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  remote = summary.get("remote_send_latency_ms") or {}
  local = [v for v in summary.get("stage_update_latency_ms") or [] if v is not None]
  return {"layout": layout, "algorithm": algorithm,
          "samples_per_s": summary["train_samples_per_s"],
          "wall_time_s": summary["wall_time_s"], "compile_s": summary["compile_s"],
          "final_eval_loss": summary["final_eval_loss"],
          "send_latency_ms": remote.get("median"), "sends_between_processes": remote.get("count"),
          "update_latency_ms": statistics.mean(local) if local else None}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--algorithms", nargs="+", default=["ddp", "layup"])
  parser.add_argument("--layouts", nargs="+", default=["1x8", "2x4"])
  parser.add_argument("--num-steps", type=int, default=60)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_multihost_cc"))
  parser.add_argument("--out", default="bench_multihost.json")
  args = parser.parse_args()

  runs = []
  with tempfile.TemporaryDirectory() as scratch:
    for repeat in range(args.repeats):
      for algorithm in args.algorithms:
        for layout in args.layouts:
          record = run(layout, algorithm, args, os.path.join(scratch, f"{algorithm}-{layout}-"
                                                             f"{repeat}"))
          runs.append({**record, "repeat": repeat})
          print(f"[{repeat}] {algorithm} {layout}: {record['samples_per_s']:.0f} samples/s, "
                f"loss {record['final_eval_loss']:.6f}", flush=True)

  table = []
  reference = args.layouts[0]
  for algorithm in args.algorithms:
    for layout in args.layouts:
      mine = [r for r in runs if r["algorithm"] == algorithm and r["layout"] == layout]
      ratios = [r["samples_per_s"] / next(b["samples_per_s"] for b in runs
                                          if b["algorithm"] == algorithm and b["repeat"]
                                          == r["repeat"] and b["layout"] == reference)
                for r in mine]
      def median_of(key, mine=mine):
        values = [r[key] for r in mine if r[key] is not None]
        return statistics.median(values) if values else None

      table.append({"algorithm": algorithm, "layout": layout,
                    "samples_per_s": statistics.median(r["samples_per_s"] for r in mine),
                    f"vs_{reference}": statistics.median(ratios),
                    "send_latency_ms": median_of("send_latency_ms"),
                    "update_latency_ms": median_of("update_latency_ms"),
                    "final_eval_loss": [r["final_eval_loss"] for r in mine]})
  print(f"\n| algorithm | layout | samples/s (median) | vs {reference} (median of repeats) | "
        f"send latency between processes, ms | update latency within a process, ms |")
  print("|---|---|---|---|---|---|")
  cell = lambda v: "-" if v is None else f"{v:.1f}"
  for row in table:
    print(f"| {row['algorithm']} | {row['layout']} | {row['samples_per_s']:.0f} | "
          f"{row[f'vs_{reference}']:.2f} | {cell(row['send_latency_ms'])} | "
          f"{cell(row['update_latency_ms'])} |")
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "args": vars(args), "table": table, "runs": runs}, f,
              indent=2)


if __name__ == "__main__":
  main()
