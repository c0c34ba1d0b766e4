"""Training across several "hosts", in two modes (the first argument; default `hosts`).

  hosts      several hosts on one machine (network namespaces, scripts/cluster_drill.sh, as
             root) on links of a given rate: training time, accuracy, bytes and send latency
  processes  a run split over processes against the same run in one process

    sudo python scripts/bench_cluster.py --layouts 2x4 --rates unshaped 20mbit \\
        --algorithms ddp layup --repeats 3 --out cluster.json                      # hosts
    python scripts/bench_cluster.py processes --algorithms ddp layup --num-steps 60 \\
        --repeats 3 --out m.json

`python scripts/bench_cluster.py MODE --help` lists a mode's options.

## hosts

Each repeat runs every (algorithm, variant) x layout x rate once, in that order (alternated, so
that a machine's drift falls on all of them alike); the table gives medians over repeats of the
training time, samples per second and final accuracy from `summary.json`, the bytes the run
counted between processes per device-iteration (layup_jax/multiprocess/traffic.py: gossip's
sends as made, a collective's bandwidth-optimal share) and the bytes the hosts' links carried per
device-iteration (the interfaces' counters: everything, collectives as gloo runs them, the
coordination service, evaluation's gathers), and the median send latency between processes.
Each run's row in the JSON also keeps device 0's own final accuracy, the replicas' final
consensus distance and the run's test curve (step, training time, accuracy, distance).

  sudo python scripts/bench_cluster.py --algorithms layup \\
      --variant "backlog8 distributed.max_remote_backlog=8" --rates 20mbit
  sudo python scripts/bench_cluster.py --config configs/fashion_mnist.py --num-steps 0 \\
      --eval-every 0 --seeds 0 1 2 --repeats 1 --rates 20mbit \\
      --set metrics.target_accuracy=0.85 --set metrics.stop_at_target=True
  sudo python scripts/bench_cluster.py --config configs/stdlib_gpt2_mini.py --num-steps 0 \\
      --eval-every 0 --seeds 0 1 2 --repeats 1 --rates 20mbit \\
      --algorithms layup ddp diloco gosgd --out docs/results/hosts_stdlib_gpt2_mini.json

Uneven hosts: `--slow-factors 1 1.5 2 4` runs each case with host `--slow-host`'s devices at
that multiple of their iteration time (`straggler.process`, `straggler.delay_iters` = factor - 1,
`--slow-mode host` or `device`: layup_jax/runtime/straggler.py), one table row per factor;
`--link K=RATE` (repeatable) gives host K's link its own rate (uneven links: `--rates 100mbit
--link 1=5mbit`).

  sudo python scripts/bench_cluster.py --config configs/fashion_mnist.py --num-steps 0 \
      --eval-every 0 --seeds 0 1 2 --repeats 1 --rates 20mbit --slow-factors 1 1.5 2 4 \
      --algorithms ddp diloco local_sgd layup --set metrics.target_accuracy=0.88 \
      --out docs/results/hosts_uneven_fashion_mnist.json

A variant is "NAME KEY=VALUE ..." (config overrides), run beside the plain algorithm; `--set`
overrides every run's config; `--num-steps 0` / `--eval-every 0` keep the config's. With a
target, each run records its time to it (training time, evaluation excluded). `--repeats` is
3 unless given. `--cpus-per-host C` gives each host's process C CPUs of its own (the drill's
option; by default every process may run on every CPU). The drill starts `$PYTHON` (default:
the interpreter running this script).
Ctrl-C stops the run under way and removes its namespaces before this script stops.

## processes (was scripts/bench_multihost.py)

Each repeat runs every (algorithm, layout) back to back: `1x8` is one process with 8 devices
(`python -m layup_jax.train`), `2x4` two processes with 4 devices each, joined by JAX's
distributed runtime on 127.0.0.1 (`python -m layup_jax.launch`); the table reports medians
over repeats of training samples per second (compilation and evaluation excluded, from
`summary.json`) and the ratio 2x4 / 1x8 of each repeat. On one machine the two processes share
its cores, so the ratio measures what crossing processes costs (collectives over gloo's TCP,
the coordination service), not what a second host adds. `2x4-netns` runs the two processes in
two network namespaces on one bridge (`scripts/cluster_drill.sh --hosts 2`, as root): every byte
between them crosses a network interface, as between hosts.

For LayUp and GoSGD the table also gives the per-send latency between processes (median over
the run of the time from a stage's offer to its merge dispatched on the peer's process,
`remote_send_latency_ms` of the summary) and, beside it, the update latency of the sends within
a process (`stage_update_latency_ms`, sampled every `metrics.latency_every` iterations: from the
gradient computed to the merge computed on the peer).

  sudo python scripts/bench_cluster.py processes --layouts 1x8 2x4 2x4-netns --out m.json
"""

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from layup_jax.measure import provenance
from layup_jax.run.records import read_metrics

