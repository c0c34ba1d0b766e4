"""Two restarts waiting at once (docs/records/elastic.md, "The churn stall found"): LayUp on the
digits, 3 processes x 2 CPU devices, the coordinator in a process of its own. After the test
record at KILL_AT, processes 1 and 2 are killed together; 2 is started again 2 s later and 1
GAP s after it, so that both ask to rejoin before the next consistent point. Prints whether the
run wrote its summary within 900 s; every start's output is in WORKDIR.

    python docs/records/data/two_restarts_probe.py WORKDIR [NUM_STEPS]
        (environment: EVERY=300 the evaluation interval, KILL_AT=300, GAP=8)
"""

import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from layup_jax.launch import commands, coordinator_command, environment, free_port  # noqa: E402


def main() -> None:
  work = pathlib.Path(sys.argv[1])
  work.mkdir(parents=True, exist_ok=True)
  steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
  every, kill_at = int(os.environ.get("EVERY", 300)), int(os.environ.get("KILL_AT", 300))
  gap = float(os.environ.get("GAP", 8))
  args = ["--config", str(ROOT / "configs/digits.py:layup"), "--workdir", str(work / "run"),
          "--config.num_devices=6", f"--config.num_steps={steps}", "--config.progress_bar=False",
          f"--config.eval_every={every}", "--config.model.granularity=per_block",
          "--config.checkpoint.every=0", "--config.metrics.progress_every_s=0.5",
          "--config.distributed.heartbeat_timeout_s=5"]
  env, port = environment(2), free_port()
  train = commands(3, port, args, external_coordinator=True)
  coordinator = subprocess.Popen(coordinator_command(3, port), cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  started: list[subprocess.Popen] = []

  def start(k: int) -> subprocess.Popen:
    with (work / f"start{len(started)}_process{k}.log").open("w") as log:
      started.append(subprocess.Popen(train[k], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return started[-1]

  def tested_at(step: int) -> bool:
    metrics = work / "run/metrics.jsonl"
    return metrics.exists() and any(
        r["split"] == "test" and r["step"] >= step for r in map(json.loads, metrics.open()))

  try:
    first = [start(k) for k in range(3)]
    while not tested_at(kill_at):
      assert first[0].poll() is None, "process 0 ended"
      time.sleep(0.5)
    print("killing processes 1 and 2", time.strftime("%T"), flush=True)
    first[1].kill()
    first[2].kill()
    time.sleep(2)
    start(2)
    time.sleep(gap)
    start(1)
    deadline = time.time() + 900
    while not (work / "run/summary.json").exists() and time.time() < deadline:
      time.sleep(2)
    print("summary written:", (work / "run/summary.json").exists(), time.strftime("%T"))
  finally:
    time.sleep(5)  # the processes' own ends, where the run finished
    for process in [*started, coordinator]:
      process.kill()


if __name__ == "__main__":
  main()
