"""A training run that loses a process, in four modes (the first argument).

  kill-resume  SIGKILL a one-process run at random moments, resume it each time, and count the
               damage (checkpoints lost, accuracy against an uninterrupted run)
  elastic      a gossip run across processes that loses one (and may restart it), against the
               same run uninterrupted
  vanish       a host that vanishes mid-run without closing its connections (power, a cable),
               across 3 "hosts" of scripts/cluster_drill.sh (as root)
  churn        processes killed and started again on a schedule through a whole run (LayUp
               rejoins the running run; DDP is run again from its last checkpoint)

    python scripts/drill_process_loss.py kill-resume --kills 10
    python scripts/drill_process_loss.py elastic --config configs/fashion_mnist.py \\
        --processes 3 --devices-per-process 2 --num-steps 702 --kill-at 0.4 --seeds 0 1 2 \\
        --out bench_elastic.json
    sudo python scripts/drill_process_loss.py vanish [--steps 1500] [--at 0.4] [--rate 20mbit] \\
        [--slow 200kbit] [--workdir runs/vanish] [-- <more train arguments>]
    python scripts/drill_process_loss.py churn --algorithm layup --mtbf-s 20 --num-steps 6000 \\
        --set eval_every=60 --out churn.json

`python scripts/drill_process_loss.py MODE --help` lists a mode's options.

## kill-resume (was scripts/fault_drill.py)

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

## elastic (was scripts/bench_elastic.py)

Per seed: the run uninterrupted, then the same run with process `--victim` SIGKILLed once
`--kill-at` of the steps are done (read from the lowest other process's progress log,
`metrics.progress_every_s`). The coordination service runs in a process of its own, as the
launcher runs it, so that any process may be the victim, process 0 included
(`--no-coordinator`: inside process 0, which then may not be). With `--restart-at`, its
command is started again once that
fraction of the steps is done, and it rejoins (docs/guide/elastic.md). Each process is started
as a cluster's starter would (no launcher: the launcher stops every process when one dies).
Reported per killed run:

- `samples_per_s_before` / `_after`: the survivors' samples per second per device in the
  `--window` seconds before the kill and after it (their progress logs);
- `declared_s`: from the kill to the leader's line `process K lost at step S` (the watchdog's
  detection, about `distributed.heartbeat_timeout_s`);
- `longest_stall_s`: the longest time after the kill in which a survivor did no iteration (what
  waited on the lost process: a consistent point's acknowledgements and gather);
- final accuracy against the uninterrupted run's, and the weight sums at the end;
- restarted: the step it rejoined at (its line `process K rejoined the run at step S`), and
  the devices in the final evaluation's average.

    python scripts/drill_process_loss.py elastic --config configs/digits.py --num-steps 6000 \\
        --kill-at 0.4 --restart-at 0.6 --no-uninterrupted --set num_steps=6000 \\
        --set eval_every=60 --batch-size 16 --out rejoin_drill.json

`--kill-during-save EVERY` writes a checkpoint every EVERY steps and kills the victim while one
is being written (once `--kill-at` is reached, as soon as Orbax's temporary directory of a
save appears): a drill of what the design does not promise to survive. Its row records every
process's exit status, the survivors still running at the end, their last step and the last
lines of their output, whatever the run did:

    python scripts/drill_process_loss.py elastic --config configs/digits.py --num-steps 600 \\
        --kill-at 0.3 --kill-during-save 20 --no-uninterrupted --set num_steps=600 \\
        --batch-size 16 --timeout 900 --out kill_mid_checkpoint.json

## churn

Processes SIGKILLed through a whole run, the times between failures exponential with mean
`--mtbf-s` (seeded by `--seed`), the victim drawn uniformly from the processes training at that
moment (never the last one; the coordination service runs in a process of its own and is never
the victim), from the run's first trained step on (a process lost while the run is set up stops
it: docs/guide/elastic.md), each started again `--restart-delay-s` after its kill with its same command, as a
cluster's restart policy would. No kill after `--last-kill-at` of the steps, so that the last
restart has time to rejoin. LayUp (and GoSGD): the killed process is declared lost, the others
train on, and its restart rejoins the running run. DDP (or any method that stops on a loss):
the launcher's run stops, and its same command is run again after the delay, resuming from
the last checkpoint (`--checkpoint-every`). Also runs the same command without failures
(`--no-uninterrupted`: not). Reported (`--out`, and a table):

- `kill_to_declared_s`: per kill, to the first line `process K lost at step S` (LayUp), or to
  the launcher's exit (DDP); p50 and p95;
- `restart_to_contributing_s`: per restart, to its line `process K rejoined the run at step S`
  (LayUp), or to the first iteration of the resumed run (DDP); p50 and p95;
- `samples_per_s_kept`: the run's samples over the drill's wall time, against the uninterrupted
  run's (compilation and restarts included in both);
- the final accuracy against the uninterrupted run's, the per-stage weight sums at the end, and
  the devices in the final evaluation's average.

    python scripts/drill_process_loss.py churn --algorithm ddp --mtbf-s 20 --num-steps 6000 \\
        --set eval_every=60 --checkpoint-every 60 --out churn_ddp.json

## vanish (was scripts/vanish_drill.sh)

LayUp on the digits across 3 "hosts" x 2 CPU devices (scripts/cluster_drill.sh, links shaped at
`--rate`). At `--at` of the steps host 2's own link is first slowed to `--slow` for 4 s, so that
transfers from it are in flight, then taken down and its process SIGKILLed: its FIN/RST never
reach the others, as when a host loses power. Passes (status 0) when the two survivors end with
status 0 (the drill's status is then host 2's, 137), process 0 names the lost process once, and
the run's summary exists; prints what happened and when, and the lines that tell it. The drill
starts `$PYTHON` (default: the interpreter running this script).
"""

