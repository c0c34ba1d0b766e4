"""`scripts/bench_train.py --split-cores`: the user's command run with the devices' work on one
CPU and the rest of the run on the others, under the allocator the command itself would pick."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_train

from layup_jax.platform import allocator

# Stands for `layup_jax.train`: runs one program per device, starts a thread as the runtime
# starts its own, and reports where every thread may run and what it was given.
_PROBE = r"""
import json, os, sys, threading
import jax, numpy as np
from layup_jax.measure import bench_options
from layup_jax.platform import allocator
jax.block_until_ready([jax.device_put(np.ones(4096, np.float32), d).sum() for d in jax.devices()])
seen = {}
thread = threading.Thread(target=lambda: seen.update(cpus=sorted(os.sched_getaffinity(0))))
thread.start(); thread.join()
xla = sorted({cpus for name, cpus in bench_options.thread_affinities().values()
              if "XLA" in name or "Eigen" in name})
print(json.dumps({"argv": sys.argv[1:], "main": sorted(os.sched_getaffinity(0)),
                  "started": seen["cpus"], "xla": xla, "devices": len(jax.devices()),
                  "allocator": allocator.in_use()}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_a_split_run_dispatches_off_the_devices_cpu_under_the_commands_allocator(tmp_path):
  (tmp_path / "split_probe.py").write_text(_PROBE)  # a module, as layup_jax.train is
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
  command = bench_train.command_for(["split_probe", "--workdir", "w", "--config.seed=3"],
                                    split_cores=True)
  result = subprocess.run(command, cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"}, timeout=300,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(result.stdout.strip().splitlines()[-1])
  allowed = sorted(os.sched_getaffinity(0))
  assert got["argv"] == ["--workdir", "w", "--config.seed=3"]
  assert got["devices"] == 8  # the command's own default of fake devices
  assert got["main"] == got["started"] == allowed[1:]
  assert got["xla"] == [str(allowed[0])]
  expected = "tcmalloc" if allocator.library("tcmalloc") else (
      "jemalloc" if allocator.library("jemalloc") else "system")
  assert got["allocator"] == expected

