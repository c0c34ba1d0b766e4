"""`scripts/bench_host.py --split-cores`: the devices' work on one CPU, the dispatching on the
others, so that the host's figure is measured as on a host whose devices are not its CPUs."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A fresh process (no JAX backend yet): split, run one program per device, then start a thread
# as the runtime starts its own, and report where every thread may run.
_PROBE = r"""
import json, os, sys, threading
sys.path.insert(0, "scripts")
import bench_host, jax, numpy as np
devices_cpus, host_cpus = bench_host.split_cores()
jax.block_until_ready([jax.device_put(np.ones(4096, np.float32), d).sum() for d in jax.devices()])
seen = {}
def runtime_like():
  seen["started"] = sorted(os.sched_getaffinity(0))
thread = threading.Thread(target=runtime_like)
thread.start(); thread.join()
xla = sorted({cpus for name, cpus in bench_host.thread_affinities().values()
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