import argparse
import contextlib
import functools
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layup_jax.launch import commands, coordinator_command, environment, free_port
from layup_jax.measure import provenance
from layup_jax.run.records import read_metrics

MODES = ("kill-resume", "elastic", "vanish", "churn")
print = functools.partial(print, flush=True)  # progress shows in logs at once

# --- kill-resume --------------------------------------------------------------------------------


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


def main_kill_resume(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="drill_process_loss.py kill-resume",
      description="Kill a training run with SIGKILL at random moments, resume it each time, "
                  "and count the damage.")
  parser.add_argument("--kills", type=int, default=10)
  parser.add_argument("--checkpoint-every", type=int, default=20)
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0, help="training seed and kill-time seed")
  parser.add_argument("--workdir", default="runs/fault_drill")
  parser.add_argument("--json", default="runs/fault_drill/fault_drill.json")
  parser.add_argument("--cache-dir", default="",
                      help="persistent compilation cache (default: a new temporary folder)")
  args = parser.parse_args(argv)
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


# --- elastic --------------------------------------------------------------------------------------


def progress(workdir: pathlib.Path, k: int) -> list[dict]:
  path = workdir / "progress" / f"process_{k}.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start(args, workdir: pathlib.Path, seed: int) -> tuple[list[subprocess.Popen], list, dict]:
  """The run's processes, their commands and environment."""
  devices = args.processes * args.devices_per_process
  train = ["--config", f"{args.config}:{args.algorithm}", "--workdir", str(workdir),  # its column
           f"--config.seed={seed}", f"--config.num_devices={devices}",
           "--config.progress_bar=False",
           *(["--config.checkpoint.enabled=False"] if not args.kill_during_save else
             ["--config.checkpoint.enabled=True",
              f"--config.checkpoint.every={args.kill_during_save}"]),
           f"--config.metrics.progress_every_s={args.progress_every_s}",
           f"--config.distributed.heartbeat_timeout_s={args.heartbeat_timeout_s}",
           *[f"--config.{o}" for o in args.set]]
  env = environment(args.devices_per_process)
  port = free_port()
  every = commands(args.processes, port, train, external_coordinator=not args.no_coordinator)
  coordinator = ([] if args.no_coordinator else
                 [subprocess.Popen(coordinator_command(args.processes, port), cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)])
  return [popen(command, env) for command in every], every, env, coordinator


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
  processes, every, env, coordinator = start(args, workdir, seed)
  outputs = [[] for _ in processes]
  readers = [read_lines(p, out) for p, out in zip(processes, outputs)]
  killed_at = restarted_at = None
  watched = min(k for k in range(args.processes) if not (kill and k == args.victim))
  try:
    if kill:
      while killed_at is None:
        rows = progress(workdir, watched)
        assert not (workdir / "summary.json").exists(), "the run ended before the kill"
        if (rows and rows[-1]["step"] >= args.kill_at * args.num_steps
            and (not args.kill_during_save or saving(workdir))):
          processes[args.victim].send_signal(signal.SIGKILL)
          killed_at = time.time()
        assert all(p.poll() is None for p in processes), "a process ended before the kill"
        time.sleep(0.05)
    restart = kill and args.restart_at is not None
    while restart and restarted_at is None:
      rows = progress(workdir, watched)
      assert processes[watched].poll() is None, "the run ended before the restart"
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
    for p in [*processes, *coordinator]:
      p.kill()
      p.wait()
    for reader in readers:
      reader.join(timeout=5)
  statuses = [p.returncode for p in processes]
  survivors = [k for k in range(args.processes) if not (kill and k == args.victim)]
  said = [item for k in survivors for item in outputs[k]]  # the leader's lines among them
  if args.kill_during_save:  # whatever happened is the drill's result
    lost = [line for _, line in said if "lost at step" in line]
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
             + "\n".join(line for _, line in outputs[watched][-40:]))
  summary = json.loads((workdir / "summary.json").read_text())
  row = {"seed": seed, "killed": kill, "final_accuracy": summary["final_eval_accuracy"],
         "training_s": summary["wall_time_s"], "samples_per_s": summary["train_samples_per_s"],
         "time_to_target_s": summary.get("time_to_target_s"),
         "weight_sum_min": summary.get("weight_sum_min"),
         "weight_sum_max": summary.get("weight_sum_max")}
  if kill:
    row.update(around_the_kill(workdir, survivors, killed_at, sorted(said), args))
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


