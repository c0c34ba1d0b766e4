"""Turns sweep workdirs and benchmark results into docs/results.md: the paper's tables and figures.

    python scripts/report.py --sweep digits=runs/sweeps/digits \\
        --sweep cifar100_resnet18=runs/sweeps/cifar100_resnet18 --out docs/results.md
    python scripts/report.py --out docs/results.md      # again, from the collected JSON only

For each sweep (`scripts/sweep.py`) the runs' records are collected into
`docs/results/sweep_<name>.json` (so the report can be regenerated without the workdirs) and
rendered as: one table per straggler delay (final and best test accuracy or perplexity, training
time, time to target and to convergence, samples/s, MFU, per-stage update latency, the other
devices' throughput against no delay); the consensus distance at the middle and at the end;
figures (PNG): learning curves against wall-clock and against steps, final accuracy and training
time against the straggler delay (the paper's Figure 3), consensus distance over training (its
appendix figure). The benchmark results `docs/results/bench_*.json` (`scripts/bench_*.py`)
follow as tables. Needs matplotlib (`pip install -e '.[report]'`).
"""

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = {"layup": "LayUp", "ddp": "DDP", "gosgd": "GoSGD", "adpsgd": "AD-PSGD",
         "local_sgd": "Local SGD", "slowmo": "SlowMo", "co2": "CO2", "diloco": "DiLoCo"}
ORDER = list(NAMES)
GOSSIP = ("layup", "gosgd", "adpsgd")


# --- collecting -----------------------------------------------------------------------------

def collect(workdir: pathlib.Path) -> dict:
  """Every finished run of a sweep workdir: its summary and its metrics records."""
  meta = json.loads((workdir / "sweep.json").read_text())
  runs = []
  for summary_path in sorted(workdir.glob("delay*/*-seed*/summary.json")):
    run = summary_path.parent
    algorithm, _, seed = run.name.rpartition("-seed")
    runs.append({
        "algorithm": algorithm, "seed": int(seed), "delay": float(run.parent.name[5:]),
        "summary": json.loads(summary_path.read_text()),
        "records": [json.loads(line) for line in (run / "metrics.jsonl").open()],
    })
  if not runs:
    sys.exit(f"error: {workdir} has no finished run (summary.json); run scripts/sweep.py first")
  return {"meta": meta, "runs": runs}


# --- numbers --------------------------------------------------------------------------------

def mean_std(values, digits: int = 4) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.{digits}g}"
  return f"{statistics.mean(values):.{digits}g} ± {statistics.stdev(values):.2g}"


def metric_key(runs: list[dict]) -> tuple[str, bool]:
  """("perplexity", False) for language models, else ("accuracy", True): key, higher better."""
  language_model = any("final_eval_perplexity" in r["summary"] for r in runs)
  return ("perplexity", False) if language_model else ("accuracy", True)


def others_throughput(run: dict) -> float:
  """Samples/s of the devices other than the straggler (device 0), all devices without one."""
  per_device = run["summary"]["device_samples_per_s"]
  straggler = run["summary"].get("straggler_device", -1)
  return sum(v for i, v in enumerate(per_device) if i != straggler) / max(
      1, len(per_device) - (straggler >= 0))


def mean_latency_ms(run: dict) -> float | None:
  """The per-stage median update latencies, averaged over stages (None if not timed)."""
  latency = run["summary"].get("stage_update_latency_ms")
  values = [v for v in latency or [] if v is not None]
  return statistics.mean(values) if values else None


def test_records(run: dict) -> list[dict]:
  return [r for r in run["records"] if r["split"] == "test"]


# --- tables ---------------------------------------------------------------------------------

