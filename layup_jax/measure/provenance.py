"""What a measurement was made with: the machine and the code, recorded beside every figure.

Benchmarks and sweeps write these into their JSON so that a results page can say which
hardware and which version of this code produced each number (runs of a sweep can be months
apart, and a speed-up in the runtime changes them).
"""

import datetime
import os
import pathlib
import platform
import subprocess

import jax

_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout: layup_jax/measure/ -> /


def code_version(root: pathlib.Path = _ROOT) -> str | None:
  """The commit of the checkout at `root` (this package's source tree), with `-dirty` where a
  tracked Python file differs from it (data and docs do not count); None outside a git checkout
  (an installed copy of the package, not a source tree, has no version here) and for a source
  tree that is not its checkout's top (an older tree exported into a folder of another
  checkout, as scripts/bench_gpu.sh measures one, would otherwise carry that checkout's
  commit)."""
  if not (root / "pyproject.toml").is_file():
    return None

  def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()
  try:
    top, commit = git("rev-parse", "--show-toplevel", "--short", "HEAD").splitlines()
    if pathlib.Path(top).resolve() != root.resolve():
      return None
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "*.py")
  except (OSError, subprocess.SubprocessError):
    return None
  return f"{commit}-dirty" if changed else commit or None


def machine() -> str:
  """The CPU architecture, core count, first device and jax version, in one line."""
  device = jax.devices()[0]
  return (f"{platform.machine()}, {os.cpu_count()} cores, {device.platform} devices "
          f"({device.device_kind}), jax {jax.__version__}")


def measured_on() -> str:
  """Today's date and `machine()`."""
  return f"{datetime.date.today().isoformat()}, {machine()}"


def stamp() -> dict[str, str | None]:
  """The fields a benchmark's JSON starts with: `measured` (`measured_on()`) and `code`
  (`code_version()`)."""
  return {"measured": measured_on(), "code": code_version()}