def main_elastic(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="drill_process_loss.py elastic",
      description="A gossip run that loses a process, against the same run uninterrupted.")
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
  parser.add_argument("--no-coordinator", action="store_true",
                      help="the coordination service inside process 0 (then not a victim)")
  parser.add_argument("--out", default="bench_elastic.json")
  args = parser.parse_args(argv)
  stamp = provenance.stamp()  # the code that trains: commits during the drill change none
  if not (0 if not args.no_coordinator else 1) <= args.victim < args.processes:
    parser.error("--victim must be a process of the run, other than 0 with --no-coordinator "
                 "(the service inside process 0: its loss is not survived)")
  rows = []
  for seed in args.seeds:
    for kill in (True,) if args.no_uninterrupted else (False, True):
      row = one_run(args, seed, kill)
      rows.append(row)
      print(json.dumps(row), flush=True)
  if args.kill_during_save:
    print(json.dumps(rows, indent=1))
    with open(args.out, "w") as f:
      json.dump({**stamp, "args": vars(args), "runs": rows}, f, indent=1)
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
    json.dump({**stamp, "args": vars(args), "runs": rows}, f, indent=1)


# --- churn --------------------------------------------------------------------------------------


def _quantiles(values: list[float]) -> dict:
  if not values:
    return {"p50": None, "p95": None, "n": 0}
  return {"p50": round(float(np.percentile(values, 50)), 2),
          "p95": round(float(np.percentile(values, 95)), 2), "n": len(values)}


def _churn_train_args(args, workdir: pathlib.Path) -> list[str]:
  devices = args.processes * args.devices_per_process
  return ["--config", f"{args.config}:{args.algorithm}", "--workdir", str(workdir),
          f"--config.seed={args.seed}", f"--config.num_devices={devices}",
          f"--config.num_steps={args.num_steps}", "--config.progress_bar=False",
          f"--config.checkpoint.every={args.checkpoint_every}",
          f"--config.metrics.progress_every_s={args.progress_every_s}",
          f"--config.distributed.heartbeat_timeout_s={args.heartbeat_timeout_s}",
          *[f"--config.{o}" for o in args.set]]


def _last_step(workdir: pathlib.Path, processes: int) -> int:
  return max([0, *(r["step"] for k in range(processes) for r in progress(workdir, k)[-1:])])