MODES = ("hosts", "processes")

# --- hosts --------------------------------------------------------------------------------------


def run_drill(command: list[str]) -> subprocess.CompletedProcess:
  """Runs the drill, and on Ctrl-C lets it clean up before this script stops: `subprocess.run`
  would SIGKILL it 0.25 s after the interrupt, in the middle of removing its namespaces, and
  leave them (and the training processes in them) behind."""
  with subprocess.Popen(command, cwd=ROOT, env={"PYTHON": sys.executable, **os.environ},
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as drill:
    try:
      stdout, stderr = drill.communicate()
    except KeyboardInterrupt:
      drill.send_signal(signal.SIGINT)  # a terminal's Ctrl-C has sent it too: the drill takes one
      drill.wait()
      raise
  return subprocess.CompletedProcess(command, drill.returncode, stdout, stderr)


def slow_overrides(factor: float, args) -> list[str]:
  """A slow host's config: its devices at `factor` times their iteration time."""
  if factor == 1:
    return []
  return [f"straggler.process={args.slow_host}", f"straggler.delay_iters={factor - 1:g}",
          f"straggler.mode={args.slow_mode}"]


def run(layout: str, rate: str, algorithm: str, overrides: list[str], seed: int, args,
        workdir: str, factor: float = 1.0) -> dict:
  hosts, per_host = (int(n) for n in layout.split("x"))
  stats = os.path.join(workdir, "links.json")
  overrides = [*overrides, *slow_overrides(factor, args)]
  command = ["bash", "scripts/cluster_drill.sh", "--hosts", str(hosts), "--devices-per-host",
             str(per_host), "--stats", stats, *(["--rate", rate] if rate != "unshaped" else []),
             *[flag for link in args.link for flag in ("--host-rate", link)],
             *(["--cpus-per-host", str(args.cpus_per_host)] if args.cpus_per_host else []),
             # `config.py:algorithm` takes the algorithm's column of the config's table (its
             # searched lr and warm-up); `--config.algorithm=` would keep the default column's.
             "--", "--config", f"{args.config}:{algorithm}", "--workdir", workdir,
             f"--config.seed={seed}",
             *([f"--config.num_steps={args.num_steps}"] if args.num_steps else []),
             *([f"--config.eval_every={args.eval_every}"] if args.eval_every else []),
             "--config.checkpoint.enabled=False",
             "--config.progress_bar=False", f"--config.compilation_cache_dir={args.cache}",
             *[f"--config.{o}" for o in [*args.set, *overrides]]]
  result = run_drill(command)
  if result.returncode:  # recorded and reported; the other runs go on
    print(f"{layout} {rate} {algorithm} failed (status {result.returncode}):\n"
          f"{result.stdout[-3000:]}{result.stderr[-2000:]}", file=sys.stderr, flush=True)
    # A process's one-line error, where one said it (the drill's last lines are link counters,
    # and its own line on stderr only names the process that failed first); else the drill's.
    said = ([line for line in result.stdout.splitlines() if "error:" in line]
            or [line for line in result.stderr.splitlines() if "error:" in line])
    tail = said[-1] if said else (result.stderr.strip() or result.stdout.strip()
                                  or "no output").splitlines()[-1]
    return {"layout": layout, "rate": rate, "algorithm": algorithm, "seed": seed,
            "slow_factor": factor, "failed": f"status {result.returncode}: {tail}"}
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(stats) as f:
    links = json.load(f)
  iterations = summary["num_steps"] * summary["num_devices"]
  remote = summary.get("remote_send_latency_ms") or {}
  return {"layout": layout, "rate": rate, "algorithm": algorithm, "seed": seed,
          "slow_factor": factor, "links": [h.get("rate") for h in links["links"]],
          "device_samples_per_s": summary.get("device_samples_per_s"),
          "training_s": summary["wall_time_s"], "samples_per_s": summary["train_samples_per_s"],
          "final_accuracy": summary["final_eval_accuracy"],
          "final_loss": summary.get("final_eval_loss"),
          # Device 0's own replica, and how far the replicas are from their average at the
          # end: whether an accuracy short of DDP's is the average's or every replica's.
          "device0_accuracy": summary.get("final_device0_accuracy"),
          "consensus_distance": summary.get("consensus_distance"),
          "time_to_target_s": summary.get("time_to_target_s"),
          "stopped_at_target": summary.get("stopped_at_target", False),
          "counted_bytes_per_iteration":
              summary.get("bytes_between_processes_per_device_iteration"),
          "link_bytes_per_iteration": sum(h["tx_bytes"] for h in links["links"]) / iterations,
          "send_latency_ms": remote.get("median"), "send_latency_p90_ms": remote.get("p90"),
          "host_allocator": summary.get("host_allocator"),  # process 0's (each chooses alike)
          "test_curve": evaluation_curve(workdir)}


def evaluation_curve(workdir: str) -> list[dict]:
  """The run's test rows (step, training time, loss, accuracy, the replicas' consensus distance;
  with `precise_bn_batches` also the running statistics' accuracy): where a target was crossed,
  readable after the run's temporary directory is gone."""
  keys = ("step", "time_s", "loss", "accuracy", "running_statistics_accuracy",
          "consensus_distance")
  return [{k: row[k] for k in keys if k in row} for row in read_metrics(workdir)
          if row.get("split") == "test"]


def main_hosts(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_cluster.py [hosts]",
      description="Training across several hosts (network namespaces) on links of a given "
                  "rate: scripts/cluster_drill.sh, as root.")
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--algorithms", nargs="+", default=["ddp", "layup"])
  parser.add_argument("--variant", action="append", default=[],
                      help='"NAME KEY=VALUE ...": config overrides, run beside the algorithms')
  parser.add_argument("--layouts", nargs="+", default=["2x4"])
  parser.add_argument("--rates", nargs="+", default=["unshaped", "20mbit"])
  parser.add_argument("--num-steps", type=int, default=150, help="0: the config's")
  parser.add_argument("--eval-every", type=int, default=50, help="0: the config's")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for every run")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cpus-per-host", type=int, default=0,
                      help="each host's process on CPUs of its own (cluster_drill.sh; 0: shared)")
  parser.add_argument("--slow-factors", type=float, nargs="+", default=[1.0],
                      help="host --slow-host's iteration time, as a multiple of its own")
  parser.add_argument("--slow-host", type=int, default=1)
  parser.add_argument("--slow-mode", choices=("host", "device"), default="host")
  parser.add_argument("--link", action="append", default=[], metavar="K=RATE",
                      help="host K's link rate, instead of the --rates one (repeatable)")
  parser.add_argument("--cache", default=None,
                      help="compilation cache folder (default: a private temporary one)")
  parser.add_argument("--out", default="bench_cluster.json")
  args = parser.parse_args(argv)
  # A folder of this run's own (mkdtemp: mode 0700, a fresh name): a fixed path under a shared
  # /tmp, written as root, would let another user plant compiled programs in it first.
  args.cache = args.cache or tempfile.mkdtemp(prefix="bench_cluster_cache_")
  if os.geteuid() != 0:
    sys.exit("error: run as root (scripts/cluster_drill.sh creates network namespaces)")
  if any(f < 1 for f in args.slow_factors):
    parser.error("--slow-factors are multiples of an iteration's time: each >= 1")
  cases = [(a, a, []) for a in args.algorithms]
  for variant in args.variant:
    name, *overrides = variant.split()
    cases += [(f"{a}:{name}", a, overrides) for a in args.algorithms if a != "ddp"]
  rows, stopped = [], False
  try:
    for repeat, seed, layout, rate, factor, (label, algorithm, overrides) in itertools.product(
        range(args.repeats), args.seeds, args.layouts, args.rates, args.slow_factors, cases):
      with tempfile.TemporaryDirectory() as workdir:
        row = run(layout, rate, algorithm, overrides, seed, args, workdir, factor)
      row.update(case=label, repeat=repeat, overrides=overrides)
      rows.append(row)
      print(json.dumps(row), flush=True)
      write(args, rows, table=None)  # so far, in case the run is stopped
  except KeyboardInterrupt:  # Ctrl-C: the table of the runs that finished, then stop
    stopped = True
    print(f"\nstopped after {len(rows)} runs; the table holds those", file=sys.stderr)

  def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None

  table = []
  for layout, rate, factor, (label, _, _) in itertools.product(args.layouts, args.rates,
                                                               args.slow_factors, cases):
    mine = [r for r in rows if (r["layout"], r["rate"], r["case"], r["slow_factor"])
            == (layout, rate, label, factor)]
    if not mine:  # not run: the bench was stopped first
      continue
    failed = [r["failed"] for r in mine if "failed" in r]
    mine = [r for r in mine if "failed" not in r]
    table.append({"layout": layout, "rate": rate, "case": label, "slow_factor": factor,
                  "failed": failed,
                  **{k: median([r[k] for r in mine]) for k in (
                      "training_s", "samples_per_s", "final_accuracy", "time_to_target_s",
                      "counted_bytes_per_iteration", "link_bytes_per_iteration",
                      "send_latency_ms", "send_latency_p90_ms")}})
  links = "".join(f", host {link.replace('=', ' at ')}" for link in args.link)
  print(f"\nhost {args.slow_host} slow ({args.slow_mode} side) by the factor{links}")
  print("\n| case | layout | link | slow factor | training s | samples/s | final accuracy | time to target s | "
        "counted kB/it | link kB/it | send latency ms (median / p90) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  for t in table:
    if t["failed"] and t["training_s"] is None:
      print(f"| {t['case']} | {t['layout']} | {t['rate']} | {t['slow_factor']:g} | "
            f"failed: {t['failed'][0]} |")
      continue
    print(f"| {t['case']} | {t['layout']} | {t['rate']} | {t['slow_factor']:g} | "
          f"{fmt(t['training_s'], '.1f')} | "
          f"{fmt(t['samples_per_s'], ',.0f')} | {fmt(t['final_accuracy'], '.4f')} | "
          f"{fmt(t['time_to_target_s'], '.1f')} | "
          f"{fmt(t['counted_bytes_per_iteration'] and t['counted_bytes_per_iteration'] / 1e3, '.1f')} | "
          f"{fmt(t['link_bytes_per_iteration'] and t['link_bytes_per_iteration'] / 1e3, '.1f')} | "
          f"{fmt(t['send_latency_ms'], '.0f')} / {fmt(t['send_latency_p90_ms'], '.0f')} |")
  write(args, rows, table, stopped)
  if stopped:
    sys.exit(130)
  failures = [r for r in rows if "failed" in r]
  if failures:
    sys.exit(f"{len(failures)} of {len(rows)} runs failed (rows with 'failed' in {args.out})")


def write(args, rows: list[dict], table: list[dict] | None, stopped: bool = False) -> None:
  """`table` None: runs still to come; `stopped`: Ctrl-C ended the bench before every run."""
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "args": vars(args), "table": table, "stopped": stopped,
               "runs": rows}, f, indent=1)


