"""The host's allocator (layup_jax/platform/allocator.py): a run starts again under TCMalloc or jemalloc
when one is installed, says how to get one when none is, and never loops."""

import os
import subprocess
import sys

import pytest

from layup_jax.measure import bench_options
from layup_jax.platform import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ExecCalled(Exception):
  pass


@pytest.fixture
def recorded_exec(monkeypatch):
  """os.execve recorded instead of run; the process seen as running on the system's malloc."""
  calls = []

  def execve(path, argv, env):
    calls.append((path, argv, env))
    raise ExecCalled

  monkeypatch.setattr(os, "execve", execve)
  monkeypatch.setattr(allocator, "in_use", lambda: "system")
  monkeypatch.delenv("LAYUP_JAX_ALLOCATOR_PRELOADED", raising=False)
  return calls


@pytest.mark.parametrize("mapped, expected", [
    ("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10",
     "tcmalloc"),
    ("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
    ("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6", "system"),
])
def test_the_allocator_in_use_is_read_from_the_libraries_the_process_mapped(tmp_path, mapped,
                                                                             expected):
  maps = tmp_path / "maps"
  maps.write_text(f"5600-5601 r-xp 00000000 08:01 1 /usr/bin/python3.11\n{mapped}\n")
  assert allocator.in_use(str(maps)) == expected


def test_the_benchmarks_offer_the_configs_choices():
  # The benchmarks' `--allocator` keeps its own copy: an older checkout they measure lacks one.
  assert bench_options.CHOICES == allocator.CHOICES


def test_the_allocator_is_preloaded_before_what_the_user_preloads():
  env = allocator.preload_environment("tcmalloc", "libtcmalloc_minimal.so.4",
                                      {"LD_PRELOAD": "libmine.so", "PATH": "/bin"})
  assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libmine.so"
  assert env["PATH"] == "/bin"
  assert env["LAYUP_JAX_ALLOCATOR_PRELOADED"] == "tcmalloc"
  assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # a model's buffers: quiet
  mine = allocator.preload_environment("tcmalloc", "lib.so",
                                       {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "1000"})
  assert mine["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "1000"  # the user's setting wins
  assert "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" not in allocator.preload_environment(
      "jemalloc", "libjemalloc.so.2", {})


def test_an_allocator_on_the_library_path_is_found_before_the_system_one(tmp_path, monkeypatch):
  (tmp_path / "libjemalloc.so.2").write_bytes(b"")
  monkeypatch.setenv("LD_LIBRARY_PATH", f"/nonexistent:{tmp_path}")
  assert allocator.library("jemalloc") == str(tmp_path / "libjemalloc.so.2")
  monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent")
  assert allocator.library("jemalloc") != str(tmp_path / "libjemalloc.so.2")


def test_auto_starts_the_same_command_again_under_the_first_allocator_found(recorded_exec,
                                                                           monkeypatch):
  found = {"tcmalloc": None, "jemalloc": "libjemalloc.so.2"}
  monkeypatch.setattr(allocator, "library", found.get)
  with pytest.raises(ExecCalled):
    allocator.use("auto", ["-m", "layup_jax.train", "--config", "configs/digits.py"])
  [(path, argv, env)] = recorded_exec
  assert path == sys.executable
  assert argv == [sys.executable, "-m", "layup_jax.train", "--config", "configs/digits.py"]
  assert env["LD_PRELOAD"].split()[0] == "libjemalloc.so.2"


def test_nothing_is_started_again_for_system_or_when_none_is_installed(recorded_exec, monkeypatch):
  monkeypatch.setattr(allocator, "library", lambda name: None)
  assert allocator.use("system", ["-c", "pass"]) is None
  note = allocator.use("auto", ["-c", "pass"])
  assert "apt-get install libtcmalloc-minimal4" in note and "\n" not in note
  with pytest.raises(ValueError, match="apt-get install libjemalloc2"):
    allocator.use("jemalloc", ["-c", "pass"])
  with pytest.raises(ValueError, match="must be one of auto, tcmalloc, jemalloc, system"):
    allocator.use("mimalloc", ["-c", "pass"])
  assert recorded_exec == []


def test_a_process_started_again_that_still_runs_on_malloc_does_not_loop(recorded_exec,
                                                                        monkeypatch):
  monkeypatch.setattr(allocator, "library", lambda name: "libtcmalloc_minimal.so.4")
  monkeypatch.setenv("LAYUP_JAX_ALLOCATOR_PRELOADED", "tcmalloc")
  note = allocator.use("auto", ["-c", "pass"])
  assert "tcmalloc was preloaded but is not in use" in note
  assert recorded_exec == []


@pytest.mark.skipif(allocator.library("tcmalloc") is None,
                    reason="TCMalloc is not installed (apt-get install libtcmalloc-minimal4)")
def test_a_process_started_on_malloc_runs_under_tcmalloc_after_use():
  script = ("import sys; from layup_jax.platform import allocator; "
            "print(allocator.in_use(), flush=True); allocator.use('auto')")
  env = {k: v for k, v in os.environ.items()
         if k not in ("LD_PRELOAD", "LAYUP_JAX_ALLOCATOR_PRELOADED")}
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=60, check=True, cwd=ROOT, env=env)
  # The first process prints "system" and starts again; the second runs under TCMalloc and
  # returns from `use` without starting a third.
  assert done.stdout.split() == ["system", "tcmalloc"], done.stdout + done.stderr