def _churn_result(workdir: pathlib.Path, started: float, ended: float) -> dict:
  summary = json.loads((workdir / "summary.json").read_text())
  final = [r for r in read_metrics(workdir) if r["split"] == "test"][-1]
  return {"final_accuracy": summary["final_eval_accuracy"], "wall_s": round(ended - started, 1),
          "weight_sum_min": summary.get("weight_sum_min"),
          "weight_sum_max": summary.get("weight_sum_max"),
          "final_devices_in_average": final.get("devices_in_average")}


def churn_gossip(args, workdir: pathlib.Path, kills: bool) -> dict:
  """LayUp's run: each process started as a cluster's starter would; kills and restarts."""
  rng = np.random.default_rng(args.seed)
  env = environment(args.devices_per_process)
  port = free_port()
  every = commands(args.processes, port, _churn_train_args(args, workdir),
                   external_coordinator=True)
  coordinator = subprocess.Popen(coordinator_command(args.processes, port), cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  started = time.time()
  running = [popen(command, env) for command in every]  # process k's newest start
  outputs = [[] for _ in running]  # process k's newest start's lines
  every_output, every_process, readers = [*outputs], [*running], []
  readers = [read_lines(p, out) for p, out in zip(running, outputs)]
  training = set(range(args.processes))  # started and not (yet) killed, rejoined or original
  events, pending = [], {}  # pending restarts: process -> wall time
  next_kill = None  # the schedule starts once the run trains
  last_step, moved_at = 0, started
  try:
    while not (workdir / "summary.json").exists():
      now = time.time()
      assert now - started < args.timeout, "the drill ran past --timeout"
      assert coordinator.poll() is None, "the coordinator ended"
      for k in list(training):
        if running[k].poll() not in (None, 0):
          sys.exit(f"process {k} ended with status {running[k].returncode}:\n"
                   + "\n".join(line for _, line in outputs[k][-30:]))
      if not pending and all(p.poll() is not None for p in running):
        time.sleep(1)  # the summary, if the run ended
        if not (workdir / "summary.json").exists():
          sys.exit("every process ended without the run's summary:\n" + "\n".join(
              f"process {k} (status {p.returncode}):\n" + "\n".join(
                  line for _, line in outputs[k][-15:]) for k, p in enumerate(running)))
      for event in events:  # a restarted process trains once it says it rejoined
        if event["rejoined_t"] is None and event["restart_t"] is not None:
          rejoined = [t for t, line in outputs[event["process"]]
                      if "rejoined the run at step" in line]
          if rejoined:
            event["rejoined_t"] = rejoined[0]
            training.add(event["process"])
      for k, at in list(pending.items()):
        if now >= at:
          del pending[k]
          outputs[k] = []
          running[k] = popen(every[k], env)
          every_process.append(running[k])
          every_output.append(outputs[k])
          readers.append(read_lines(running[k], outputs[k]))
          next(e for e in reversed(events) if e["process"] == k)["restart_t"] = time.time()
      step = _last_step(workdir, args.processes)
      if step != last_step:
        last_step, moved_at = step, now
      assert now - moved_at < args.stall_s, (
          f"the run stood still at step {step} for {args.stall_s:g} s (the outputs: "
          f"{args.out}.logs)")
      if next_kill is None and step > 0:
        next_kill = now + rng.exponential(args.mtbf_s)
      if (kills and next_kill is not None and now >= next_kill
          and step < args.last_kill_at * args.num_steps):
        next_kill = now + rng.exponential(args.mtbf_s)
        if len(training) >= 2:
          k = int(rng.choice(sorted(training)))
          running[k].send_signal(signal.SIGKILL)
          training.discard(k)
          events.append({"process": k, "kill_t": time.time(), "step": step,
                         "restart_t": None, "rejoined_t": None})
          pending[k] = time.time() + args.restart_delay_s
          print(f"churn: killed process {k} at step {step} ({len(events)} kills)")
      time.sleep(0.05)
    for p in running:
      try:
        p.wait(timeout=120)
      except subprocess.TimeoutExpired:
        pass
    ended = time.time()
  finally:
    for p in [*every_process, coordinator]:
      p.kill()
      p.wait()
    for reader in readers:
      reader.join(timeout=5)
    # Every start's output with its lines' arrival times, whatever ended the drill (a stalled
    # run is read from these).
    logs = pathlib.Path(f"{args.out}.logs")
    logs.mkdir(exist_ok=True)
    for n, (p, out) in enumerate(zip(every_process, every_output)):
      k = p.args[-1].rsplit("=", 1)[1]
      (logs / f"start_{n}_process_{k}.log").write_text(
          "".join(f"{t:.2f} {line}\n" for t, line in out))
  said = sorted(item for out in every_output for item in out)
  for event in events:
    k = event["process"]
    declared = next((t for t, line in said
                     if t >= event["kill_t"] and f"process {k} lost at step" in line), None)
    event["kill_to_declared_s"] = None if declared is None else round(declared - event["kill_t"], 2)
    event["restart_to_contributing_s"] = (
        None if event["rejoined_t"] is None or event["restart_t"] is None
        else round(event["rejoined_t"] - event["restart_t"], 2))
  result = _churn_result(workdir, started, ended)
  result.update({"kills": len(events), "events": events,
                 "statuses": [p.returncode for p in running],
                 "not_admitted": sum(any("was not admitted back" in line for _, line in out)
                                     for out in every_output)})
  return result


def churn_restarted(args, workdir: pathlib.Path, kills: bool) -> dict:
  """DDP's run: the launcher's; on a kill the run stops, and the command runs again."""
  rng = np.random.default_rng(args.seed)
  launch = [sys.executable, "-m", "layup_jax.launch", "--processes", str(args.processes),
            "--devices-per-process", str(args.devices_per_process), "--",
            *_churn_train_args(args, workdir)]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  started, events = time.time(), []
  next_kill = None  # the schedule starts once the run trains
  while not (workdir / "summary.json").exists():
    assert time.time() - started < args.timeout, "the drill ran past --timeout"
    restart_t = time.time()
    launcher = subprocess.Popen(launch, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    if events:
      events[-1]["restart_t"] = restart_t
    resumed_from = _last_step(workdir, args.processes) if events else None
    try:
      while launcher.poll() is None:
        now = time.time()
        if events and events[-1]["contributing_t"] is None:
          rows = [r for k in range(args.processes) for r in progress(workdir, k)
                  if r["t"] >= restart_t and r["step"] > 0]
          if rows:
            events[-1]["contributing_t"] = min(r["t"] for r in rows)
        step = _last_step(workdir, args.processes)
        if next_kill is None and step > 0:
          next_kill = now + rng.exponential(args.mtbf_s)
        recovering = bool(events) and events[-1]["contributing_t"] is None
        if (kills and next_kill is not None and now >= next_kill
            and step < args.last_kill_at * args.num_steps):
          next_kill = now + rng.exponential(args.mtbf_s)
          k = int(rng.integers(args.processes))
          found = subprocess.run(["pgrep", "-f", f"workdir {workdir} .*process_id={k}$"],
                                 capture_output=True, text=True).stdout.split()
          if found and not recovering:  # as LayUp's: only a run that trains loses a process
            os.kill(int(found[0]), signal.SIGKILL)
            events.append({"process": k, "kill_t": time.time(), "step": step,
                           "resumed_from": resumed_from, "stopped_t": None,
                           "restart_t": None, "contributing_t": None})
            print(f"churn: killed process {k} at step {step} ({len(events)} kills)")
        time.sleep(0.05)
    finally:
      launcher.kill()
      launcher.wait()
    if events and events[-1]["stopped_t"] is None:
      events[-1]["stopped_t"] = time.time()
      time.sleep(max(0.0, events[-1]["kill_t"] + args.restart_delay_s - time.time()))
    elif not (workdir / "summary.json").exists():
      sys.exit(f"the run ended with status {launcher.returncode} and no kill")
  ended = time.time()
  for event in events:
    event["kill_to_declared_s"] = round(event["stopped_t"] - event["kill_t"], 2)
    event["restart_to_contributing_s"] = (
        None if event["contributing_t"] is None or event["restart_t"] is None
        else round(event["contributing_t"] - event["restart_t"], 2))
  result = _churn_result(workdir, started, ended)
  result.update({"kills": len(events), "events": events})
  return result


def main_churn(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="drill_process_loss.py churn",
      description="Processes killed and started again on a schedule through a whole run.")
  parser.add_argument("--config", default="configs/digits.py")
  parser.add_argument("--algorithm", default="layup")
  parser.add_argument("--processes", type=int, default=3)
  parser.add_argument("--devices-per-process", type=int, default=2)
  parser.add_argument("--num-steps", type=int, required=True)
  parser.add_argument("--mtbf-s", type=float, required=True,
                      help="mean seconds between failures (exponential)")
  parser.add_argument("--restart-delay-s", type=float, default=2.0)
  parser.add_argument("--last-kill-at", type=float, default=0.85, help="fraction of the steps")
  parser.add_argument("--checkpoint-every", type=int, default=0,
                      help="steps between checkpoints (DDP resumes from the last; 0: at the end)")
  parser.add_argument("--seed", type=int, default=0, help="training seed and schedule seed")
  parser.add_argument("--progress-every-s", type=float, default=0.5)
  parser.add_argument("--heartbeat-timeout-s", type=int, default=5)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--no-uninterrupted", action="store_true")
  parser.add_argument("--timeout", type=float, default=7200)
  parser.add_argument("--out", default="churn.json")
  parser.add_argument("--stall-s", type=float, default=600,
                      help="end the drill when no process's step moves this long")
  args = parser.parse_args(argv)
  if args.mtbf_s <= 0 or args.processes < 2:
    parser.error("--mtbf-s must be > 0 and --processes >= 2")
  gossip = args.algorithm in ("layup", "layup_paper", "gosgd")
  drill = churn_gossip if gossip else churn_restarted
  stamp = provenance.stamp()  # the code that trains: commits during the drill change none
  rows = {}
  for kills in (False, True)[args.no_uninterrupted:]:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="churn_"))
    rows["churn" if kills else "uninterrupted"] = drill(args, workdir, kills)
    print(json.dumps({k: v for k, v in rows["churn" if kills else "uninterrupted"].items()
                      if k != "events"}))
    shutil.rmtree(workdir, ignore_errors=True)
  churned = rows["churn"]
  declared = [e["kill_to_declared_s"] for e in churned["events"]
              if e["kill_to_declared_s"] is not None]
  contributing = [e["restart_to_contributing_s"] for e in churned["events"]
                  if e["restart_to_contributing_s"] is not None]
  whole = rows.get("uninterrupted")
  summary = {"kills": churned["kills"], "kill_to_declared_s": _quantiles(declared),
             "restart_to_contributing_s": _quantiles(contributing),
             "samples_per_s_kept": (None if whole is None
                                    else round(whole["wall_s"] / churned["wall_s"], 3)),
             "final_accuracy": churned["final_accuracy"],
             "uninterrupted_accuracy": None if whole is None else whole["final_accuracy"],
             "weight_sums": [churned["weight_sum_min"], churned["weight_sum_max"]],
             "final_devices_in_average": churned["final_devices_in_average"]}
  print("\n| algorithm | MTBF s | kills | kill to declared p50 / p95 s | restart to contributing "
        "p50 / p95 s | samples/s kept | final accuracy (uninterrupted) | weight sums |")
  print("|---|---|---|---|---|---|---|---|")
  d, c = summary["kill_to_declared_s"], summary["restart_to_contributing_s"]
  print(f"| {args.algorithm} | {args.mtbf_s:g} | {summary['kills']} | {d['p50']} / {d['p95']} | "
        f"{c['p50']} / {c['p95']} | {summary['samples_per_s_kept']} | "
        f"{summary['final_accuracy']:.4f} ({summary['uninterrupted_accuracy']}) | "
        f"{summary['weight_sums']} |")
  with open(args.out, "w") as f:
    json.dump({**stamp, "args": vars(args), "summary": summary, "runs": rows}, f,
              indent=1)

