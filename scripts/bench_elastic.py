"""A gossip run that loses a process, against the same run uninterrupted (issue: elastic gossip).

    python scripts/bench_elastic.py --config configs/fashion_mnist.py --processes 3 \\
        --devices-per-process 2 --kill-at 0.4 --seeds 0 1 2 --out bench_elastic.json

Per seed: the run uninterrupted, then the same run with process `--victim` (not 0) SIGKILLed
once `--kill-at` of the steps are done (read from process 0's progress log,
`metrics.progress_every_s`); with `--restart-at`, its command is started again once that
fraction of the steps is done, and it rejoins (docs/elastic.md). Each process is started as a cluster's starter would (no launcher:
the launcher stops every process when one dies). Reported per killed run:

- `samples_per_s_before` / `_after`: the survivors' samples per second per device in the
  `--window` seconds before the kill and after it (their progress logs);
- `declared_s`: from the kill to process 0's line `process K lost at step S` (the watchdog's
  detection, about `distributed.heartbeat_timeout_s`);
- `longest_stall_s`: the longest time after the kill in which a survivor did no iteration (what
  waited on the lost process: a consistent point's acknowledgements and gather);
- final accuracy against the uninterrupted run's, and the weight sums at the end;
- restarted: the step it rejoined at (its line `process K rejoined the run at step S`), and
  the devices in the final evaluation's average.

    python scripts/bench_elastic.py --config configs/digits.py --num-steps 6000 --kill-at 0.4 \\
        --restart-at 0.6 --no-uninterrupted --set num_steps=6000 --set eval_every=60 \\
        --batch-size 16 --out rejoin_drill.json

`--kill-during-save EVERY` writes a checkpoint every EVERY steps and kills the victim while one
is being written (once `--kill-at` is reached, as soon as Orbax's temporary directory of a
save appears): a drill of what the design does not promise to survive. Its row records every
process's exit status, the survivors still running at the end, their last step and the last
lines of their output, whatever the run did:

    python scripts/bench_elastic.py --config configs/digits.py --num-steps 600 --kill-at 0.3 \\
        --kill-during-save 20 --no-uninterrupted --set num_steps=600 --batch-size 16 \\
        --timeout 900 --out kill_mid_checkpoint.json
"""

import argparse
import itertools
import json
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layup_jax.launch import commands, environment, free_port
from layup_jax.measure import provenance
from layup_jax.run.records import read_metrics


def progress(workdir: pathlib.Path, k: int) -> list[dict]:
  path = workdir / "progress" / f"process_{k}.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start(args, workdir: pathlib.Path, seed: int) -> tuple[list[subprocess.Popen], list, dict]:
  """The run's processes, their commands and environment."""
  train = ["--config", f"{args.config}:{args.algorithm}", "--workdir", str(workdir),  # its column
           f"--config.seed={seed}", f"--config.num_devices={args.processes * args.devices_per_process}",
           "--config.progress_bar=False",
           *(["--config.checkpoint.enabled=False"] if not args.kill_during_save else
             ["--config.checkpoint.enabled=True",
              f"--config.checkpoint.every={args.kill_during_save}"]),
           f"--config.metrics.progress_every_s={args.progress_every_s}",
           f"--config.distributed.heartbeat_timeout_s={args.heartbeat_timeout_s}",
           *[f"--config.{o}" for o in args.set]]
  env = environment(args.devices_per_process)
  every = commands(args.processes, free_port(), train)
  return [popen(command, env) for command in every], every, env


def popen(command: list[str], env: dict) -> subprocess.Popen:
  return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def read_lines(process: subprocess.Popen, lines: list) -> threading.Thread:
  """Collects a process's output lines with their arrival time."""
  def read():
    for line in process.stdout:
      lines.append((time.time(), line.rstrip("\n")))
  thread = threading.Thread(target=read, daemon=True)
  thread.start()
  return thread


