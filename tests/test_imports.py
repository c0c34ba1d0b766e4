"""Imports run one way: every module of the package imports on its own, first, in a fresh process."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One process imports the third-party libraries once, forgets every module of this project, and
# forks a child per module that imports that module first: a cycle inside the project (a module
# that only imports when another one was imported before it) fails in its child.
_PROBE = r"""
import importlib, json, os, pkgutil, sys, traceback
import layup_jax
names = sorted(m.name for m in pkgutil.walk_packages(layup_jax.__path__, "layup_jax.")
               if not m.name.endswith("__main__"))
for name in names:
  importlib.import_module(name)
own = [m for m in sys.modules if m.split(".")[0] in ("layup_jax", "configs")]
for m in own:
  del sys.modules[m]
failed = []
for name in names:
  pid = os.fork()
  if pid == 0:
    try:
      importlib.import_module(name)
    except BaseException:
      traceback.print_exc()
      os._exit(1)
    os._exit(0)
  _, status = os.waitpid(pid, 0)
  if status:
    failed.append(name)
print(json.dumps({"modules": names, "failed": failed}))
"""


def test_every_module_imports_on_its_own():
  result = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert "layup_jax.runtime" in report["modules"] and len(report["modules"]) >= 30
  assert report["failed"] == [], result.stderr[-3000:]
