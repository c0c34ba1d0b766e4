"""Runs algorithms x seeds x straggler delays from one config, one workdir per run.

    python scripts/sweep.py --config configs/digits.py --workdir runs/sweeps/digits \\
        --algorithms layup ddp gosgd --seeds 0 1 2 --delays 0 1 2 4 \\
        --set num_epochs=20 --set eval_every=10 --set metrics.target_accuracy=0.95

Each run is `layup_jax.run.runner.run` (the same code as `python -m layup_jax.train`) in this
process, one after another, in `WORKDIR/delay<d>/<algorithm>-seed<s>` (`metrics.jsonl`,
`summary.json`); a straggler delay d idles device 0 for d iterations' time before each of its
iterations (`straggler.device=0`, `straggler.delay_iters=d`). A run whose `summary.json`
exists is skipped, so an interrupted sweep continues where it stopped, and sweeps with other
algorithms, seeds or delays can add runs to the same workdir. `WORKDIR/sweep.json` records the
commands, the machine and the date; `scripts/report.py` turns the workdir into tables and
figures. Checkpoints are off (saves stay out of the timings) and a persistent compilation
cache keeps repeated compilations out of the start-up. Like `python -m layup_jax.train`, the
sweep starts itself again under TCMalloc or jemalloc when one is installed (`host_allocator`,
which `--set tuning.host_allocator=system` turns off; each run's `summary.json` says which ran).

`--straggler-mode device` delays device 0's *device* instead (a delay program per iteration while
its host thread goes on, `straggler.mode=device`): those runs go to `delay<d>-device`. An
ablation is a `--variant LABEL` with its `--set` overrides: its runs go to
`<algorithm>@LABEL-seed<s>` beside the config's own, and the report compares them.

`--mock-tfds N` trains on records from `tfds.testing.mock_data` (random values of the
dataset's real shapes and dtypes, N per split) instead of a prepared TFDS data dir: for timings
on a machine without the data; accuracies are then those of random labels.

`--every-algorithm` (was scripts/every_algorithm.py) runs every algorithm by name on one config
(or those of `--algorithms`), as a user types it, and prints the accuracy each reaches: for
each it runs the two command lines a user would try,

  python -m layup_jax.train --config CONFIG:ALGORITHM
  python -m layup_jax.train --config CONFIG --config.algorithm=ALGORITHM

each its own process in a scratch folder (no `--workdir`), and reads the final consensus test
accuracy from the run's summary.json; the one-line notes a run prints at start (`note: ...`: no
column for the algorithm, or values kept from another column) are shown with it. It writes the
rows to `--out` (default every_algorithm.json) and exits 1 if a run fails or ends below
`--min-accuracy`. The sweep's other options do not apply to it.

  python scripts/sweep.py --every-algorithm --config configs/digits.py --min-accuracy 0.95 \\
      --out docs/results/every_algorithm_digits.json
"""

import argparse
import ast
import contextlib
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax
import ml_collections

from layup_jax import algorithms, defaults
from layup_jax.errors import ConfigError
from layup_jax.measure import provenance
from layup_jax.platform import allocator
from layup_jax.run import runner

# Each method as the paper's comparisons run it, where it differs from the config: DiLoCo's
# inner optimizer is AdamW (its paper) and it averages every `tau` steps. A value the config
# file's column for the method sets (its `PAPER[algorithm]`, e.g. a searched lr) wins.
METHOD_SETTINGS = {
    "diloco": {"optimizer.name": "adamw", "optimizer.learning_rate": 3e-3,
               "optimizer.weight_decay": 1e-4},
}


def load_config_module(path: str):
  try:
    return defaults.load_config_module(path)
  except ConfigError as error:
    sys.exit(f"error: {error}")


def algorithm_config(module, algorithm: str) -> ml_collections.ConfigDict:
  """The config file's column for `algorithm` (the paper's hyper-parameters, as
  `--config FILE:ALGORITHM`), or the file's values where it has none; `METHOD_SETTINGS` fill
  what a column does not set."""
  config = module.get_config(algorithm)
  column = getattr(module, "PAPER", {}).get(algorithm, {})
  for key, value in METHOD_SETTINGS.get(algorithm, {}).items():
    if key not in column:
      set_value(config, key, value)
  return config


