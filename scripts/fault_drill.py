"""Kill a training run with SIGKILL at random moments, resume it each time, and count the damage.

  python scripts/fault_drill.py --kills 10

Runs the digits task (`configs/digits.py`, checkpoints every `--checkpoint-every` steps) once
without interruption, then again in another workdir where the command is killed with SIGKILL
(no chance to clean up: mid-step, mid-evaluation, mid-save) at a random moment `--kills` times
and re-run after each kill, as a cluster's restart policy would. Reports:

  runs            processes started for the interrupted run (kills + the one that finished)
  checkpoints lost  runs that, once past restoring, did not resume from the newest committed
                  checkpoint (a step folder Orbax had renamed into place before the previous
                  kill): it must be 0
  accuracy        final consensus test accuracy, interrupted versus uninterrupted

and writes them to `--json`. All runs share a persistent compilation cache, so a restart
recompiles nothing.
"""

import argparse
import functools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
print = functools.partial(print, flush=True)  # progress shows in logs at once


def _command(workdir: pathlib.Path, args) -> list[str]:
  return [sys.executable, "-m", "layup_jax.train", "--config", str(ROOT / "configs/digits.py"),
          f"--config.checkpoint.every={args.checkpoint_every}",
          f"--config.num_devices={args.num_devices}", f"--config.seed={args.seed}",
          "--config.progress_bar=False", f"--workdir={workdir}"]


def _committed(workdir: pathlib.Path) -> list[int]:
  directory = workdir / "checkpoints"
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _env(cache: str) -> dict[str, str]:
  return {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONPATH": str(ROOT)}


def _final_accuracy(workdir: pathlib.Path) -> float:
  return json.loads((workdir / "summary.json").read_text())["final_eval_accuracy"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--kills", type=int, default=10)
  parser.add_argument("--checkpoint-every", type=int, default=20)
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0, help="training seed and kill-time seed")
  parser.add_argument("--workdir", default="runs/fault_drill")
  parser.add_argument("--json", default="runs/fault_drill/fault_drill.json")
  parser.add_argument("--cache-dir", default="",
                      help="persistent compilation cache (default: a new temporary folder)")
  args = parser.parse_args()
  rng = np.random.default_rng(args.seed)
  root = pathlib.Path(args.workdir)
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True, exist_ok=True)
  env = _env(args.cache_dir or tempfile.mkdtemp(prefix="layup_jax_drill_cache_"))

  start = time.monotonic()
  subprocess.run(_command(root / "uninterrupted", args), env=env, check=True,
                 capture_output=True, text=True)
  uninterrupted_s = time.monotonic() - start
  print(f"uninterrupted run: {uninterrupted_s:.1f} s, accuracy "
        f"{_final_accuracy(root / 'uninterrupted'):.4f}")

  drill = root / "drill"
  runs, lost, kills, events = 0, 0, 0, []
  while True:
    runs += 1
    before = _committed(drill)
    process = subprocess.Popen(_command(drill, args), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    killed_at = None
    if kills < args.kills:
      # Anywhere in a run's life: start-up, training, evaluation, saving. A mean of
      # 1/(kills + 1) of an uninterrupted run leaves training unfinished at the last kill.
      delay = float(rng.uniform(2.0, 2.0 * uninterrupted_s / (args.kills + 1)))
      try:
        process.wait(timeout=delay)
      except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        killed_at, kills = delay, kills + 1
    _, stderr = process.communicate()
    resumed = re.search(r"resumed from the checkpoint \S+/(\d+) ", stderr)
    resumed_step = int(resumed.group(1)) if resumed else 0
    # Judged once a run got past restoring: it printed where it resumed from, or it finished.
    restored = resumed is not None or killed_at is None
    if restored and before and resumed_step != before[-1]:
      lost += 1  # the newest committed checkpoint was not the one resumed from
    events.append({"run": runs, "restored": restored, "resumed_from": resumed_step,
                   "killed_after_s": killed_at,
                   "committed_before": before, "committed_after": _committed(drill),
                   "returncode": process.returncode})
    print(f"run {runs}: " + (f"resumed from step {resumed_step}, " if restored
                             else "killed before restoring, ")
          + (f"killed after {killed_at:.1f} s" if killed_at else
             f"exited {process.returncode}") + f", checkpoints now {_committed(drill)}")
    if killed_at is None:
      if process.returncode != 0:
        sys.exit(f"the run failed:\n{stderr[-3000:]}")
      break
  unreadable = drill / "checkpoints_unreadable"
  result = {
      "kills": kills, "runs": runs, "checkpoints_lost": lost,
      "unreadable_checkpoints": len(list(unreadable.iterdir())) if unreadable.exists() else 0,
      "uninterrupted_accuracy": _final_accuracy(root / "uninterrupted"),
      "interrupted_accuracy": _final_accuracy(drill),
      "uninterrupted_wall_s": uninterrupted_s, "checkpoint_every": args.checkpoint_every,
      "num_devices": args.num_devices, "seed": args.seed, "events": events,
  }
  print(f"\n| kills | runs | checkpoints lost | unreadable | accuracy (interrupted) | "
        f"accuracy (uninterrupted) |\n|---|---|---|---|---|---|\n"
        f"| {kills} | {runs} | {lost} | {result['unreadable_checkpoints']} | "
        f"{result['interrupted_accuracy']:.4f} | {result['uninterrupted_accuracy']:.4f} |")
  pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