def one_run(args, seed: int, kill: bool) -> dict:
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench_elastic_"))
  processes, every, env = start(args, workdir, seed)
  outputs = [[] for _ in processes]
  readers = [read_lines(p, out) for p, out in zip(processes, outputs)]
  killed_at = restarted_at = None
  try:
    if kill:
      while killed_at is None:
        rows = progress(workdir, 0)
        assert not (workdir / "summary.json").exists(), "the run ended before the kill"
        if (rows and rows[-1]["step"] >= args.kill_at * args.num_steps
            and (not args.kill_during_save or saving(workdir))):
          processes[args.victim].send_signal(signal.SIGKILL)
          killed_at = time.time()
        assert all(p.poll() is None for p in processes), "a process ended before the kill"
        time.sleep(0.05)
    restart = kill and args.restart_at is not None
    while restart and restarted_at is None:
      rows = progress(workdir, 0)
      assert processes[0].poll() is None, "the run ended before the restart"
      if rows and rows[-1]["step"] >= args.restart_at * args.num_steps:
        restarted_at = rows[-1]["step"]
        outputs.append([])
        processes.append(popen(every[args.victim], env))
        readers.append(read_lines(processes[-1], outputs[-1]))
      time.sleep(0.05)
    for k, p in enumerate(processes):
      if kill and k == args.victim:
        continue
      try:
        p.wait(timeout=args.timeout)
      except subprocess.TimeoutExpired:
        if not args.kill_during_save:
          raise
  finally:
    ended, still_running = time.time(), [p.poll() is None for p in processes]
    for p in processes:
      p.kill()
      p.wait()
    for reader in readers:
      reader.join(timeout=5)
  statuses = [p.returncode for p in processes]
  survivors = [k for k in range(args.processes) if not (kill and k == args.victim)]
  if args.kill_during_save:  # whatever happened is the drill's result
    lost = [line for _, line in outputs[0] if "lost at step" in line]
    last = {k: (progress(workdir, k) or [{}])[-1] for k in survivors}
    return {"seed": seed, "killed_during_save": True, "statuses": statuses,
            # a survivor still running `--timeout` s after the kill (then killed here)
            "hung": [k for k in survivors if still_running[k]],
            "survivors_last_step": {k: last[k].get("step") for k in survivors},
            # from a survivor's last iteration to the end of the drill
            "survivors_still_for_s": {k: round(ended - last[k]["t"])
                                      for k in survivors if "t" in last[k]},
            "finished": (workdir / "summary.json").exists(),
            "checkpoints": sorted(p.name for p in (workdir / "checkpoints").iterdir()),
            "lost_line": lost[0] if lost else None,
            "last_lines": {k: [line for _, line in outputs[k][-12:]] for k in survivors}}
  if any(statuses[k] != 0 for k in [*survivors, *range(args.processes, len(processes))]):
    sys.exit(f"seed {seed} ({'killed' if kill else 'whole'}) failed: {statuses}\n"
             + "\n".join(line for _, line in outputs[0][-40:]))
  summary = json.loads((workdir / "summary.json").read_text())
  row = {"seed": seed, "killed": kill, "final_accuracy": summary["final_eval_accuracy"],
         "training_s": summary["wall_time_s"], "samples_per_s": summary["train_samples_per_s"],
         "time_to_target_s": summary.get("time_to_target_s"),
         "weight_sum_min": summary.get("weight_sum_min"),
         "weight_sum_max": summary.get("weight_sum_max")}
  if kill:
    row.update(around_the_kill(workdir, survivors, killed_at, outputs[0], args))
  if restarted_at is not None:
    rejoined = [line for _, line in outputs[-1] if "rejoined the run at step" in line]
    final = [r for r in read_metrics(workdir) if r["split"] == "test"][-1]
    row.update({"restarted_at_step": restarted_at,
                "rejoined_at_step": int(rejoined[0].rsplit(" ", 1)[1]) if rejoined else None,
                "final_devices_in_average": final.get("devices_in_average"),
                "restarted_samples_per_s": summary["device_samples_per_s"][
                    args.victim * args.devices_per_process:
                    (args.victim + 1) * args.devices_per_process]})
  return row


def saving(workdir: pathlib.Path) -> bool:
  """Whether a checkpoint is being written: Orbax's temporary directory of a save exists."""
  folder = workdir / "checkpoints"
  return folder.exists() and any("tmp" in p.name for p in folder.iterdir())


def rate(rows: list[dict], start: float, end: float, devices: int, batch: int) -> float | None:
  """Samples per second per device between two wall times, from a progress log."""
  inside = [r for r in rows if start <= r["t"] <= end]
  if len(inside) < 2:
    return None
  iterations = inside[-1]["iterations"] - inside[0]["iterations"]
  return iterations * batch / devices / (inside[-1]["t"] - inside[0]["t"])


