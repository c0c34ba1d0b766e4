"""The runner end to end: records a user can plot, for both algorithms; a signal saves and stops."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from layup_jax import defaults
from layup_jax.run import runner
from layup_jax.run.records import read_metrics
from tests.helpers import tensorboard_scalars

EVAL_KEYS = {"step", "time_s", "split", "loss", "accuracy", "device0_loss", "device0_accuracy",
             "consensus_distance", "weight_sum_min", "weight_sum_max", "devices_in_average"}
SUMMARY_KEYS = {"algorithm", "num_devices", "final_eval_accuracy", "final_eval_loss",
                "wall_time_s", "train_samples_per_s", "consensus_distance"}


@pytest.mark.parametrize("algorithm", ["layup", "ddp"])
def test_a_run_writes_metrics_and_summary_and_learns(tiny_config, tmp_path, algorithm):
  tiny_config.algorithm = algorithm
  tiny_config.num_devices = 4
  tiny_config.model.granularity = defaults.get_config().model.granularity  # the default's stages
  summary = runner.run(tiny_config, tmp_path)
  records = read_metrics(tmp_path)
  test_records = [r for r in records if r["split"] == "test"]
  assert [r["step"] for r in test_records] == [0, 10, 20]
  assert all(EVAL_KEYS <= set(r) for r in test_records)
  assert [r["step"] for r in records if r["split"] == "train"] == [10, 20]
  assert test_records[-1]["loss"] < test_records[0]["loss"]
  assert SUMMARY_KEYS <= set(json.loads((tmp_path / "summary.json").read_text()))
  assert summary["final_eval_accuracy"] == test_records[-1]["accuracy"]
  assert summary["train_samples_per_s"] > 0
  for key in ("weight_sum_min", "weight_sum_max"):  # per stage, the push-sum weights sum to 1
    assert test_records[-1][key] == pytest.approx(1.0, abs=1e-12)
  # The same records as TensorBoard scalars.
  events = tensorboard_scalars(tmp_path / "tensorboard")
  assert events["test/accuracy"] == [(r["step"], pytest.approx(r["accuracy"]))
                                     for r in test_records]
  assert [step for step, _ in events["train/device_samples_per_s/3"]] == [10, 20]


def test_progress_over_time_is_written_when_asked(tiny_config, tmp_path):
  """`metrics.progress_every_s`: this process's iterations over wall time, growing to the end."""
  tiny_config.num_devices = 4
  tiny_config.metrics.progress_every_s = 1e-6
  runner.run(tiny_config, tmp_path)
  rows = [json.loads(line) for line in
          (tmp_path / "progress" / "process_0.jsonl").read_text().splitlines()]
  assert len(rows) >= 2
  assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
  assert [r["iterations"] for r in rows] == sorted(r["iterations"] for r in rows)
  assert rows[-1]["iterations"] == 20 * 4 and rows[-1]["step"] == 20


def test_a_run_stopping_at_its_target_ends_at_the_first_evaluation_reaching_it(
    tiny_config, tmp_path):
  # Time-to-target runs (`metrics.stop_at_target`): a run ends at the first evaluation that
  # reaches the target, with a summary and a checkpoint there; one that never reaches it trains
  # its whole schedule. DDP on CPU is deterministic: the runs agree up to where one ends.
  tiny_config.algorithm, tiny_config.num_devices, tiny_config.eval_every = "ddp", 2, 5
  runner.run(tiny_config, tmp_path / "whole")
  accuracy = {r["step"]: r["accuracy"] for r in read_metrics(tmp_path / "whole")
              if r["split"] == "test"}
  target = max(accuracy[step] for step in (5, 10, 15, 20))
  assert target > accuracy[0]  # reached by training, not at the start
  end = min(step for step in (5, 10, 15, 20) if accuracy[step] >= target)
  for goal, last in ((target, end), (1.0001, 20)):
    tiny_config.metrics.target_accuracy, tiny_config.metrics.stop_at_target = goal, True
    workdir = tmp_path / f"target{goal}"
    summary = runner.run(tiny_config, workdir)
    test_steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "test"]
    assert test_steps == list(range(0, last + 1, 5))
    assert summary["stopped_at_target"] == (goal == target)
    assert summary["target_step"] == (end if goal == target else None)
    assert json.loads((workdir / "summary.json").read_text())["stopped_at_target"] == (
        goal == target)
    assert (workdir / "checkpoints" / str(last)).is_dir()  # the model where the run ended


STOP_GUARD_S = 120


def _trained_steps(progress) -> int:
  """The latest step a run's progress log shows (0 while it has none)."""
  if not progress.exists():
    return 0
  lines = progress.read_text().splitlines()
  return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def _train_command(workdir, num_steps):
  return [sys.executable, "-m", "layup_jax.train", "--config", "configs/digits.py",
          "--config.model.widths=(4,8,8)", "--config.num_devices=2",
          f"--config.num_steps={num_steps}", "--config.eval_every=0",
          "--config.progress_bar=False", f"--workdir={workdir}"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_exits_0(tmp_path, signum):
  # Preemption (SIGTERM) or a terminal's Ctrl-C (SIGINT), in the middle of training: sent once
  # the run's progress log shows trained steps.
  process = subprocess.Popen(
      [*_train_command(tmp_path, 100000), "--config.metrics.progress_every_s=0.05"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT dumps every stack
  )
  progress = tmp_path / "progress" / "process_0.jsonl"
  deadline = time.monotonic() + 240
  while not _trained_steps(progress) and time.monotonic() < deadline:
    assert process.poll() is None, process.communicate(timeout=5)
    time.sleep(0.05)
  assert _trained_steps(progress), process.communicate(timeout=5)
  process.send_signal(signum)
  try:  # (a guard against a hang, not a speed claim)
    stdout, stderr = process.communicate(timeout=STOP_GUARD_S)
  except subprocess.TimeoutExpired:
    process.send_signal(signal.SIGABRT)
    _, stderr = process.communicate(timeout=30)
    pytest.fail(f"the run did not stop within {STOP_GUARD_S} s of the signal; its threads:\n"
                f"{stderr[-8000:]}")
  assert process.returncode == 0, stderr[-3000:]
  saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and saved[0] > 0
  assert f"stopped by {signal.Signals(signum).name} at step {saved[0]}" in stdout
  if signum != signal.SIGTERM:
    return
  # Resumed (to a nearer end than the first command's, to keep the test short).
  resumed = subprocess.run(_train_command(tmp_path, saved[0] + 10), capture_output=True,
                           text=True, timeout=300, check=False)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from the checkpoint {tmp_path}/checkpoints/{saved[0]}" in resumed.stderr
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["resumed_from_step"] == saved[0] and summary["num_steps"] == saved[0] + 10


def test_a_run_that_fails_ends_with_its_own_error_when_closing_fails_too(tiny_config, tmp_path,
                                                                        monkeypatch, capsys):
  """A restarted process that was not given its share fails (RejoinError); its receiver thread,
  blocked on a peer that is gone, then made the close fail as well, and that error had been the
  process's last line. The run's error is what it ends with; the close's is a note."""
  from layup_jax.errors import RejoinError

  class Failing:
    def __init__(self, config, workdir):
      pass

    def restore(self):
      raise RejoinError("no live device gave this process its share within 120 s")

    def close(self):
      raise RuntimeError("threads did not stop: ['layup-receiver-1']")

  monkeypatch.setattr(runner, "Session", Failing)
  with pytest.raises(RejoinError, match="its share"):
    runner.run(tiny_config, tmp_path)
  assert "closing the failed run also failed (threads did not stop" in capsys.readouterr().err