def set_value(config: ml_collections.ConfigDict, key: str, value) -> None:
  """`config.<key> = value` for a dotted key; exits with a one-line error for a bad key/type."""
  *sections, name = key.split(".")
  node = config
  try:
    for section in sections:
      node = node[section]
    if name not in node:
      raise KeyError(name)
    node[name] = value
  except KeyError:
    sys.exit(f"error: --set {key}: the config has no key {key}")
  except TypeError as error:
    sys.exit(f"error: --set {key}={value!r}: {error}")


def parse_assignment(text: str) -> tuple[str, object]:
  key, sep, raw = text.partition("=")
  if not sep:
    sys.exit(f"error: --set takes KEY=VALUE, got {text!r}")
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw  # a bare string
  return key.strip(), value


def run_config(module, overrides: list[tuple[str, object]], algorithm: str, seed: int,
               delay: float, mode: str = "host") -> ml_collections.ConfigDict:
  config = algorithm_config(module, algorithm)
  for key, value in overrides:
    set_value(config, key, value)
  config.seed = seed
  config.straggler.device, config.straggler.delay_iters = (0, float(delay)) if delay else (-1, 0.0)
  config.straggler.mode = mode
  config.checkpoint.enabled, config.progress_bar = False, False
  return config


def run_dir(workdir: pathlib.Path, algorithm: str, seed: int, delay: float, mode: str = "host",
            variant: str = "") -> pathlib.Path:
  """`delay<d>[-device]/<algorithm>[@<variant>]-seed<s>`: a device-side straggler's runs apart
  from the host-side ones (no straggler is one folder for both), a variant's apart from the
  config's own."""
  delay_dir = f"delay{delay:g}" + (f"-{mode}" if delay and mode != "host" else "")
  name = f"{algorithm}@{variant}" if variant else algorithm
  return workdir / delay_dir / f"{name}-seed{seed}"


@contextlib.contextmanager
def mocked_tfds(config: ml_collections.ConfigDict, num_examples: int):
  """Points `config.data.data_dir` at a data dir that looks prepared, with mocked records."""
  from layup_jax.data import DATASETS
  from tests.tfds_fakes import mocked_tfds as mock

  name = config.data.tfds_name or DATASETS[config.data.name].tfds_name
  with tempfile.TemporaryDirectory(prefix="layup_jax_mock_tfds_") as data_dir:
    config.data.data_dir = data_dir
    with mock(pathlib.Path(data_dir), [name], num_examples):
      yield


def every_algorithm_run(command: list[str], workdir: str) -> dict:
  """One `python -m layup_jax.train` command in its own process: its status, time, notes, and
  the final accuracy from its summary (or its last line of error)."""
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-m", "layup_jax.train", *command,
                         f"--workdir={workdir}", "--config.progress_bar=False"],
                        check=False, capture_output=True, text=True)
  row = {"command": " ".join(["python -m layup_jax.train", *command]), "rc": done.returncode,
         "seconds": round(time.perf_counter() - start, 1),
         "notes": [line for line in done.stderr.splitlines() if line.startswith("note:")]}
  if done.returncode == 0:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    row.update(accuracy=summary["final_eval_accuracy"], algorithm=summary["algorithm"])
  else:
    row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
  return row


