"""Turns sweep workdirs and benchmark results into docs/results.md: the paper's tables and figures.

    python scripts/report.py --sweep digits=runs/sweeps/digits \\
        --sweep cifar100_resnet18=runs/sweeps/cifar100_resnet18 --out docs/results.md
    python scripts/report.py --out docs/results.md      # again, from the collected JSON only

For each sweep (`scripts/sweep.py`) the runs' records are collected into
`docs/results/sweep_<name>.json` (so the report can be regenerated without the workdirs) and
rendered as: the paper's claims checked on the runs; one table per straggler mode and delay (final and best test accuracy or perplexity, training
time, time to target and to convergence, samples/s, MFU, per-stage update latency, the other
devices' throughput against no delay); the consensus distance at the middle and at the end, and
every method's at every evaluation; the ablations (`scripts/sweep.py --variant`) beside the
config's own runs;
figures (PNG): learning curves against wall-clock and against steps, final accuracy and training
time against the straggler delay per mode (the paper's Figure 3), consensus distance over training (its
appendix figure). The benchmark results `docs/results/bench_*.json` (`scripts/bench_*.py`)
follow as tables. Needs matplotlib (`pip install -e '.[report]'`).
"""

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = {"layup": "LayUp", "layup_paper": "LayUp (paper's Algorithm 1)", "ddp": "DDP", "gosgd": "GoSGD", "adpsgd": "AD-PSGD",
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
    name, _, seed = run.name.rpartition("-seed")
    algorithm, _, variant = name.partition("@")
    delay, _, mode = run.parent.name[5:].partition("-")
    runs.append({
        "algorithm": algorithm, "variant": variant, "seed": int(seed), "delay": float(delay),
        "mode": mode or "host",
        "summary": json.loads(summary_path.read_text()),
        "records": [json.loads(line) for line in (run / "metrics.jsonl").open()],
    })
  if not runs:
    sys.exit(f"error: {workdir} has no finished run (summary.json); run scripts/sweep.py first")
  return {"meta": meta, "runs": runs}


# --- samples to accuracy (tokens to loss) ---------------------------------------------------------

BUDGET_TARGETS = (0.89, 0.90)  # accuracy targets; a language model's is its config's target_loss
LOSS_MARGIN = 0.01  # nats: a language model's claim, LayUp's final loss <= DDP's + this


def collect_budgets(workdirs: list[pathlib.Path]) -> dict:
  """The runs of one sweep per training budget (`--set num_epochs=B` or `num_steps=B`): per run
  its method, variant, seed, final accuracy and loss, and its test curve (step, loss,
  accuracy); a language model's runs also their tokens per sample and target loss."""
  runs, commands = [], []
  for workdir in workdirs:
    sweep = collect(workdir)
    commands += sweep["meta"]["commands"]
    for run in sweep["runs"]:
      summary = run["summary"]
      runs.append({"algorithm": run["algorithm"], "variant": run["variant"], "seed": run["seed"],
                   "delay": run["delay"], "num_steps": summary["num_steps"],
                   "num_devices": summary["num_devices"],
                   "samples_per_step": summary.get("samples_per_step"),
                   "final_accuracy": summary["final_eval_accuracy"],
                   "final_loss": summary.get("final_eval_loss"),
                   "tokens_per_sample": summary.get("tokens_per_sample"),
                   "target_loss": summary.get("target_loss"),
                   "curve": [[r["step"], r.get("loss"), r.get("accuracy")]
                             for r in test_records(run)],
                   "code_version": summary.get("code_version")})
  meta = collect(workdirs[0])["meta"]
  return {"meta": {**meta, "commands": commands}, "runs": runs}


def budget_run_key(run: dict) -> tuple:
  return (run["algorithm"], run["variant"], run["seed"], run["delay"], run["num_steps"])


def merge_budgets(before: dict, collected: dict) -> dict:
  """The runs collected now, and those of an earlier collection (`docs/results/budgets_*.json`)
  that they do not repeat: a sweep's workdirs (`runs/`) are not kept in the repository, so a
  budget sweep finished in parts on different checkouts is still one table. A run collected
  now replaces the earlier one of the same method, variant, seed, delay and budget; each keeps
  its own code version. The earlier meta's hand-written note stays; the commands and their
  code versions are the union of both."""
  fresh = {budget_run_key(run) for run in collected["runs"]}
  kept = [run for run in before["runs"] if budget_run_key(run) not in fresh]
  commands = list(before["meta"].get("commands", []))
  commands += [c for c in collected["meta"]["commands"] if c not in commands]
  dates = sorted({before["meta"].get("date"), collected["meta"].get("date")} - {None})
  note = {"note": before["meta"]["note"]} if "note" in before["meta"] else {}
  meta = {**collected["meta"], **note,
          **({"date": " and ".join(dates)} if dates else {}),
          "commands": commands,
          "code_versions": {**before["meta"].get("code_versions", {}),
                            **collected["meta"].get("code_versions", {})}}
  return {"meta": meta, "runs": kept + collected["runs"]}


def budget_task(runs: list[dict], batch_size: int) -> dict:
  """What a budget table measures: accuracy against samples seen, or for a language model
  (runs with tokens per sample) test loss against tokens seen, with its targets."""
  tokens = next((r["tokens_per_sample"] for r in runs if r.get("tokens_per_sample")), None)
  per_step = batch_size * runs[0]["num_devices"]
  if tokens:
    targets = tuple(sorted({r["target_loss"] for r in runs if r.get("target_loss")},
                           reverse=True))
    return {"value": "final_loss", "label": "test loss", "higher": False, "unit": "tokens",
            "per_step": per_step * tokens, "scale": 1e6, "suffix": "M", "digits": 2,
            "targets": targets}
  return {"value": "final_accuracy", "label": "test accuracy", "higher": True, "unit": "samples",
          "per_step": per_step, "scale": 1e3, "suffix": "k", "digits": 0,
          "targets": BUDGET_TARGETS}


def crossing(points: list[tuple[float, float]], target: float,
             higher: bool = True) -> tuple[str, float]:
  """Where values over amounts (samples or tokens, ascending) first reach `target` (at least,
  or with `higher=False` at most): ("<=", the first amount) if the first value is there already,
  ("=", the amount interpolated linearly between the points around the first crossing), or
  (">", the last amount) if none is."""
  points = sorted(points)
  sign = 1 if higher else -1
  if sign * points[0][1] >= sign * target:
    return "<=", points[0][0]
  for (s0, a0), (s1, a1) in zip(points, points[1:]):
    if sign * a1 >= sign * target:
      return "=", s0 + (target - a0) / (a1 - a0) * (s1 - s0)
  return ">", points[-1][0]


def amount_to(points: list[tuple[float, float]], target: float, higher: bool = True,
              scale: float = 1e3, suffix: str = "k", digits: int = 0) -> str:
  """The samples (or tokens) at which a method's mean final value over budgets reaches
  `target` (`crossing`), as the table shows it: "<= 60 k", "150 k", "> 180 k"."""
  how, amount = crossing(points, target, higher)
  shown = f"{amount / scale:.{digits}f} {suffix}"
  return shown if how == "=" else f"{how} {shown}"


def samples_to(points: list[tuple[float, float]], target: float) -> str:
  """`amount_to` of accuracy against samples, in thousands."""
  return amount_to(points, target)


def budget_methods(runs: list[dict]) -> list[tuple[str, str]]:
  """The runs' (algorithm, variant) pairs, in the page's order of methods."""
  return sorted({(r["algorithm"], r["variant"]) for r in runs},
                key=lambda m: (ORDER.index(m[0]) if m[0] in ORDER else len(ORDER), m[1]))


def budget_means(runs: list[dict], task: dict, method: tuple[str, str]) -> dict[int, list[float]]:
  """Per budget (steps), the final values of one (algorithm, variant)'s seeds."""
  out: dict[int, list[float]] = {}
  for r in runs:
    if (r["algorithm"], r["variant"]) == method and r.get(task["value"]) is not None:
      out.setdefault(r["num_steps"], []).append(r[task["value"]])
  return out


def budget_tables(name: str, budgets: dict, batch_size: int, figure: str | None) -> list[str]:
  runs = [r for r in budgets["runs"] if r["delay"] == 0]
  meta = budgets["meta"]
  task = budget_task(runs, batch_size)
  methods = budget_methods(runs)
  steps = sorted({r["num_steps"] for r in runs})
  seen = {n: n * task["per_step"] for n in steps}
  shown = lambda n: f"{seen[n] / task['scale']:.{task['digits']}f} {task['suffix']}"
  versions = sorted({r["code_version"] for r in runs if r["code_version"]}
                    | set(meta.get("code_versions", {}).values()) - {None})
  lines = [f"## {name}", "",
           (f"`{meta['config']}`, final {task['label']} after a whole schedule at each budget "
            f"(warm-up and cosine decay scaled with it); measured on {meta.get('date', '?')}, "
            f"{meta.get('machine', '?')}; code versions {', '.join(versions)}. Made by:"), ""]
  lines += [f"    {command}" for command in meta["commands"]]
  per_sample = (f" x {runs[0]['tokens_per_sample']} tokens" if task["unit"] == "tokens" else "")
  lines += ["", (f"Values are mean ± standard deviation over seeds; {task['unit']} seen = steps x "
                 f"{runs[0]['num_devices']} devices x {batch_size}{per_sample}. "
                 f"{task['unit'].capitalize()} to a target: where the mean final "
                 f"{task['label']} over budgets crosses it, interpolated linearly between the "
                 "budgets around the first crossing."), ""]
  header = ("| method | " + " | ".join(f"{n} steps ({shown(n)} {task['unit']})" for n in steps)
            + " | " + " | ".join(f"{task['unit']} to {t:g}" for t in task["targets"]) + " |")
  lines += [header, "|" + "---|" * (1 + len(steps) + len(task["targets"]))]
  for method in methods:
    algorithm, variant = method
    finals = budget_means(runs, task, method)
    cells = [f"{mean_std(finals[n])} ({len(finals[n])})" if n in finals else "-" for n in steps]
    points = [(seen[n], statistics.mean(finals[n])) for n in steps if n in finals]
    label = NAMES.get(algorithm, algorithm) + (f" `{variant}`" if variant else "")
    overrides = [o for o in meta.get("variants", {}).get(variant, [])
                 if not o.startswith(("num_epochs", "num_steps", "eval_every", "progress_bar"))]
    if overrides:
      label += " (" + ", ".join(f"`{o}`" for o in overrides) + ")"
    targets = [amount_to(points, t, task["higher"], task["scale"], task["suffix"],
                         task["digits"]) if len(points) == len(steps) else "-"
               for t in task["targets"]]
    lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(targets) + " |")
  if task["unit"] == "tokens":
    lines += loss_budget_claims(runs, task, steps, seen)
  if figure:
    lines += ["", f"![final {task['label']} against {task['unit']} seen]({figure})"]
  if meta.get("note"):  # how the runs were made and named, where a table cannot say it
    lines += ["", f"**Note**: {meta['note']}"]
  return lines