def sweep_tables(name: str, sweep: dict, figures: dict[str, str]) -> list[str]:
  meta, runs = sweep["meta"], sweep["runs"]
  key, higher = metric_key(runs)
  label = "accuracy" if higher else "perplexity"
  algorithms = [a for a in ORDER if any(r["algorithm"] == a for r in runs)]
  delays = sorted({r["delay"] for r in runs})
  first = runs[0]["summary"]
  seeds = sorted({r["seed"] for r in runs})
  versions = sorted({r["summary"].get("code_version") or "not recorded" for r in runs})
  data_note = (f"**Mocked data**: records from `tfds.testing.mock_data` ({meta['mock_tfds']} per "
               "split, random values of the real shapes), so accuracies are those of random "
               "labels; the timings are real." if meta.get("mock_tfds") else "")
  lines = [
      f"## {name}", "",
      (f"`{meta['config']}`, {first['num_devices']} devices, {first['num_steps']} steps per run, "
      f"seeds {seeds}; measured on {meta['date']}, {meta['machine']}; code version (the "
      f"runs' commit; -dirty: Python files changed) {', '.join(versions)}. Made by:"), "",
      *[f"    {command}" for command in meta["commands"]], "",
      ("Values are mean ± standard deviation over seeds. Training time excludes compilation "
       "and evaluations; time to target/convergence is the training time at the first "
       f"evaluation reaching the target/the run's best {label}. Update latency: per stage, the "
       "median time from its gradient being computed to its merge being computed on the peer "
       "(sampled iterations), averaged over stages."),
  ]
  if data_note:
    lines += ["", data_note]
  base = {a: statistics.median(others_throughput(r) for r in runs
                               if r["algorithm"] == a and r["delay"] == 0)
          for a in algorithms if any(r["algorithm"] == a and r["delay"] == 0 for r in runs)}
  for delay in delays:
    title = ("No straggler" if delay == 0 else
             f"Straggler: device 0 idles {delay:g} iterations' time before each iteration")
    header = (f"| method | final {label} | best {label} | training time (s) | time to target (s)"
              " | time to convergence (s) | samples/s | MFU | update latency (ms) |")
    rule = "|---|---|---|---|---|---|---|---|---|"
    if delay:
      header += " other devices' throughput vs no delay |"
      rule += "---|"
    lines += ["", f"### {title}", "", header, rule]
    for algorithm in algorithms:
      group = [r for r in runs if r["algorithm"] == algorithm and r["delay"] == delay]
      if not group:
        continue
      s = [r["summary"] for r in group]
      mfu = [x.get("mfu") for x in s]
      line = (f"| {NAMES[algorithm]} | {mean_std([x[f'final_eval_{key}'] for x in s])} | "
              f"{mean_std([x.get(f'best_eval_{key}') for x in s])} | "
              f"{mean_std([x['wall_time_s'] for x in s])} | "
              f"{mean_std([x.get('time_to_target_s') for x in s])} | "
              f"{mean_std([x.get('time_to_convergence_s') for x in s])} | "
              f"{statistics.median(x['train_samples_per_s'] for x in s):.0f} | "
              f"{mean_std([100 * m for m in mfu if m is not None], 3) + '%' if any(mfu) else '-'}"
              f" | {mean_std([mean_latency_ms(r) for r in group], 3)} |")
      if delay:
        ratio = statistics.median(others_throughput(r) for r in group) / base[algorithm] \
            if algorithm in base else None
        line += f" {ratio:.2f} |" if ratio is not None else " - |"
      lines.append(line)
  gossip = [r for r in runs if r["delay"] == 0 and r["algorithm"] in GOSSIP]
  if gossip:
    lines += ["", "### Consensus distance (no straggler)", "",
              ("Mean over devices of `||x_i - x_bar||^2 / ||x_bar||^2` (`x_bar` the push-sum "
               "average) at the middle evaluation and at the end."), "",
              "| method | middle step | at the middle | at the end |", "|---|---|---|---|"]
    for algorithm in GOSSIP:
      group = [r for r in gossip if r["algorithm"] == algorithm]
      if group:
        middles = [test_records(r)[len(test_records(r)) // 2] for r in group]
        lines.append(f"| {NAMES[algorithm]} | {middles[0]['step']} | "
                     f"{mean_std([m['consensus_distance'] for m in middles], 3)} | "
                     f"{mean_std([r['summary']['consensus_distance'] for r in group], 3)} |")
  lines += ["", "### Figures", ""]
  lines += [f"![{caption}]({path})" + "\n" for caption, path in figures.items()]
  return lines


# --- figures --------------------------------------------------------------------------------

def mean_curve(group: list[dict], key: str):
  """Steps, mean training time and mean `key` over seeds at each evaluation all runs share."""
  by_step: dict[int, list[dict]] = {}
  for run in group:
    for record in test_records(run):
      by_step.setdefault(record["step"], []).append(record)
  steps = sorted(s for s, rs in by_step.items() if len(rs) == len(group))
  return (steps, [statistics.mean(r["time_s"] for r in by_step[s]) for s in steps],
          [statistics.mean(r[key] for r in by_step[s]) for s in steps])


def draw_figures(name: str, sweep: dict, out_dir: pathlib.Path, link_dir: str) -> dict[str, str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = sweep["runs"]
  key, _ = metric_key(runs)
  algorithms = [a for a in ORDER if any(r["algorithm"] == a for r in runs)]
  delays = sorted({r["delay"] for r in runs})
  out_dir.mkdir(parents=True, exist_ok=True)
  figures = {}

  def save(fig, stem: str, caption: str) -> None:
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}_{stem}.png", dpi=110)
    plt.close(fig)
    figures[caption] = f"{link_dir}/{name}_{stem}.png"

  fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4))
  for algorithm in algorithms:
    group = [r for r in runs if r["algorithm"] == algorithm and r["delay"] == 0]
    if group:
      steps, times, values = mean_curve(group, key)
      by_time.plot(times, values, marker=".", label=NAMES[algorithm])
      by_step.plot(steps, values, marker=".", label=NAMES[algorithm])
  by_time.set(xlabel="training time (s)", ylabel=f"test {key}", title="against wall-clock")
  by_step.set(xlabel="step", ylabel=f"test {key}", title="against steps")
  by_step.legend(fontsize=8)
  save(fig, "learning_curves", f"{name}: test {key} against training time and steps "
       "(no straggler, mean over seeds)")

  if len(delays) > 1:
    fig, (quality, duration) = plt.subplots(1, 2, figsize=(11, 4))
    for algorithm in algorithms:
      points = [(d, [r["summary"] for r in runs if r["algorithm"] == algorithm
                     and r["delay"] == d]) for d in delays]
      points = [(d, s) for d, s in points if s]
      if len(points) < 2:
        continue
      xs = [d for d, _ in points]
      quality.plot(xs, [statistics.mean(x[f"final_eval_{key}"] for x in s) for _, s in points],
                   marker="o", label=NAMES[algorithm])
      duration.plot(xs, [statistics.mean(x["wall_time_s"] for x in s) for _, s in points],
                    marker="o", label=NAMES[algorithm])
    quality.set(xlabel="straggler delay (iterations)", ylabel=f"final test {key}")
    duration.set(xlabel="straggler delay (iterations)", ylabel="training time (s)")
    duration.legend(fontsize=8)
    save(fig, "straggler", f"{name}: final test {key} and training time against the straggler "
         "delay (paper Figure 3)")

  gossip = [a for a in algorithms if a in GOSSIP]
  if gossip:
    fig, axis = plt.subplots(figsize=(6, 4))
    for algorithm in gossip:
      group = [r for r in runs if r["algorithm"] == algorithm and r["delay"] == 0]
      if group:
        steps, _, values = mean_curve(group, "consensus_distance")
        axis.semilogy([s for s, v in zip(steps, values) if v > 0],
                      [v for v in values if v > 0], marker=".", label=NAMES[algorithm])
    axis.set(xlabel="step", ylabel="consensus distance", title="distance to the push-sum average")
    axis.legend(fontsize=8)
    save(fig, "consensus", f"{name}: consensus distance over training (no straggler)")
  return figures


