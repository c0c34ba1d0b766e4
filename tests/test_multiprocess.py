"""Several processes as one run, on JAX's distributed runtime: 2 processes x 4 CPU devices on
127.0.0.1 against one process with 8 devices."""

import pathlib
import subprocess
import sys

import pytest

from configs import base
from layup_jax import distributed, runner
from layup_jax.errors import ConfigError
from layup_jax.launch import commands, environment
from layup_jax.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _overrides(settings: dict) -> list[str]:
  return [f"--config.{key}={value}" for key, value in settings.items()]


def _launch(workdir, overrides: dict, processes=2, timeout=420) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "layup_jax.launch", "--processes", str(processes),
       "--devices-per-process", str(8 // processes), "--", "--config", "configs/digits.py",
       "--workdir", str(workdir), *_overrides(overrides)],
      cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _losses(workdir) -> list[tuple[int, str, float]]:
  return [(r["step"], r["split"], r["loss"]) for r in read_metrics(workdir)]


def test_ddp_across_two_processes_takes_the_steps_of_one_process_with_eight_devices(tmp_path):
  settings = {"algorithm": "ddp", "model.widths": "(4,8,8)", "num_steps": 12, "eval_every": 6,
              "checkpoint.enabled": False, "progress_bar": False}
  launched = _launch(tmp_path / "two", settings)
  assert launched.returncode == 0, launched.stdout[-3000:]
  config = base.get_config()
  base.set_values(config, {**settings, "model.widths": (4, 8, 8)})
  runner.run(config, tmp_path / "one")
  two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
  assert [(s, k) for s, k, _ in two] == [(s, k) for s, k, _ in one]
  assert len(one) == 5  # the evaluation at 0, then train and test records at 6 and 12
  for (_, _, a), (_, _, b) in zip(two, one, strict=True):
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_the_launcher_gives_each_process_its_place_and_its_devices():
  first, second = commands(2, 12355, ["--config", "configs/digits.py"])
  assert first[-3:] == ["--config.distributed.coordinator_address=127.0.0.1:12355",
                        "--config.distributed.num_processes=2",
                        "--config.distributed.process_id=0"]
  assert second[-1] == "--config.distributed.process_id=1"
  flags = environment(4)["XLA_FLAGS"].split()
  assert flags.count("--xla_force_host_platform_device_count=4") == 1
  assert not any(f.endswith("=8") for f in flags)


@pytest.mark.parametrize("keys, message", [
    ({"num_processes": 2}, "need config.distributed.coordinator_address"),
    ({"coordinator_address": "node0"}, "host:port of process 0"),
    ({"coordinator_address": "node0:1234", "num_processes": 2, "process_id": 2},
     "process_id=2 must be in [0, num_processes=2)"),
])
def test_a_bad_distributed_setting_is_one_line(keys, message):
  config = base.get_config().distributed
  base.set_values(config, keys)
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")):
    distributed.settings(config)


def test_no_coordinator_is_a_single_process_run():
  assert distributed.settings(base.get_config().distributed) is None
  assert distributed.initialize(base.get_config().distributed) is False
