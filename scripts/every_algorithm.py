"""Every algorithm by name on one config, as a user types it, and the accuracy each reaches.

For each registered algorithm it runs the two command lines a user would try:

  python -m layup_jax.train --config CONFIG:ALGORITHM
  python -m layup_jax.train --config CONFIG --config.algorithm=ALGORITHM

each its own process, and reads the final consensus test accuracy from the run's summary.json;
the one-line notes a run prints at start (`note: ...`: no column for the algorithm, or values
kept from another column) are shown with it. Exits 1 if a run fails or ends below
`--min-accuracy`.

  python scripts/every_algorithm.py --config configs/digits.py --min-accuracy 0.95 \
      --out docs/results/every_algorithm_digits.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layup_jax import algorithms
from layup_jax.measure import provenance


def run(command: list[str], workdir: str) -> dict:
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--algorithms", nargs="+", default=algorithms.names(),
                      choices=algorithms.names())
  parser.add_argument("--min-accuracy", type=float, default=0.95)
  parser.add_argument("--out", default="every_algorithm.json")
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    for algorithm in args.algorithms:
      for form, command in (("suffix", [f"--config={args.config}:{algorithm}"]),
                            ("override", [f"--config={args.config}",
                                          f"--config.algorithm={algorithm}"])):
        row = {"algorithm": algorithm, "form": form,
               **run(command, os.path.join(scratch, f"{algorithm}-{form}"))}
        rows.append(row)
        print(f"{algorithm:10s} {form:8s} rc {row['rc']} accuracy {row.get('accuracy', '-')}"
              f" {row['seconds']} s {' '.join(row['notes'])}{row.get('error', '')}", flush=True)
  ok = all(r["rc"] == 0 and r["accuracy"] >= args.min_accuracy for r in rows)
  print(f"\n| algorithm | `{args.config}:<algorithm>` | `--config.algorithm=<algorithm>` |")
  print("|---|---|---|")
  for algorithm in args.algorithms:
    cells = [f"{r['accuracy']:.4f}" if r["rc"] == 0 else f"failed: {r['error']}"
             for r in rows if r["algorithm"] == algorithm]
    print(f"| {algorithm} | {' | '.join(cells)} |")
  with open(args.out, "w") as f:
    json.dump({"config": args.config, "min_accuracy": args.min_accuracy, "all_reached": ok,
               "code_version": provenance.code_version(), "rows": rows}, f, indent=1)
  print(f"\nevery run reached {args.min_accuracy}: {ok} (JSON in {args.out})")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