# --- benchmarks -----------------------------------------------------------------------------

def benchmark_tables(results: pathlib.Path) -> list[str]:
  lines = []
  path = results / "bench_step.json"
  if path.exists():
    bench = json.loads(path.read_text())
    lines += ["", "### Staged step against the fused step (`scripts/bench_step.py`)", "",
              (f"{bench['platform']}, jax {bench['jax']}; time per iteration on one device, "
              "medians; throughput ratios are medians of per-repeat ratios "
              f"({bench.get('command', '')})."), "",
              ("| case | stages | batch | fused ms | runtime ms | serial ms | pytrees ms | "
              "runtime / fused | serial / fused | pytrees / fused |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
      lines.append(
          f"| {r['case']} | {r['num_stages']} | {r['batch_size']} | {r['fused_ms_median']:.2f} | "
          f"{r['runtime_ms_median']:.2f} | {r['staged_ms_median']:.2f} | "
          f"{r['pytrees_ms_median']:.2f} | {r['throughput_ratio_runtime_over_fused_median']:.3f} "
          f"| {r['throughput_ratio_staged_over_fused_median']:.3f} | "
          f"{r['throughput_ratio_pytrees_over_fused_median']:.3f} |")
  path = results / "bench_runtime.json"
  if path.exists():
    bench = json.loads(path.read_text())
    table = bench["table"]
    lines += ["", "### Threads and gossip (`scripts/bench_runtime.py`)", "",
              f"Medians of {bench['args']['repeats']} side-by-side repeats.", "",
              "| measure | median | target |", "|---|---|---|",
              (f"| one device: runtime / bare staged step | {table['one_device_ratio']:.3f} | "
              "<= 1.05 |")]
    for row in bench["gossip"]:
      lines.append(f"| {bench['args']['num_devices']} devices, {row['case']}: gossip on / off "
                   f"| {row['ratio']:.3f} | <= 1.10 |")
  path = results / "bench_ahead.json"
  if path.exists():
    bench = json.loads(path.read_text())
    lines += ["", ("### How far a compute thread dispatches ahead (`scripts/bench_runtime.py "
              "--ahead`)"), "",
              (f"Digits, {bench['args']['num_devices']} devices, `layup.max_dispatch_ahead` = "
               "iterations a compute thread may dispatch before its device has produced the "
               "oldest one's loss; time per step and consensus test accuracy after 70 steps "
               f"(medians of {bench['args']['repeats']} repeats)."), "",
              "| max_dispatch_ahead | ms per step | test accuracy |", "|---|---|---|"]
    for row in bench["ahead"]:
      lines.append(f"| {row['ahead']} | {row['ms_per_step']:.1f} | {row['accuracy']:.4f} |")
  path = results / "bench_straggler_8dev.json"
  if path.exists():
    bench = json.loads(path.read_text())
    ratio = {(r["algorithm"], r["delay_iters"]): r["others_ratio_to_no_delay_median"]
             for r in bench["table"]}
    delays = [d for d in bench["args"]["delays"] if d]
    lines += ["", "### Stragglers on the host (`scripts/bench_straggler.py`)", "",
              (f"{bench['args']['num_devices']} devices, device {bench['args']['straggler']} "
               "delayed; throughput of the other devices against no delay (medians of "
               f"{bench['args']['repeats']} side-by-side repeats)."), "",
              "| delay | LayUp | DDP | 1/(1+delay) |", "|---|---|---|---|"]
    for delay in delays:
      cells = [f"{ratio[a, delay]:.2f}" if (a, delay) in ratio else "-" for a in ("layup", "ddp")]
      lines.append(f"| {delay:g} | {cells[0]} | {cells[1]} | {1 / (1 + delay):.2f} |")
  lines += device_straggler_table(results)
  path = results / "bench_pushsum.json"
  if path.exists():
    bench = json.loads(path.read_text())
    args = bench["args"]
    lines += ["", "### The push-sum average under threads (`scripts/bench_pushsum.py`)", "",
              (f"Digits, {args['num_devices']} devices, {args['iterations']} threaded "
               f"iterations each at learning rate 0, replicas made distinct (noise "
               f"{args['noise']}): how far each stage's push-sum average moved (relative L2; "
               f"median and largest of {args['repeats']} runs), the consensus distance after "
               "over before, and the per-stage weight sums."), "",
              ("| algorithm | layup.push_sum | average moved | largest | distance after / "
               "before | weight sums |"), "|---|---|---|---|---|---|"]
    for r in bench["table"]:
      push_sum = r["push_sum"] if r["algorithm"] != "adpsgd" else "- (no weights)"
      lines.append(f"| {r['algorithm']} | {push_sum} | {r['average_moved_median']:.1e} | "
                   f"{r['average_moved_max']:.1e} | {r['consensus_distance_ratio_median']:.1e} "
                   f"| {r['weight_sum_min']:.12f} to {r['weight_sum_max']:.12f} |")
  path = results / "bench_memory.json"
  if path.exists():
    bench = json.loads(path.read_text())
    lines += ["", "### Memory (`scripts/bench_memory.py`)", "",
              "Peak bytes per device (largest over devices).", "",
              "| case | LayUp MiB | DDP MiB | largest stage MiB | LayUp <= DDP + stage |",
              "|---|---|---|---|---|"]
    for r in bench["rows"]:
      lines.append(f"| {r['case']} | {r['layup_peak_bytes'] / 2**20:.2f} | "
                   f"{r['ddp_peak_bytes'] / 2**20:.2f} | "
                   f"{r['layup']['largest_stage_param_bytes'] / 2**20:.2f} | {r['holds']} |")
  def made_with(bench: dict) -> str:
    code = bench.get("code")
    return bench.get("measured", "") + (f", code {code}" if code and bench.get("measured") else "")

  measured = sorted({made_with(json.loads(p.read_text())) for p in results.glob("bench_*.json")}
                    - {""})
  if measured:
    lines = ["", "Measured: " + "; ".join(measured) + "."] + lines
  return (["", "## Benchmarks", "", ("Each script prints its table and writes the JSON read "
           "here; see [measurements.md](measurements.md#the-benchmark-scripts) for the commands.")] + lines) if lines else []


def device_straggler_table(results: pathlib.Path) -> list[str]:
  """The device-mode straggler benchmark, with the same run on the earlier runtime beside it
  where `bench_straggler_device_before.json` holds one."""
  path = results / "bench_straggler_device.json"
  if not path.exists():
    return []
  runs = {"after": json.loads(path.read_text())}
  before = results / "bench_straggler_device_before.json"
  if before.exists():
    runs["before"] = json.loads(before.read_text())
  args = runs["after"]["args"]

  def cell(label: str, algorithm: str, delay: float, key: str) -> str:
    rows = [r for r in runs.get(label, {}).get("table", [])
            if r["algorithm"] == algorithm and r["delay_iters"] == delay]
    return f"{rows[0][key]:.2f}" if rows and rows[0][key] is not None else "-"

  lines = ["", "### Stragglers on the device (`scripts/bench_straggler.py --mode device`)", "",
           (f"{args['num_devices']} devices; device {args['straggler']}'s iterations carry a "
            "delay program on its device while its thread goes on dispatching. Throughput of "
            "the other devices against no delay (medians of "
            f"{args['repeats']} side-by-side repeats); on these fake CPU devices the delay "
            "program takes CPU from the others, which LayUp without gossip shows alone; "
            "\"separated\" is LayUp's ratio over that one, repeat by repeat. \"before\": the "
            "runtime that dispatched a merge before its input was computed (commit "
            f"{runs.get('before', {}).get('code') or '-'})."), "",
           ("| delay | LayUp | LayUp, no gossip | separated | DDP | 1/(1+delay) | before: "
            "LayUp | before: separated |"), "|---|---|---|---|---|---|---|---|"]
  for delay in [d for d in args["delays"] if d]:
    lines.append(
        f"| {delay:g} | {cell('after', 'layup', delay, 'others_ratio_to_no_delay_median')} | "
        f"{cell('after', 'layup-nogossip', delay, 'others_ratio_to_no_delay_median')} | "
        f"{cell('after', 'layup', delay, 'others_vs_no_gossip_median')} | "
        f"{cell('after', 'ddp', delay, 'others_ratio_to_no_delay_median')} | "
        f"{1 / (1 + delay):.2f} | "
        f"{cell('before', 'layup', delay, 'others_ratio_to_no_delay_median')} | "
        f"{cell('before', 'layup', delay, 'others_vs_no_gossip_median')} |")
  return lines


def render(sweeps: dict[str, dict], results: pathlib.Path, out: pathlib.Path) -> str:
  lines = ["# Results", "",
           ("Regenerated by `python scripts/report.py` from `docs/results/` (do not edit by "
            "hand); `bash scripts/reproduce_results.sh` reruns every sweep and benchmark first.")]
  link_dir = str((results / "figures").relative_to(out.parent)) if results.is_relative_to(
      out.parent) else str(results / "figures")
  for name, sweep in sweeps.items():
    figures = draw_figures(name, sweep, results / "figures", link_dir)
    lines += [""] + sweep_tables(name, sweep, figures)
  lines += benchmark_tables(results)
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sweep", action="append", default=[], metavar="NAME=WORKDIR",
                      help="collect a sweep workdir under NAME (repeatable)")
  parser.add_argument("--results", default=str(ROOT / "docs" / "results"))
  parser.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
  args = parser.parse_args()
  results, out = pathlib.Path(args.results).resolve(), pathlib.Path(args.out).resolve()
  results.mkdir(parents=True, exist_ok=True)
  for item in args.sweep:
    name, sep, workdir = item.partition("=")
    if not sep:
      sys.exit(f"error: --sweep takes NAME=WORKDIR, got {item!r}")
    (results / f"sweep_{name}.json").write_text(json.dumps(collect(pathlib.Path(workdir))))
  sweeps = {path.stem.removeprefix("sweep_"): json.loads(path.read_text())
            for path in sorted(results.glob("sweep_*.json"))}
  out.write_text(render(sweeps, results, out))
  print(f"wrote {out} ({len(sweeps)} sweeps, figures in {results / 'figures'})")


if __name__ == "__main__":
  main()