# --- vanish ---------------------------------------------------------------------------------------


def _reached(metrics: pathlib.Path, step: int) -> bool:
  """Whether the run's metrics hold a test evaluation at `step` or later."""
  try:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
  except (OSError, ValueError):  # not written yet, or a line being written
    return False
  return any(r.get("split") == "test" and r.get("step", -1) >= step for r in rows)


def main_vanish(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="drill_process_loss.py vanish",
      description="A host that vanishes mid-run without closing its connections "
                  "(scripts/cluster_drill.sh, as root).")
  parser.add_argument("--steps", type=int, default=1500)
  parser.add_argument("--at", type=float, default=0.4, help="fraction of the steps")
  parser.add_argument("--rate", default="20mbit", help="every host's link (tc rate)")
  parser.add_argument("--slow", default="200kbit", help="host 2's link for 4 s before it goes")
  parser.add_argument("--workdir", default="runs/vanish")
  parser.add_argument("train", nargs="*", help="more train arguments, after --")
  args = parser.parse_args(argv)
  if os.geteuid() != 0:
    sys.exit("error: run as root: the drill creates network namespaces")
  workdir = pathlib.Path(args.workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  command = ["bash", "scripts/cluster_drill.sh", "--hosts", "3", "--devices-per-host", "2",
             "--rate", args.rate, "--",
             "--config", "configs/digits.py", "--workdir", str(workdir),
             "--config.num_devices=6", f"--config.num_steps={args.steps}",
             "--config.eval_every=60", "--config.progress_bar=False",
             "--config.distributed.heartbeat_timeout_s=5",
             "--config.distributed.remote_peer_probability=0.3", *args.train]
  started = time.monotonic()
  elapsed = lambda: f"{time.monotonic() - started:.1f} s"
  at = int(args.steps * args.at)
  with tempfile.TemporaryFile("w+") as log:
    # The drill starts $PYTHON (default: the interpreter running this script).
    drill = subprocess.Popen(command, cwd=ROOT, env={"PYTHON": sys.executable, **os.environ},
                             stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
      while not _reached(workdir / "metrics.jsonl", at):
        if drill.poll() is not None:
          log.seek(0)
          print(f"error: the run ended before step {at}\n{log.read()}")
          sys.exit(1)
        time.sleep(0.3)
      print(f"{elapsed()}: step >= {at}; host 2's link slowed to {args.slow} for 4 s")
      subprocess.run(["ip", "netns", "exec", "layup_host2", "tc", "qdisc", "change", "dev",
                      "layup_h2", "root", "tbf", "rate", args.slow, "burst", "16kb", "latency",
                      "20s"], check=False)
      time.sleep(4)  # transfers from host 2 in flight on its slow link
      print(f"{elapsed()}: host 2's link down, its process SIGKILLed")
      subprocess.run(["ip", "link", "set", "layup_b2", "down"], check=False)
      pids = subprocess.run(["ip", "netns", "pids", "layup_host2"], capture_output=True,
                            text=True, check=False).stdout.split()
      for pid in pids:
        with contextlib.suppress(ProcessLookupError):
          os.kill(int(pid), signal.SIGKILL)
      status = drill.wait()
    except KeyboardInterrupt:  # the drill removes its namespaces before this script stops
      drill.send_signal(signal.SIGINT)
      drill.wait()
      sys.exit(130)
    log.seek(0)
    lines = log.read().splitlines()
  print(f"{elapsed()}: the drill ended with status {status} (host 2's: 137 when the survivors "
        "ended with 0)")
  for line in lines:
    if "Extension modules" not in line and re.search(
        r"lost at step|in flight|layup on|error|did not stop|Traceback", line):
      print(line[:200])
  lost = sum("process 2 lost at step" in line for line in lines)
  if status == 137 and lost == 1 and (workdir / "summary.json").exists():
    print("vanish drill: the survivors trained to the end")
    return
  print(f"vanish drill: FAILED (status {status}, {lost} lost lines)")
  sys.exit(1)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return
  if not argv or argv[0] not in MODES:  # refused as argparse refuses: one line, status 2
    print(f"error: the first argument is a mode, one of {', '.join(MODES)} "
          f"(got {argv[0] if argv else 'none'}); see --help", file=sys.stderr)
    sys.exit(2)
  # A drill stopped with SIGTERM (kill, a scheduler's timeout) ends as one stopped by Ctrl-C:
  # its clean-up runs, so its training processes stop with it and churn's outputs are kept.
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  {"kill-resume": main_kill_resume, "elastic": main_elastic,
   "vanish": main_vanish, "churn": main_churn}[argv[0]](argv[1:])


if __name__ == "__main__":
  main()