def loss_budget_claims(runs: list[dict], task: dict, steps: list[int],
                       seen: dict[int, float]) -> list[str]:
  """A language model's claim: at every budget LayUp's mean final test loss at most DDP's +
  `LOSS_MARGIN`, and its tokens to each target (interpolated) at most DDP's."""
  layup, ddp = (budget_means(runs, task, (a, "")) for a in ("layup", "ddp"))
  if not (layup and ddp):
    return []
  rows = []
  for n in steps:
    if n in layup and n in ddp:
      a, b = statistics.mean(layup[n]), statistics.mean(ddp[n])
      rows.append((f"{n} steps: LayUp's mean final test loss <= DDP's + {LOSS_MARGIN}",
                   f"{a:.4f} vs {b:.4f} ({len(layup[n])} and {len(ddp[n])} seeds)",
                   "holds" if a <= b + LOSS_MARGIN else "does not hold"))
  for target in task["targets"]:
    crossings = []
    for finals in (layup, ddp):
      points = sorted((seen[n], statistics.mean(v)) for n, v in finals.items())
      how, amount = crossing(points, target, higher=False)
      crossings.append(None if how == ">" else amount)
    a, b = crossings
    show = lambda x: "not reached" if x is None else f"{x / 1e6:.2f} M"
    holds = a is not None and (b is None or a <= b)
    rows.append((f"LayUp's tokens to test loss {target:g} <= DDP's", f"{show(a)} vs {show(b)}",
                 "holds" if holds else "does not hold"))
  return ["", "| claim | measured | verdict |", "|---|---|---|",
          *[f"| {claim} | {measured} | {result} |" for claim, measured, result in rows]]