def around_the_kill(workdir, survivors, killed_at, output, args) -> dict:
  logs = {k: progress(workdir, k) for k in survivors}
  window, devices, batch = args.window, args.devices_per_process, args.batch_size
  before = [rate(logs[k], killed_at - window, killed_at, devices, batch) for k in survivors]
  after = [rate(logs[k], killed_at, killed_at + window, devices, batch) for k in survivors]
  declared = next((t for t, line in output if "lost at step" in line), None)
  stalls = []
  for k in survivors:  # the longest gap between advancing samples after the kill
    rows = [r for r in logs[k] if r["t"] >= killed_at]
    last_move, longest = killed_at, 0.0
    for previous, current in itertools.pairwise(rows):
      if current["iterations"] > previous["iterations"]:
        longest = max(longest, current["t"] - last_move)
        last_move = current["t"]
    stalls.append(longest)
  return {"samples_per_s_before": before, "samples_per_s_after": after,
          "after_over_before": [a / b if a and b else None for a, b in zip(after, before)],
          "declared_s": None if declared is None else declared - killed_at,
          "longest_stall_s": stalls,
          "lost_line": next((line for _, line in output if "lost at step" in line), None)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/fashion_mnist.py")
  parser.add_argument("--algorithm", default="layup")
  parser.add_argument("--processes", type=int, default=3)
  parser.add_argument("--devices-per-process", type=int, default=2)
  parser.add_argument("--victim", type=int, default=2)
  parser.add_argument("--kill-at", type=float, default=0.4, help="fraction of the steps")
  parser.add_argument("--restart-at", type=float, default=None,
                      help="fraction of the steps at which the victim's command starts again")
  parser.add_argument("--no-uninterrupted", action="store_true",
                      help="only the killed run (no accuracy comparison)")
  parser.add_argument("--num-steps", type=int, required=True,
                      help="the run's steps (702 for the Fashion-MNIST config), to place the kill")
  parser.add_argument("--batch-size", type=int, default=32, help="the config's, for samples/s")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--window", type=float, default=10.0)
  parser.add_argument("--progress-every-s", type=float, default=0.2)
  parser.add_argument("--heartbeat-timeout-s", type=int, default=10)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--kill-during-save", type=int, default=0, metavar="EVERY",
                      help="checkpoint every EVERY steps and kill the victim during a save")
  parser.add_argument("--timeout", type=float, default=3600)
  parser.add_argument("--out", default="bench_elastic.json")
  args = parser.parse_args()
  if not 0 < args.victim < args.processes:
    parser.error("--victim must be a process other than 0 (process 0's loss is not survived)")
  rows = []
  for seed in args.seeds:
    for kill in (True,) if args.no_uninterrupted else (False, True):
      row = one_run(args, seed, kill)
      rows.append(row)
      print(json.dumps(row), flush=True)
  if args.kill_during_save:
    print(json.dumps(rows, indent=1))
    with open(args.out, "w") as f:
      json.dump({**provenance.stamp(), "args": vars(args), "runs": rows}, f, indent=1)
    return
  whole = {r["seed"]: r["final_accuracy"] for r in rows if not r["killed"]}
  killed = [r for r in rows if r["killed"]]
  print("\n| seed | final accuracy, uninterrupted | killed | difference (pt) | samples/s per "
        "device after / before | declared s | longest stall s | restarted / rejoined at step "
        "| devices in the final average |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in killed:
    ratios = [x for x in r["after_over_before"] if x is not None]
    base = whole.get(r["seed"])
    print(f"| {r['seed']} | {'-' if base is None else format(base, '.4f')} | "
          f"{r['final_accuracy']:.4f} | "
          f"{'-' if base is None else format(100 * (r['final_accuracy'] - base), '+.2f')} | "
          f"{', '.join(f'{x:.2f}' for x in ratios)} | "
          f"{'-' if r['declared_s'] is None else format(r['declared_s'], '.1f')} | "
          f"{', '.join(f'{x:.1f}' for x in r['longest_stall_s'])} | "
          f"{r.get('restarted_at_step', '-')} / {r.get('rejoined_at_step', '-')} | "
          f"{r.get('final_devices_in_average', '-')} |")
  differences = [r["final_accuracy"] - whole[r["seed"]] for r in killed if r["seed"] in whole]
  if differences:
    print(f"\nmean difference {100 * statistics.mean(differences):+.2f} pt over "
          f"{len(differences)} seeds")
  with open(args.out, "w") as f:
    json.dump({**provenance.stamp(), "args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
  main()