def every_algorithm(config: str, names: list[str], min_accuracy: float, out: str) -> None:
  """`--every-algorithm`: each algorithm by name, both ways a user types it; exits 1 if a run
  fails or ends below `min_accuracy`."""
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    for algorithm in names:
      for form, command in (("suffix", [f"--config={config}:{algorithm}"]),
                            ("override", [f"--config={config}",
                                          f"--config.algorithm={algorithm}"])):
        row = {"algorithm": algorithm, "form": form,
               **every_algorithm_run(command, os.path.join(scratch, f"{algorithm}-{form}"))}
        rows.append(row)
        print(f"{algorithm:10s} {form:8s} rc {row['rc']} accuracy {row.get('accuracy', '-')}"
              f" {row['seconds']} s {' '.join(row['notes'])}{row.get('error', '')}", flush=True)
  ok = all(r["rc"] == 0 and r["accuracy"] >= min_accuracy for r in rows)
  print(f"\n| algorithm | `{config}:<algorithm>` | `--config.algorithm=<algorithm>` |")
  print("|---|---|---|")
  for algorithm in names:
    cells = [f"{r['accuracy']:.4f}" if r["rc"] == 0 else f"failed: {r['error']}"
             for r in rows if r["algorithm"] == algorithm]
    print(f"| {algorithm} | {' | '.join(cells)} |")
  with open(out, "w") as f:
    json.dump({"config": config, "min_accuracy": min_accuracy, "all_reached": ok,
               "code_version": provenance.code_version(), "rows": rows}, f, indent=1)
  print(f"\nevery run reached {min_accuracy}: {ok} (JSON in {out})")
  sys.exit(0 if ok else 1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True,
                      help="a config file, e.g. configs/digits.py (its paper column per algorithm)")
  parser.add_argument("--workdir", help="the sweep's folder (required but with --every-algorithm)")
  parser.add_argument("--algorithms", nargs="+", default=None, choices=algorithms.names(),
                      help="default: layup ddp (with --every-algorithm: every algorithm)")
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--delays", nargs="+", type=float, default=[0.0])
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="config override, repeatable (e.g. num_epochs=20)")
  parser.add_argument("--mock-tfds", type=int, default=0, metavar="N",
                      help="mocked TFDS records, N per split, instead of a prepared data dir")
  parser.add_argument("--straggler-mode", default="host", choices=["host", "device"],
                      help="how device 0 is delayed (straggler.mode): its host thread idles, "
                           "or its device runs a delay program")
  parser.add_argument("--variant", default="", metavar="LABEL",
                      help="an ablation: its runs are <algorithm>@LABEL, the --set overrides "
                           "recorded under LABEL in sweep.json")
  parser.add_argument("--force", action="store_true", help="rerun runs that have a summary")
  parser.add_argument("--every-algorithm", action="store_true",
                      help="each algorithm by name once on --config, both ways a user types it, "
                           "and the accuracy each reaches (no sweep)")
  parser.add_argument("--min-accuracy", type=float, default=0.95,
                      help="with --every-algorithm: exit 1 if a run ends below it")
  parser.add_argument("--out", default="every_algorithm.json",
                      help="with --every-algorithm: the rows as JSON")
  args = parser.parse_args()
  if args.every_algorithm:
    every_algorithm(args.config, args.algorithms or algorithms.names(), args.min_accuracy,
                    args.out)
    return
  if not args.workdir:
    parser.error("the following arguments are required: --workdir")
  args.algorithms = args.algorithms or ["layup", "ddp"]

  module = load_config_module(args.config)
  overrides = [parse_assignment(assignment) for assignment in args.set]
  first = run_config(module, overrides, args.algorithms[0], 0, 0)  # a bad --set fails here
  try:  # the sweep starts again under TCMalloc, as `python -m layup_jax.train` does
    note = allocator.use(first.tuning.host_allocator)
  except ValueError as error:
    sys.exit(f"error: {error}")
  if note:
    print(note, file=sys.stderr)
  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(workdir / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

  record = workdir / "sweep.json"
  saved = json.loads(record.read_text()) if record.exists() else {"commands": []}
  command = "python scripts/sweep.py " + " ".join(sys.argv[1:])
  saved.setdefault("code_versions", {})[command] = provenance.code_version()
  saved.update({
      "config": args.config, "mock_tfds": args.mock_tfds or saved.get("mock_tfds", 0),
      "commands": [*[c for c in saved["commands"] if c != command], command],
      "date": datetime.date.today().isoformat(),
      "machine": provenance.machine(),
  })
  if args.variant:
    if "@" in args.variant or "/" in args.variant or "-seed" in args.variant:
      sys.exit(f"error: --variant {args.variant!r}: a label without '@', '/' or '-seed'")
    saved.setdefault("variants", {})[args.variant] = args.set
  record.write_text(json.dumps(saved, indent=1))

  runs = [(a, s, d) for d in args.delays for s in args.seeds for a in args.algorithms]
  for count, (algorithm, seed, delay) in enumerate(runs, 1):
    where = run_dir(workdir, algorithm, seed, delay, args.straggler_mode, args.variant)
    if (where / "summary.json").exists() and not args.force:
      print(f"[{count}/{len(runs)}] {where}: done before, skipped", flush=True)
      continue
    if where.exists():
      for stale in ("metrics.jsonl", "summary.json"):
        (where / stale).unlink(missing_ok=True)
    config = run_config(module, overrides, algorithm, seed, delay, args.straggler_mode)
    with mocked_tfds(config, args.mock_tfds) if args.mock_tfds else contextlib.nullcontext():
      summary = runner.run(config, where)
    print(f"[{count}/{len(runs)}] {where}: accuracy {summary['final_eval_accuracy']:.4f}, "
          f"{summary['wall_time_s']:.1f} s training, "
          f"{summary['train_samples_per_s']:.0f} samples/s", flush=True)


if __name__ == "__main__":
  main()