def draw_budget_figure(name: str, budgets: dict, batch_size: int, out_dir: pathlib.Path,
                       link_dir: str) -> str:
  """Final value against samples (tokens) seen, a point per budget; for a language model beside
  it each method's test loss against tokens seen during its runs (mean over seeds, every
  budget)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = [r for r in budgets["runs"] if r["delay"] == 0]
  task = budget_task(runs, batch_size)
  curves = task["unit"] == "tokens"
  fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(11 if curves else 6, 4))
  finals_axis = axes[0] if curves else axes
  methods = budget_methods(runs)
  for index, method in enumerate(methods):
    color = f"C{index}"
    finals = budget_means(runs, task, method)
    xs = [n * task["per_step"] / task["scale"] for n in sorted(finals)]
    ys = [statistics.mean(finals[n]) for n in sorted(finals)]
    es = [statistics.stdev(finals[n]) if len(finals[n]) > 1 else 0.0 for n in sorted(finals)]
    label = NAMES.get(method[0], method[0]) + (f" {method[1]}" if method[1] else "")
    finals_axis.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label, color=color)
    if curves:
      for n in sorted(finals):
        group = [r for r in runs if (r["algorithm"], r["variant"], r["num_steps"]) ==
                 (*method, n)]
        by_step: dict[int, list[float]] = {}
        for run in group:
          for step, loss, _ in run["curve"]:
            if loss is not None:
              by_step.setdefault(step, []).append(loss)
        shared = sorted(s for s, v in by_step.items() if len(v) == len(group) and s > 0)
        axes[1].plot([s * task["per_step"] / task["scale"] for s in shared],
                     [statistics.mean(by_step[s]) for s in shared], color=color,
                     linewidth=1.2 if n == max(finals) else 0.6,
                     label=label if n == max(finals) else None)
  for target in task["targets"]:
    for axis in axes if curves else [axes]:
      axis.axhline(target, color="grey", linewidth=0.5, linestyle="--")
  finals_axis.set_xlabel(f"{task['unit']} seen ({'millions' if curves else 'thousands'})")
  finals_axis.set_ylabel(f"final {task['label']}")
  finals_axis.set_title(f"{name}: final {task['label']} per budget", fontsize=9)
  finals_axis.legend(fontsize=7)
  if curves:
    axes[1].set(xlabel="tokens seen (millions)", ylabel="test loss (nats per token)")
    axes[1].set_title("during each run (mean over seeds; thick: the largest budget)", fontsize=9)
    low = min(statistics.mean(v) for m in methods for v in budget_means(runs, task, m).values())
    axes[1].set_ylim(low - 0.1, low + 1.2)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = "tokens_to_loss" if curves else "samples_to_accuracy"
  path = out_dir / f"{name}_{stem}.png"
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return f"{link_dir}/{path.name}"


# --- numbers --------------------------------------------------------------------------------

def mean_std(values, digits: int = 4) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.{digits}g}"
  return f"{statistics.mean(values):.{digits}g} ± {statistics.stdev(values):.2g}"


def metric_key(runs: list[dict]) -> tuple[str, bool]:
  """("loss", False) for language models (test loss, nats per token), else ("accuracy",
  True): key, higher better."""
  language_model = any("final_eval_perplexity" in r["summary"] for r in runs)
  return ("loss", False) if language_model else ("accuracy", True)


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


def best_value(run: dict, key: str) -> float | None:
  """The run's best test value of `key`: its summary's, else (a summary written before it had
  one, as a language model's best loss) from its test records."""
  best = run["summary"].get(f"best_eval_{key}")
  values = [r[key] for r in test_records(run) if r.get(key) is not None]
  if best is None and values:
    best = max(values) if key == "accuracy" else min(values)
  return best


def test_records(run: dict) -> list[dict]:
  return [r for r in run["records"] if r["split"] == "test"]


# --- tables ---------------------------------------------------------------------------------

STRAGGLER_TITLES = {
    "host": "Straggler: device 0 idles {d:g} iterations' time before each iteration",
    "device": ("Straggler on the device: device 0 runs a delay program of {d:g} iterations' "
               "time per iteration (its host thread goes on dispatching)"),
}


def conditions(runs: list[dict]) -> list[tuple[str, float]]:
  """(straggler mode, delay) of the runs: no straggler first, then host-side, then device-side."""
  found = {(r["mode"] if r["delay"] else "host", r["delay"]) for r in runs}
  return sorted(found, key=lambda c: (c[1] > 0, list(STRAGGLER_TITLES).index(c[0]), c[1]))


def in_condition(run: dict, mode: str, delay: float) -> bool:
  return run["delay"] == delay and (delay == 0 or run["mode"] == mode)


def result_row(label: str, group: list[dict], key: str) -> str:
  """A table row: final and best metric, times, samples/s, MFU, update latency."""
  s = [r["summary"] for r in group]
  mfu = [x.get("mfu") for x in s]
  return (f"| {label} | {mean_std([x[f'final_eval_{key}'] for x in s])} | "
          f"{mean_std([best_value(r, key) for r in group])} | "
          f"{mean_std([x['wall_time_s'] for x in s])} | "
          f"{mean_std([x.get('time_to_target_s') for x in s])} | "
          f"{mean_std([x.get('time_to_convergence_s') for x in s])} | "
          f"{statistics.median(x['train_samples_per_s'] for x in s):.0f} | "
          f"{mean_std([100 * m for m in mfu if m is not None], 3) + '%' if any(mfu) else '-'}"
          f" | {mean_std([mean_latency_ms(r) for r in group], 3)} |")


def sweep_tables(name: str, sweep: dict, figures: dict[str, str]) -> list[str]:
  meta, every_run = sweep["meta"], sweep["runs"]
  runs = [r for r in every_run if not r["variant"]]  # the config's own runs, not ablations
  key, higher = metric_key(every_run)
  label = "accuracy" if higher else "loss"
  algorithms = [a for a in ORDER if any(r["algorithm"] == a for r in runs)]
  first = every_run[0]["summary"]
  seeds = sorted({r["seed"] for r in every_run})
  versions = sorted({r["summary"].get("code_version") or "not recorded" for r in every_run})
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
  if meta.get("note"):  # what the sweep's runs shared the machine with, and the like
    lines += ["", f"**Note**: {meta['note']}"]
  if stopped_at_target(runs):
    target = first.get(f"target_{key}")
    lines += ["", (f"Runs end at their first evaluation reaching the target ({key} {target}, "
                   "`metrics.stop_at_target`): there, *final* is the value at that evaluation "
                   "and the training time is the time to the target; a run that never reaches "
                   "it trains its whole schedule.")]
  if data_note:
    lines += ["", data_note]
  if not meta.get("mock_tfds"):  # random labels: nothing to claim
    lines += claims_table(runs, key, higher)
  base = {a: statistics.median(others_throughput(r) for r in runs
                               if r["algorithm"] == a and r["delay"] == 0)
          for a in algorithms if any(r["algorithm"] == a and r["delay"] == 0 for r in runs)}
  for mode, delay in conditions(runs):
    title = "No straggler" if delay == 0 else STRAGGLER_TITLES[mode].format(d=delay)
    header = (f"| method | final {label} | best {label} | training time (s) | time to target (s)"
              " | time to convergence (s) | samples/s | MFU | update latency (ms) |")
    rule = "|---|---|---|---|---|---|---|---|---|"
    if delay:
      header += " other devices' throughput vs no delay |"
      rule += "---|"
    lines += ["", f"### {title}", "", header, rule]
    for algorithm in algorithms:
      group = [r for r in runs if r["algorithm"] == algorithm and in_condition(r, mode, delay)]
      if not group:
        continue
      line = result_row(NAMES[algorithm], group, key)
      if delay:
        ratio = statistics.median(others_throughput(r) for r in group) / base[algorithm] \
            if algorithm in base else None
        line += f" {ratio:.2f} |" if ratio is not None else " - |"
      lines.append(line)
  lines += consensus_tables(runs)
  lines += ablation_table(every_run, meta, key, label)
  if figures:
    lines += ["", "### Figures", ""]
    lines += [f"![{caption}]({path})" + "\n" for caption, path in figures.items()]
  return lines


def consensus_tables(runs: list[dict]) -> list[str]:
  """The gossip methods' consensus distance at the middle and the end, and every method's
  whose distance is not zero at every evaluation (no straggler; means over seeds)."""
  lines = []
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
  curves = {}
  for algorithm in ORDER:
    group = [r for r in runs if r["algorithm"] == algorithm and r["delay"] == 0]
    if group:
      steps, _, values = mean_curve(group, "consensus_distance")
      if any(values):
        curves[algorithm] = dict(zip(steps, values))
  if curves:
    steps = sorted(set().union(*curves.values()))
    lines += ["", ("At every evaluation (means over seeds; columns are steps; DDP's replicas "
                   "are one model, so it is left out):"), "",
              "| method | " + " | ".join(str(s) for s in steps) + " |",
              "|---|" + "---|" * len(steps)]
    for algorithm, curve in curves.items():
      lines.append(f"| {NAMES[algorithm]} | " + " | ".join(
          f"{curve[s]:.2e}" if s in curve else "-" for s in steps) + " |")
  return lines


def ablation_table(runs: list[dict], meta: dict, key: str, label: str) -> list[str]:
  """Each variant (`scripts/sweep.py --variant`) beside the config's own runs of its method;
  per method, the variant with the best mean final metric is marked (a search's pick)."""
  variants = sorted({(r["algorithm"], r["variant"]) for r in runs if r["variant"]})
  if not variants:
    return []
  search = not any(not r["variant"] for r in runs)  # variants only: a search
  lines = ["", "### Search (no straggler)" if search else "### Ablations (no straggler)", "",
           ("Each row is the config with the overrides shown; in bold each method's best "
            "final value, the setting a search picks." if search else
            "Each variant is the config with the overrides shown, the same seeds; the first row "
            "of each method is the config as it is."), "",
           (f"| variant | final {label} | best {label} | training time (s) | time to target (s) "
            "| time to convergence (s) | samples/s | MFU | update latency (ms) | consensus "
            "distance at the end |"), "|---|---|---|---|---|---|---|---|---|---|"]
  higher = label == "accuracy"
  for algorithm in ORDER:
    mine = [v for a, v in variants if a == algorithm]
    if not mine:
      continue

    def final(variant, algorithm=algorithm):
      values = [r["summary"][f"final_eval_{key}"] for r in runs if r["algorithm"] == algorithm
                and r["variant"] == variant and r["delay"] == 0]
      return statistics.mean(values) if values else None

    scored = [(score, v) for v in mine if (score := final(v)) is not None]
    best = (max(scored) if higher else min(scored))[1] if len(scored) > 1 else None
    for variant in ["", *mine]:
      group = [r for r in runs if r["algorithm"] == algorithm and r["variant"] == variant
               and r["delay"] == 0]
      if not group:
        continue
      overrides = ", ".join(f"`{o}`" for o in meta.get("variants", {}).get(variant, []))
      name = f"{NAMES[algorithm]} {variant} ({overrides})" if variant else (
          f"{NAMES[algorithm]} (config)")
      if variant == best:
        name = f"**{name}, best**"
      lines.append(result_row(name, group, key) + " " + mean_std(
          [r["summary"].get("consensus_distance") for r in group], 3) + " |")
  return lines


def stopped_at_target(runs: list[dict]) -> bool:
  """Whether any of the runs ended at its first evaluation reaching the target
  (`metrics.stop_at_target`): its last accuracy and training time are those of that point."""
  return any(r["summary"].get("stopped_at_target") for r in runs)


def verdict(difference: float, noise: float, better_if_positive: bool = True) -> str:
  """'holds' when the difference is in the claimed direction by more than the noise, 'does not
  hold' when against it by more, else 'within noise'."""
  signed = difference if better_if_positive else -difference
  if abs(difference) <= noise:
    return "within noise"
  return "holds" if signed > 0 else "does not hold"


def claims_table(runs: list[dict], key: str, higher: bool) -> list[str]:
  """The paper's claims, checked on these runs (each row: what was compared and the verdict).

  Noise is the larger of the two methods' standard deviations over seeds; with one seed of
  either there is no estimate of it (0), and the verdict says "(one seed)". A claim holds when
  the difference is in the paper's direction by more than the noise."""
  def group(algorithm, mode="host", delay=0.0):
    return [r for r in runs if r["algorithm"] == algorithm and in_condition(r, mode, delay)]

  def values(rs, field):
    return [r["summary"][field] for r in rs if r["summary"].get(field) is not None]

  def spread(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0

  def one_seed(a, b):
    return " (one seed)" if min(len(a), len(b)) < 2 else ""

  layup, ddp, gosgd = group("layup"), group("ddp"), group("gosgd")
  if not (layup and ddp):
    return []
  rows = []
  if not stopped_at_target(layup + ddp):  # a run ended at the target has no final accuracy
    a, b = values(layup, f"final_eval_{key}"), values(ddp, f"final_eval_{key}")
    diff = statistics.mean(a) - statistics.mean(b)
    measured = (f"{statistics.mean(a):.4f} vs {statistics.mean(b):.4f} ({len(a)} and {len(b)} "
                "seeds)")
    rows.append((f"LayUp's final test {key} {'>=' if higher else '<='} DDP's", measured,
                 verdict(diff, max(spread(a), spread(b)), higher) + one_seed(a, b)))
  a, b = values(layup, "time_to_target_s"), values(ddp, "time_to_target_s")
  if a and b:
    diff = statistics.mean(b) - statistics.mean(a)
    measured = (f"{statistics.mean(a):.3g} s vs {statistics.mean(b):.3g} s (seeds reaching "
                f"it: {len(a)}/{len(layup)}, {len(b)}/{len(ddp)})")
    rows.append(("LayUp reaches the target sooner than DDP (training time)", measured,
                 verdict(diff, max(spread(a), spread(b))) + one_seed(a, b)))
  if gosgd:
    mine, theirs = (dict(zip(*[mean_curve(g, "consensus_distance")[i] for i in (0, 2)]))
                    for g in (layup, gosgd))
    shared = sorted(set(mine) & set(theirs) - {0})
    if shared:
      lower = sum(mine[s] < theirs[s] for s in shared)
      claim = ("Layer-wise updates reduce drift: LayUp's consensus distance below GoSGD's at "
               "equal steps")
      measured = (f"lower at {lower} of {len(shared)} evaluations; at the end "
                  f"{mine[shared[-1]]:.2e} vs {theirs[shared[-1]]:.2e}")
      rows.append((claim, measured, "holds" if lower == len(shared) else
                   "does not hold" if lower == 0 else "mixed"))
  for mode in STRAGGLER_TITLES:
    delays = sorted({r["delay"] for r in runs if r["delay"] and r["mode"] == mode})
    for delay in delays:  # the paper's Figure 3: time to the target under a straggler
      mine, theirs = group("layup", mode, delay), group("ddp", mode, delay)
      a, b = values(mine, "time_to_target_s"), values(theirs, "time_to_target_s")
      if not (mine and theirs) or not (a or b):
        continue
      mean = lambda xs: f"{statistics.mean(xs):.3g} s" if xs else "not reached"
      runs_were = ("runs ending at the target or at the schedule's end"
                   if stopped_at_target(mine + theirs) else "in runs of the same steps")
      measured = (f"LayUp {mean(a)} vs DDP {mean(b)} (seeds reaching it: {len(a)}/{len(mine)}, "
                  f"{len(b)}/{len(theirs)}, {runs_were})")
      if a and b:
        result = verdict(statistics.mean(b) - statistics.mean(a),
                         max(spread(a), spread(b))) + one_seed(a, b)
      else:  # one of the two never reached it within its run
        result = "holds" if a else "does not hold"
      claim = (f"Under a delay-{delay:g} straggler ({mode}-side) LayUp reaches the target "
               "sooner than DDP")
      rows.append((claim, measured, result))
    if not delays:
      continue
    worst = delays[-1]
    ratios = {}
    for algorithm in ("layup", "ddp"):
      base, slow = group(algorithm), group(algorithm, mode, worst)
      if base and slow:
        ratios[algorithm] = (statistics.median(others_throughput(r) for r in slow)
                             / statistics.median(others_throughput(r) for r in base))
    if len(ratios) == 2:
      claim = (f"Straggler robustness ({mode}-side, delay {worst:g}): the other devices keep "
               "their throughput under LayUp, not under DDP")
      measured = (f"other devices' throughput vs no delay: LayUp {ratios['layup']:.2f}, DDP "
                  f"{ratios['ddp']:.2f} (DDP's bound 1/(1+delay) = {1 / (1 + worst):.2f})")
      rows.append((claim, measured, verdict(ratios["layup"] - ratios["ddp"], 0.05)))
  lines = ["", "### The paper's claims here", "",
           ("Measured on these runs, nothing tuned to make a claim hold. A claim holds when the "
            "difference is in the paper's direction by more than the noise (the larger standard "
            "deviation over seeds of the two methods; 0.05 for throughput ratios), does not hold "
            "when it is against it by more, else it is within noise."), "",
           "| claim | measured | verdict |", "|---|---|---|"]
  lines += [f"| {claim} | {measured} | {result} |" for claim, measured, result in rows]
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

  runs = [r for r in sweep["runs"] if not r["variant"]]
  if not runs:  # only variants (a search): their table says it all
    return {}
  key, _ = metric_key(runs)
  algorithms = [a for a in ORDER if any(r["algorithm"] == a for r in runs)]
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

  for mode in STRAGGLER_TITLES:
    delays = sorted({d for m, d in conditions(runs) if m == mode or d == 0})
    if len(delays) < 2:
      continue
    fig, (quality, duration) = plt.subplots(1, 2, figsize=(11, 4))
    for algorithm in algorithms:
      points = [(d, [r["summary"] for r in runs if r["algorithm"] == algorithm
                     and in_condition(r, mode, d)]) for d in delays]
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
    fig.suptitle(f"straggler on the {mode}", fontsize=10)
    save(fig, "straggler" if mode == "host" else f"straggler_{mode}",
         f"{name}: final test {key} and training time against the straggler delay, "
         f"{mode}-side (paper Figure 3)")

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
    lines += ["", "### Threads and gossip (`scripts/bench_host.py runtime`)", "",
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
    lines += ["", ("### How far a compute thread dispatches ahead (`scripts/bench_host.py "
              "runtime --ahead`)"), "",
              (f"Digits, {bench['args']['num_devices']} devices, `tuning.max_dispatch_ahead` = "
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
    lines += ["", ("### The push-sum average under threads (the probe `scripts/bench_pushsum.py`, "
              "removed after 0475d86; tests/test_runtime.py holds the invariant)"), "",
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
           "here; see [scripts/README.md](../scripts/README.md) for the commands.")] + lines) if lines else []


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
            f"{runs.get('before', {}).get('code') or '-'}). Measured "
            f"{runs['after'].get('measured', '-')}, code {runs['after'].get('code', '-')}"
            + (f" ({runs['after']['note']})" if runs["after"].get("note") else "") + "."), "",
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


def bench_stamp(bench: dict) -> str:
  """When, where and at which code a bench's JSON was measured, with its note if it has one."""
  note = bench.get("code_version_note")
  return f"{bench['measured']}, code {bench['code']}" + (f" ({note})" if note else "")


def churn_tables(results: pathlib.Path) -> list[str]:
  """The churn drills (`scripts/drill_process_loss.py churn --out docs/results/churn_*.json`):
  per drill, processes killed and started again through a whole run against the same run
  without failures: the kills, how soon a kill was declared and a restart trained again, the
  samples per second kept, the final accuracy beside the failure-free run's, the weight sums,
  and whether every process ended in the final average."""
  paths = sorted(results.glob("churn_*.json"))
  if not paths:
    return []
  lines = ["", "## Churn", "",
           "Processes of one run killed (SIGKILL) at exponential intervals and started again "
           "with the same command (LayUp: each rejoins the running run; DDP: the launcher's "
           "command reruns from the last checkpoint), against the same run without failures "
           "(`python scripts/drill_process_loss.py churn`; docs/guide/elastic.md).", "",
           "| drill | measured | run | algorithm | MTBF s | kills | kill to declared p50 / p95 s "
           "| restart to contributing p50 / p95 s | samples/s kept | final accuracy "
           "(without failures) | weight sums' largest distance from 1 | devices in the final "
           "average |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for path in paths:
    drill = json.loads(path.read_text())
    args, summary = drill["args"], drill["summary"]
    declared, contributing = summary["kill_to_declared_s"], summary["restart_to_contributing_s"]
    devices = args["processes"] * args["devices_per_process"]
    uninterrupted = summary.get("uninterrupted_accuracy")
    off = max(abs(sum_ - 1) for sum_ in summary["weight_sums"])
    run = (f"{args['config']}, {args['num_steps']} steps, {args['processes']} processes x "
           f"{args['devices_per_process']} devices{''.join(f', {o}' for o in args['set'])}")
    lines.append(
        f"| {path.stem.removeprefix('churn_')} | {bench_stamp(drill)} | {run} | "
        f"{args['algorithm']} | "
        f"{args['mtbf_s']:g} | {summary['kills']} | {declared.get('p50')} / {declared.get('p95')}"
        f" | {contributing.get('p50')} / {contributing.get('p95')} | "
        f"{summary['samples_per_s_kept']} | {summary['final_accuracy']:.4f} ("
        f"{'-' if uninterrupted is None else f'{uninterrupted:.4f}'}) | "
        f"{off:.0e} | {summary['final_devices_in_average']} of "
        f"{devices} |")
  return lines


def several_hosts_tables(results: pathlib.Path) -> list[str]:
  """The section "Several hosts" from `scripts/bench_cluster.py`'s JSON: `hosts_digits.json`
  (every algorithm, each layout and link rate) and `hosts_fashion_mnist.json` (time to target
  on one layout and rate, several seeds), when they exist."""
  lines = []
  path = results / "hosts_digits.json"
  bench = json.loads(path.read_text()) if path.exists() else {"table": None}
  if bench["table"] is not None:  # None: no bench, or one still running
    args, table = bench["args"], bench["table"]
    lines += ["", "### Every algorithm across hosts (digits)", "",
              (f"`sudo python scripts/bench_cluster.py --algorithms {' '.join(args['algorithms'])} "
               f"--layouts {' '.join(args['layouts'])} --rates {' '.join(args['rates'])} "
               f"--repeats {args['repeats']}`: {args['num_steps']} steps, evaluation every "
               f"{args['eval_every']}; medians of {args['repeats']} alternated repeat(s); "
               f"{bench_stamp(bench)}. Each cell: training seconds / final "
               "accuracy. Bytes per device-iteration: counted by the run between processes "
               "(layup_jax/multiprocess/traffic.py) and carried by the links, at the last rate listed."
               + (f" Stopped (Ctrl-C) after {len(bench['runs'])} runs: `-` marks a run not made."
                  if bench.get("stopped") else ""))]
    for layout in args["layouts"]:
      rates = args["rates"]
      lines += ["", f"**{layout}** (hosts x devices per host)", "",
                "| algorithm | " + " | ".join(rates) + " | counted kB/it | link kB/it |",
                "|---" * (len(rates) + 3) + "|"]
      for case in dict.fromkeys(t["case"] for t in table):
        cells, counted, link = [], None, None
        for rate in rates:
          row = next((t for t in table if (t["case"], t["layout"], t["rate"]) ==
                      (case, layout, rate)), None)
          if row is None or row["training_s"] is None:  # not run, or failed
            cells.append("failed" if row else "-")
            continue
          cells.append(f"{row['training_s']:.1f} / {row['final_accuracy']:.4f}")
          counted = row["counted_bytes_per_iteration"]
          link = row["link_bytes_per_iteration"]
        name = case_name(case)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | "
                     f"{'-' if counted is None else f'{counted / 1e3:.1f}'} | "
                     f"{'-' if link is None else f'{link / 1e3:.1f}'} |")
  for name, task in (("fashion_mnist", "Fashion-MNIST"), ("stdlib_gpt2_mini", "language model")):
    path = results / f"hosts_{name}.json"
    if path.exists():
      lines += hosts_target_section(json.loads(path.read_text()), task)
  if not lines:
    return []
  return (["", "## Several hosts", "",
           ("Each host is a network namespace on this machine (`scripts/cluster_drill.sh`): one "
            "process per host with its devices, the hosts' links shaped with the kernel's token "
            "bucket at the rate given in both directions (docs/records/multihost.md, \"Gossip on a slow "
            "link\").")] + lines)


def hosts_target_section(bench: dict, task: str) -> list[str]:
  """A `scripts/bench_cluster.py` run of several seeds to a target (Fashion-MNIST's accuracy, or
  the language model's test loss): the time to it per method, mean over seeds, and the claim."""
  lines = []
  key = "loss" if task == "language model" else "accuracy"
  args = bench["args"]
  runs = [r for r in bench["runs"] if "failed" not in r]
  failed = len(bench["runs"]) - len(runs)
  seeds = sorted({r["seed"] for r in runs})
  missing = [str(s) for s in args["seeds"] if s not in seeds]
  target = next((o.split("=", 1)[1] for o in args["set"]
                 if o.startswith(f"metrics.target_{key}=")), "the config's target")
  lines += ["", f"### Time to target across hosts ({task})", "",
            (f"`sudo python scripts/bench_cluster.py --config {args['config']} --num-steps "
             f"{args['num_steps']} --eval-every {args['eval_every']} --algorithms "
             f"{' '.join(args['algorithms'])} --layouts {' '.join(args['layouts'])} --rates "
             f"{' '.join(args['rates'])} --seeds {' '.join(map(str, args['seeds']))}"
             + "".join(f' --variant "{v}"' for v in args.get("variant", []))
             + "".join(f" --set {o}" for o in args["set"]) + "`: the config's schedule, "
             f"each method with its own searched lr and warm-up (its column), seeds "
             f"{', '.join(map(str, seeds))}; time to test {key} {target} "
             "(training time, evaluation excluded; every evaluation counted, nothing "
             f"interpolated); mean ± std over seeds; {bench_stamp(bench)}."
             + (f" Stopped (Ctrl-C) after {len(bench['runs'])} runs"
                + (f"; no finished run for seed(s) {', '.join(missing)}" if missing else "") + "."
                if bench.get("stopped") else "")
             + (f" {failed} run(s) failed and are left out." if failed else "")), "",
            (f"| algorithm | layout | link | time to target s | reached | final {key} | "
             "samples/s | counted kB/it |"), "|---|---|---|---|---|---|---|---|"]
  groups: dict[tuple, list[dict]] = {}
  for run in runs:
    groups.setdefault((run["case"], run["layout"], run["rate"]), []).append(run)
  for (case, layout, rate), group in groups.items():
    reached = [r["time_to_target_s"] for r in group if r["time_to_target_s"] is not None]
    counted = [r["counted_bytes_per_iteration"] for r in group
               if r["counted_bytes_per_iteration"] is not None]
    lines.append(
        f"| {case_name(case)} | {layout} | {rate} | {mean_std(reached, 3)} | "
        f"{len(reached)}/{len(group)} | {mean_std([r.get(f'final_{key}') for r in group])} | "
        f"{mean_std([r['samples_per_s'] for r in group], 4)} | "
        f"{mean_std([c / 1e3 for c in counted], 3)} |")
  failed_only: dict[tuple, list[dict]] = {}  # a method none of whose runs finished keeps its row
  for run in bench["runs"]:
    where = (run.get("case"), run.get("layout"), run.get("rate"))
    if "failed" in run and where not in groups:
      failed_only.setdefault(where, []).append(run)
  for (case, layout, rate), group in failed_only.items():
    lines.append(f"| {case_name(case)} | {layout} | {rate} | failed: {group[0]['failed']} | "
                 f"0/{len(group)} | - | - | - |")
  lines += hosts_claim(groups) if key == "accuracy" else hosts_loss_claim(groups)
  return lines


def case_name(case: str) -> str:
  """A bench_cluster case as the tables name it: "LayUp", or "LayUp (int8)" for the variant
  `layup:int8` (`--variant "int8 ..."`, run beside the plain algorithm)."""
  algorithm, _, variant = case.partition(":")
  name = NAMES.get(algorithm, algorithm)
  return f"{name} ({variant})" if variant else name


def hosts_claim(groups: dict[tuple, list[dict]]) -> list[str]:
  """The claim row, for LayUp and each LayUp variant run: across hosts LayUp's mean time to
  target is at most 0.6 of DDP's and at most DiLoCo's (where DiLoCo ran on the same layout and
  link), with its mean final accuracy at least DDP's - 0.003, every seed of each reaching the
  target: LayUp first across hosts, at DDP's accuracy."""
  rows = []
  for (case, layout, rate), layup in groups.items():
    ddp = groups.get(("ddp", layout, rate))
    if case.partition(":")[0] != "layup" or not ddp:
      continue
    diloco = groups.get(("diloco", layout, rate), [])
    times = [[r["time_to_target_s"] for r in g] for g in (layup, ddp, diloco)]
    accuracy = [statistics.mean(r["final_accuracy"] for r in g) for g in (layup, ddp)]
    ratio, versus = None, "-"
    if any(t is None for ts in times for t in ts):
      holds = "does not hold (a seed did not reach the target)"
    else:
      layup_s, ddp_s, diloco_s = (statistics.mean(ts) if ts else None for ts in times)
      ratio = layup_s / ddp_s
      first = diloco_s is None or layup_s <= diloco_s
      holds = ("holds" if ratio <= 0.6 and first and accuracy[0] >= accuracy[1] - 0.003
               else "does not hold")
      versus = "-" if diloco_s is None else f"{diloco_s:.1f} s"
    rows.append(f"| across hosts ({layout}, {rate} links) {case_name(case)} reaches the target "
                f"first (time <= 0.6x DDP's and <= DiLoCo's, accuracy >= DDP's - 0.003) | "
                f"{'-' if ratio is None else f'{ratio:.3f}'} | {versus} | {accuracy[0]:.4f} vs "
                f"{accuracy[1]:.4f} | {holds} |")
  if not rows:
    return []
  return ["", ("| claim | LayUp / DDP time to target (means) | DiLoCo's time to target (mean) | "
               "final accuracy (means) | verdict |"),
          "|---|---|---|---|---|", *rows]


def hosts_loss_claim(groups: dict[tuple, list[dict]]) -> list[str]:
  """The language model's claim across hosts: LayUp's mean time to the target loss at most 0.6
  of DDP's, every seed of both reaching it; DiLoCo's beside, and whichever of the three is
  first, as it is."""
  rows = []
  for (case, layout, rate), layup in groups.items():
    ddp = groups.get(("ddp", layout, rate))
    if case.partition(":")[0] != "layup" or not ddp:
      continue
    times = {name: [r["time_to_target_s"] for r in group] for name, group in (
        (case_name(case), layup), ("DDP", ddp), ("DiLoCo", groups.get(("diloco", layout, rate))
                                                  or []))}
    if any(t is None for ts in list(times.values())[:2] for t in ts):
      rows.append(f"| across hosts ({layout}, {rate} links) {case_name(case)}'s time to the "
                  "target loss <= 0.6x DDP's | - | - | - | does not hold (a seed did not reach "
                  "the target) |")
      continue
    means = {name: statistics.mean(ts) for name, ts in times.items()
             if ts and all(t is not None for t in ts)}
    ratio = means[case_name(case)] / means["DDP"]
    first = min(means, key=means.get)
    diloco = f"{means['DiLoCo']:.1f} s" if "DiLoCo" in means else "-"
    rows.append(f"| across hosts ({layout}, {rate} links) {case_name(case)}'s time to the target "
                f"loss <= 0.6x DDP's | {ratio:.3f} | {diloco} | {first} | "
                f"{'holds' if ratio <= 0.6 else 'does not hold'} |")
  if not rows:
    return []
  return ["", ("| claim | LayUp / DDP time to target (means) | DiLoCo's time to target (mean) | "
               "first to the target | verdict |"), "|---|---|---|---|---|", *rows]


# Sections in this order (real data first), then any other sweep by name.
PAGE_ORDER = ("fashion_mnist", "fashion_mnist_stragglers", "fashion_mnist_ablations",
              "fashion_mnist_search", "digits")


def render(sweeps: dict[str, dict], results: pathlib.Path, out: pathlib.Path,
           budgets: dict[str, dict] | None = None) -> str:
  budgets = budgets or {}
  hosts, churn = several_hosts_tables(results), churn_tables(results)
  lines = ["# Results", "",
           ("Regenerated by `python scripts/report.py` from `docs/results/` (do not edit by "
            "hand); `bash scripts/reproduce_results.sh` reruns every sweep and benchmark first."),
           "", "Sections: " + ", ".join(f"[{name}](#{name})" for name in [*budgets, *sweeps])
           + (", [Several hosts](#several-hosts)" if hosts else "")
           + (", [Churn](#churn)" if churn else "")
           + ", [Benchmarks](#benchmarks)."]
  link_dir = str((results / "figures").relative_to(out.parent)) if results.is_relative_to(
      out.parent) else str(results / "figures")
  for name, budget in budgets.items():
    batch_size = budget["meta"].get("batch_size", 32)
    figure = draw_budget_figure(name, budget, batch_size, results / "figures", link_dir)
    lines += [""] + budget_tables(name, budget, batch_size, figure)
  for name, sweep in sweeps.items():
    for run in sweep["runs"]:  # sweeps collected before variants and device-side stragglers
      run.setdefault("variant", "")
      run.setdefault("mode", "host")
    figures = draw_figures(name, sweep, results / "figures", link_dir)
    lines += [""] + sweep_tables(name, sweep, figures)
  lines += hosts
  lines += churn
  lines += benchmark_tables(results)
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sweep", action="append", default=[], metavar="NAME=WORKDIR",
                      help="collect a sweep workdir under NAME (repeatable)")
  parser.add_argument("--budgets", action="append", default=[],
                      metavar="NAME=WORKDIR,WORKDIR,...",
                      help="collect one sweep per training budget under NAME (repeatable)")
  parser.add_argument("--batch-size", type=int, default=32,
                      help="with --budgets: samples per device per step, where the runs' "
                           "summaries do not say it")
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
  for item in args.budgets:
    name, sep, workdirs = item.partition("=")
    if not sep:
      sys.exit(f"error: --budgets takes NAME=WORKDIR,WORKDIR,..., got {item!r}")
    collected = collect_budgets([pathlib.Path(w) for w in workdirs.split(",")])
    path = results / f"budgets_{name}.json"
    if path.exists():  # the runs collected before whose workdirs are gone stay on the page
      collected = merge_budgets(json.loads(path.read_text()), collected)
    first = collected["runs"][0]  # the runs' own batch, where their summaries say it
    collected["meta"]["batch_size"] = (first["samples_per_step"] // first["num_devices"]
                                       if first.get("samples_per_step") else args.batch_size)
    path.write_text(json.dumps(collected, indent=1))
  budgets = {path.stem.removeprefix("budgets_"): json.loads(path.read_text())
             for path in sorted(results.glob("budgets_*.json"))}
  names = sorted(path.stem.removeprefix("sweep_") for path in results.glob("sweep_*.json"))
  names.sort(key=lambda n: PAGE_ORDER.index(n) if n in PAGE_ORDER else len(PAGE_ORDER))
  sweeps = {name: json.loads((results / f"sweep_{name}.json").read_text()) for name in names}
  out.write_text(render(sweeps, results, out, budgets))
  print(f"wrote {out} ({len(sweeps)} sweeps, figures in {results / 'figures'})")


if __name__ == "__main__":
  main()
