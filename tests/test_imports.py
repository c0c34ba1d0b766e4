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
  assert "layup_jax.runtime.engine" in report["modules"] and len(report["modules"]) >= 60
  assert report["failed"] == [], result.stderr[-3000:]


# Which packages each package may import (its `__init__` docstring says the same): a DAG, so
# imports run one way and no cycle can form between packages. Top-level modules are their own
# entries; `defaults` is the schema of the config, imported by what reads a config's keys.
_MAY_IMPORT = {
    "errors": set(), "optim": set(), "platform": {"errors"}, "pushsum": set(),
    "defaults": {"errors"},
    "models": {"defaults"}, "data": {"errors"}, "measure": {"models", "platform"},
    "multiprocess": {"errors", "platform"},
    "checkpoint": {"errors", "platform", "multiprocess", "defaults"},
    "runtime": {"errors", "platform", "pushsum", "models", "data", "measure", "multiprocess",
                "checkpoint", "defaults"},
    "algorithms": {"errors", "optim", "platform", "pushsum", "models", "data", "measure",
                   "multiprocess", "checkpoint", "runtime"},
    "run": {"errors", "optim", "platform", "pushsum", "models", "data", "measure",
            "multiprocess", "checkpoint", "runtime", "algorithms", "defaults"},
    "train": {"errors", "platform", "multiprocess", "checkpoint", "algorithms", "run",
              "defaults"},
    "launch": set(),
    "export": {"errors", "optim", "models", "data", "checkpoint", "algorithms", "run"},
}


def _package_imports() -> dict[str, set[str]]:
  """{package or top-level module: the project's packages and modules it imports}, read from
  the source (every import, at module level or inside a function)."""
  import ast

  found: dict[str, set[str]] = {}
  for path in sorted((ROOT / "layup_jax").rglob("*.py")):
    parts = path.relative_to(ROOT / "layup_jax").with_suffix("").parts
    if parts == ("__init__",):
      continue
    me = parts[0]
    imported = found.setdefault(me, set())
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
               else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
      for name in names:
        head, *rest = name.split(".")
        if head == "layup_jax" and rest:
          imported.add(rest[0])
        elif head == "layup_jax" and isinstance(node, ast.ImportFrom):
          imported.update(a.name for a in node.names)
    imported.discard(me)
  return found


def test_the_package_root_is_the_api_and_imports_jax_only_when_used():
  """`import layup_jax` gives the API a user's script needs (`layup_jax.train` the function,
  not the command's module) without importing JAX, so XLA flags set afterwards still count."""
  probe = ("import sys, inspect, layup_jax\n"
           "assert 'jax' not in sys.modules\n"
           "assert inspect.isfunction(layup_jax.train)\n"
           "assert 'jax' not in sys.modules\n"
           "names = {n: callable(getattr(layup_jax, n)) for n in layup_jax.__all__}\n"
           "print(sorted(names), all(names.values()), layup_jax.get_config().algorithm)")
  result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  names, all_callable, algorithm = result.stdout.rsplit(None, 2)
  assert {"train", "get_config", "load_config", "register_model", "register_data",
          "export_model", "load_model", "StagedModel"} <= set(eval(names))  # noqa: S307
  assert all_callable == "True" and algorithm == "layup"


def test_packages_import_only_the_packages_below_them():
  found = _package_imports()
  assert set(found) == set(_MAY_IMPORT), "a package or top-level module is missing from the map"
  assert {me: sorted(imported - _MAY_IMPORT[me]) for me, imported in found.items()
          if imported - _MAY_IMPORT[me]} == {}


def test_the_allowed_imports_have_no_cycle():
  order = []

  def visit(package, path=()):
    assert package not in path, f"import cycle: {' -> '.join(path + (package,))}"
    if package in order:
      return
    for below in sorted(_MAY_IMPORT[package]):
      visit(below, path + (package,))
    order.append(package)

  for package in sorted(_MAY_IMPORT):
    visit(package)
  assert len(order) == len(_MAY_IMPORT)


def test_the_library_imports_nothing_from_configs():
  """configs/ holds experiments: no module of the package imports it, so a user's own
  configs/ (say, a configs/base.py of their own) cannot shadow the library's defaults."""
  import ast

  importers = []
  for path in sorted((ROOT / "layup_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
               else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
      if any(name.split(".")[0] == "configs" for name in names):
        importers.append(str(path.relative_to(ROOT)))
  assert importers == []


def test_a_folder_with_its_own_configs_package_trains_as_usual(tmp_path):
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "__init__.py").write_text("")
  (tmp_path / "configs" / "base.py").write_text("raise ImportError('not the library')\n")
  done = subprocess.run(
      [sys.executable, "-m", "layup_jax.train", "--config", str(ROOT / "configs" / "digits.py"),
       "--workdir", str(tmp_path / "run"), "--config.num_steps=2", "--config.eval_every=0",
       "--config.checkpoint.enabled=False", "--config.progress_bar=False"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
      env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["num_steps"] == 2


def test_the_wheel_installs_the_package_and_no_top_level_configs(tmp_path):
  import zipfile

  done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q",
                         "-w", str(tmp_path)], capture_output=True, text=True, timeout=600,
                        check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  (wheel,) = tmp_path.glob("layup_jax-*.whl")
  tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
  assert "layup_jax" in tops and "configs" not in tops
  assert {t for t in tops if not t.startswith("layup_jax")} == set(), tops
