"""`scripts/bench_host.py`: `--split-cores` (layup_jax/measure/bench_options.py) puts the
devices' work on one CPU and the dispatching on the others, so that the host's figure is
measured as on a host whose devices are not its CPUs; the runtime's host-side settings a row
names are the ones its runtime runs with; each mode takes its own options."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench_host():
  spec = importlib.util.spec_from_file_location("script_bench_host",
                                                ROOT / "scripts" / "bench_host.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module

# A fresh process (no JAX backend yet): split, run one program per device, then start a thread
# as the runtime starts its own, and report where every thread may run.
_PROBE = r"""
import json, os, sys, threading
import jax, numpy as np
from layup_jax.measure import bench_options
devices_cpus, host_cpus = bench_options.split_cores()
jax.block_until_ready([jax.device_put(np.ones(4096, np.float32), d).sum() for d in jax.devices()])
seen = {}
def runtime_like():
  seen["started"] = sorted(os.sched_getaffinity(0))
thread = threading.Thread(target=runtime_like)
thread.start(); thread.join()
xla = sorted({cpus for name, cpus in bench_options.thread_affinities().values()
              if "XLA" in name or "Eigen" in name})
print(json.dumps({"devices": sorted(devices_cpus), "host": sorted(host_cpus),
                  "main": sorted(os.sched_getaffinity(0)), "started": seen["started"],
                  "xla": xla}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_split_cores_keeps_xlas_threads_off_the_cpus_that_dispatch():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, timeout=300,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(result.stdout.strip().splitlines()[-1])
  allowed = sorted(os.sched_getaffinity(0))
  assert got["devices"] == allowed[:1] and got["host"] == allowed[1:]
  # The calling thread and every thread it starts later (the dispatcher, the updater) dispatch
  # on the host's CPUs only; XLA's worker threads were started on the devices' CPU.
  assert got["main"] == got["started"] == allowed[1:]
  assert got["xla"] == [str(allowed[0])]


@pytest.mark.parametrize("updater_thread, pin, chain, fuse", [
    (False, "on", True, False), (True, "off", False, True)])
def test_a_rows_runtime_settings_are_the_runs(updater_thread, pin, chain, fuse):
  # They sit in `tuning` (once `layup`): a row must not say "off" while its runtime ran "on".
  config = _bench_host().bench_config("layup", 8, fuse, updater_thread, pin, chain)
  assert (config.tuning.updater_thread, config.tuning.pin_host_threads,
          config.tuning.chain_forwards, config.tuning.fuse_local_step) == (
              updater_thread, pin, chain, fuse)


def _main(argv: list[str]) -> int:
  """`bench_host.py ARGV`'s exit status (argparse's: 0 after --help, 2 for a bad option)."""
  try:
    _bench_host().main(argv)
  except SystemExit as done:
    return done.code
  return 0


@pytest.mark.parametrize("argv, option", [
    (["--help"], "dispatch"),  # the modes, listed
    (["iteration", "--help"], "--stages-per-group"),
    (["dispatch", "--help"], "--inputs-ready"),
    (["runtime", "--help"], "--gossip-cases"),
    (["profile", "--help"], "--no-gossip"),
])
def test_each_mode_takes_its_own_options(capsys, argv, option):
  assert _main(argv) == 0
  assert option in capsys.readouterr().out


def test_without_a_mode_the_options_are_the_host_time_per_iteration(capsys):
  assert _main(["--cases", "digits", "--inputs-ready"]) == 2  # a dispatch option
  assert "unrecognized arguments: --inputs-ready" in capsys.readouterr().err