# --- processes ----------------------------------------------------------------------------------


def run_processes(layout: str, algorithm: str, args, workdir: str) -> dict:
  processes, per_process = (int(n) for n in layout.removesuffix("-netns").split("x"))
  train = ["--config", f"{args.config}:{algorithm}", "--workdir", workdir,  # its column
           f"--config.num_steps={args.num_steps}", "--config.eval_every=0",
           "--config.checkpoint.enabled=False", "--config.progress_bar=False",
           f"--config.compilation_cache_dir={args.cache}"]
  if layout.endswith("-netns"):  # one process per network namespace, over a bridge (root)
    result = run_drill(["bash", "scripts/cluster_drill.sh", "--hosts", str(processes),
                        "--devices-per-host", str(per_process), "--", *train])
  else:
    if processes == 1:
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


def main_processes(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_cluster.py processes",
      description="Training throughput of a run split over processes against the same run in "
                  "one process.")
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--algorithms", nargs="+", default=["ddp", "layup"])
  parser.add_argument("--layouts", nargs="+", default=["1x8", "2x4"])
  parser.add_argument("--num-steps", type=int, default=60)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cache", default=None,
                      help="compilation cache folder (default: a private temporary one)")
  parser.add_argument("--out", default="bench_multihost.json")
  args = parser.parse_args(argv)
  # A folder of this run's own (mkdtemp: mode 0700, a fresh name): a fixed path under a shared
  # /tmp, written as root, would let another user plant compiled programs in it first.
  args.cache = args.cache or tempfile.mkdtemp(prefix="bench_cluster_cache_")
  if any(layout.endswith("-netns") for layout in args.layouts) and os.geteuid() != 0:
    sys.exit("error: run as root for a -netns layout (scripts/cluster_drill.sh creates network "
             "namespaces)")

  runs = []
  with tempfile.TemporaryDirectory() as scratch:
    for repeat in range(args.repeats):
      for algorithm in args.algorithms:
        for layout in args.layouts:
          workdir = os.path.join(scratch, f"{algorithm}-{layout}-{repeat}")
          record = run_processes(layout, algorithm, args, workdir)
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


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return
  mode, argv = (argv[0], argv[1:]) if argv and argv[0] in MODES else ("hosts", argv)
  {"hosts": main_hosts, "processes": main_processes}[mode](argv)


if __name__ == "__main__":
  main()
