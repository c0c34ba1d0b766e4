"""scripts/cluster_drill.sh: its refusals, the environment it hands each process, and that it
leaves nothing behind (after a normal exit, a failing process, SIGINT or SIGTERM mid-run, a host
whose link went down, and scripts/bench_cluster.py interrupted mid-run).

The training command is replaced by a stand-in (`PYTHON=...`, which the drill starts as
`$PYTHON -m layup_jax.train ...`), so that each drill takes about a second. Everything past the
option checks creates network namespaces: those tests need root and iproute2, and run one at a
time across processes (a file lock: the namespaces' names are fixed).
"""

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRILL = ["bash", "scripts/cluster_drill.sh"]
# For a stand-in to start, or a drill to end: a guard against a hang, not a speed bound (a drill
# stopped mid-run once took over 30 s to end beside the suite's multi-process tests, 2026-12-04).
DEADLINE_S = 120

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="cluster_drill.sh creates network namespaces: needs root and iproute2 (ip)")
needs_tc = pytest.mark.skipif(shutil.which("tc") is None, reason="--rate needs tc (iproute2)")


def _environment(**extra) -> dict:
  """The test process's environment without its XLA_FLAGS, with `extra` (None: left out)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update({k: v for k, v in extra.items() if v is not None})
  return env


def _stand_in(folder: pathlib.Path, name: str, body: str) -> str:
  """An executable bash script standing in for `python` (the drill runs it with `-m
  layup_jax.train <arguments>`, the last of them `--config.distributed.process_id=K`)."""
  path = folder / name
  path.write_text("#!/bin/bash\n" + body + "\n")
  path.chmod(0o755)
  return str(path)


def _drill(args: list[str], env: dict, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run([*DRILL, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=120, check=False, **kwargs)


def _left_over() -> list[str]:
  """What a drill left behind: layup_host* namespaces, layup_* links, /etc/netns entries."""
  namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=False).stdout
  links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=False).stdout
  found = [word.split("@")[0].rstrip(":") for word in (namespaces + links).split()
           if word.startswith("layup_")]
  if os.path.isdir("/etc/netns"):
    found += [f"/etc/netns/{name}" for name in os.listdir("/etc/netns")
              if name.startswith("layup_")]
  return sorted(set(found))


# Prefixed to a command that a test interrupts: SIGINT at its default disposition, then the
# command. A process started in the background by a non-interactive shell (`pytest ... &`)
# ignores SIGINT, its children inherit that, and neither bash nor Python can trap a signal
# ignored at its start: the interrupt tests would then measure how the suite was started (a
# drill ignoring Ctrl-C ran its stand-ins to their end), not the drill. (An exec, not a
# `preexec_fn`: a fork of the test's process, which JAX's threads share, may deadlock.)
INTERRUPTIBLE = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                 "signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"]


def _wait_for(path: pathlib.Path, process: subprocess.Popen | None = None) -> None:
  """Polls until `path` exists (a stand-in started), failing at the deadline or when `process`
  ended first."""
  deadline = time.monotonic() + DEADLINE_S
  while not path.exists():
    if process is not None and process.poll() is not None:
      raise AssertionError(f"ended with status {process.returncode} before {path} appeared")
    assert time.monotonic() < deadline, f"{path} did not appear within {DEADLINE_S} s"
    time.sleep(0.05)


@pytest.fixture
def netns(tmp_path):
  """One drill at a time on this machine (across pytest workers and sessions), and a check
  that nothing of it is left once the test is over."""
  lock_path = os.path.join(tempfile.gettempdir(), "layup_cluster_drill_test.lock")
  with open(lock_path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    before = _left_over()
    assert before == [], f"a drill's leftovers before the test: {before}"
    yield tmp_path
    assert _left_over() == [], "the drill left these behind"


# --- refusals: before any namespace exists, so no root needed ----------------------------------

@pytest.mark.parametrize("args, why", [
    (["--bogus"], "unknown option --bogus"),
    (["--hosts"], "--hosts takes a value"),
    (["--hosts", "1", "--devices-per-host", "1", "--", "x"], "--hosts takes 2 to 32"),
    (["--hosts", "two", "--devices-per-host", "1", "--", "x"], "--hosts takes 2 to 32"),
    (["--hosts", "2", "--devices-per-host", "0", "--", "x"],
     "--devices-per-host takes a positive number"),
    (["--hosts", "2", "--devices-per-host", "1", "--rate", "0.0.1mbit", "--", "x"],
     "--rate takes a tc rate"),
    (["--hosts", "2", "--devices-per-host", "1"], "give the train arguments after --"),
])
def test_a_refusal_exits_2_with_one_line_on_stderr_naming_why(tmp_path, args, why):
  started = tmp_path / "started"
  python = _stand_in(tmp_path, "python", f'touch "{started}"')
  result = _drill(args, _environment(PYTHON=python))
  assert result.returncode == 2
  assert len(result.stderr.splitlines()) == 1, result.stderr
  assert result.stderr.startswith("error: ") and why in result.stderr, result.stderr
  assert not started.exists()


@pytest.mark.skipif(shutil.which("taskset") is None or not hasattr(os, "sched_getaffinity"),
                    reason="--cpus-per-host needs taskset")
def test_more_cpus_per_host_than_there_are_is_refused_in_one_line(tmp_path):
  result = _drill(["--hosts", "2", "--devices-per-host", "1", "--cpus-per-host", "100000",
                   "--", "x"], _environment(PYTHON=_stand_in(tmp_path, "python", "exit 0")))
  assert result.returncode == 2
  assert result.stderr.splitlines() == [
      f"error: --hosts 2 x --cpus-per-host 100000 needs 200000 CPUs; this script may use "
      f"{len(os.sched_getaffinity(0))}"]


@pytest.mark.skipif(os.geteuid() == 0, reason="a refusal for a user other than root")
def test_a_user_other_than_root_is_refused_in_one_line(tmp_path):
  result = _drill(["--hosts", "2", "--devices-per-host", "1", "--", "x"],
                  _environment(PYTHON=_stand_in(tmp_path, "python", "exit 0")))
  assert result.returncode == 2
  assert result.stderr.splitlines() == [
      "error: run as root: the drill creates network namespaces"]


# --- with network namespaces (root) --------------------------------------------------------------

@needs_netns
@pytest.mark.parametrize("xla_flags, kept", [
    ("--xla_force_host_platform_device_count=8", ""),  # only the count: it once ended the drill
    (None, ""),  # unset
    ("", ""),
    ("--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8 "
     "--xla_dump_to=/tmp/x", "--xla_cpu_enable_fast_math=false --xla_dump_to=/tmp/x "),
])
def test_each_process_starts_with_its_own_device_count_whatever_the_xla_flags(netns, xla_flags,
                                                                              kept):
  record = netns / "record"
  python = _stand_in(netns, "python", f'''
printf '%s\\n' "$XLA_FLAGS" "$@" > "{record}.${{@: -1}}"''')
  result = _drill(["--hosts", "2", "--devices-per-host", "4", "--", "--config", "c.py",
                   "--workdir", "w"], _environment(PYTHON=python, XLA_FLAGS=xla_flags))
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""
  for k in range(2):
    flags, *argv = pathlib.Path(
        f"{record}.--config.distributed.process_id={k}").read_text().splitlines()
    assert flags == kept + "--xla_force_host_platform_device_count=4"
    assert argv == ["-m", "layup_jax.train", "--config", "c.py", "--workdir", "w",
                    "--config.distributed.coordinator_address=10.231.1.1:12355",
                    "--config.distributed.num_processes=2",
                    f"--config.distributed.process_id={k}"]
  assert "host 1 (10.231.1.2) sent" in result.stdout


@needs_netns
@needs_tc
def test_a_normal_exit_and_a_failing_process_leave_nothing_behind(netns):
  args = ["--hosts", "3", "--devices-per-host", "1", "--rate", "20mbit", "--", "x"]
  stats = netns / "links.json"
  ok = _drill([*args[:-2], "--stats", str(stats), *args[-2:]],
              _environment(PYTHON=_stand_in(netns, "ok", "exit 0")))
  assert ok.returncode == 0 and ok.stderr == "", ok.stderr
  assert _left_over() == []
  links = json.loads(stats.read_text())
  assert (links["hosts"], links["rate"], links["status"]) == (3, "20mbit", 0)
  assert [link["host"] for link in links["links"]] == [0, 1, 2]
  # Process 1 fails: the drill's status is its, named in one line.
  fails = _drill(args, _environment(PYTHON=_stand_in(netns, "fails", '''
case "${@: -1}" in *process_id=1) exit 3 ;; esac''')))
  assert fails.returncode == 3
  assert fails.stderr.splitlines() == [
      "error: cluster_drill.sh: process 1 (host 1) ended with status 3"]
  assert _left_over() == []


@needs_netns
@needs_tc
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_drill_stopped_mid_run_removes_what_it_made(netns, sig, status):
  started = netns / "started"
  python = _stand_in(netns, "sleeps", f'touch "{started}.${{@: -1}}"; exec sleep 60')
  # Its own process group, as a terminal's foreground job: Ctrl-C reaches every process of it.
  drill = subprocess.Popen([*INTERRUPTIBLE, *DRILL, "--hosts", "3", "--devices-per-host", "1",
                            "--rate", "20mbit", "--", "x"], cwd=ROOT,
                           env=_environment(PYTHON=python), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    _wait_for(pathlib.Path(f"{started}.--config.distributed.process_id=2"), drill)
    os.killpg(drill.pid, sig)
    _, stderr = drill.communicate(timeout=DEADLINE_S)
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(drill.pid, signal.SIGKILL)
  assert drill.returncode == status
  name = "interrupted (SIGINT)" if sig == signal.SIGINT else "terminated (SIGTERM)"
  assert stderr.splitlines() == [f"error: cluster_drill.sh: {name}"]


@needs_netns
def test_a_host_whose_link_went_down_then_killed_leaves_nothing_behind(netns):
  """Host 2's socket towards host 0, still closing towards an unreachable host, holds its
  namespace (and veth pair) for minutes after `ip netns del`: the drill deletes the pair."""
  connected, gone = netns / "connected", netns / "gone"
  wait_gone = (f"import os, time\ndeadline = time.monotonic() + {DEADLINE_S}\n"
               f"while not os.path.exists({json.dumps(str(gone))}) "
               f"and time.monotonic() < deadline:\n  time.sleep(0.05)")
  python = _stand_in(netns, "vanishes", f'''
case "${{@: -1}}" in
  *process_id=0) exec python3 -c 'import socket
server = socket.create_server(("10.231.1.1", 12399)); server.settimeout({DEADLINE_S})
peer = server.accept()[0]
{wait_gone}' ;;
  *process_id=2) exec python3 -c 'import pathlib, socket, time
deadline = time.monotonic() + {DEADLINE_S}
while True:
  try:
    peer = socket.create_connection(("10.231.1.1", 12399)); break
  except OSError:
    assert time.monotonic() < deadline; time.sleep(0.05)
peer.sendall(b"x" * 65536); pathlib.Path("{connected}").touch(); time.sleep(60)' ;;
  *) exec python3 -c '{wait_gone}' ;;
esac''')
  drill = subprocess.Popen([*DRILL, "--hosts", "3", "--devices-per-host", "1", "--", "x"],
                           cwd=ROOT, env=_environment(PYTHON=python),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    _wait_for(connected, drill)
    subprocess.run(["ip", "link", "set", "layup_b2", "down"], check=True)
    pids = subprocess.run(["ip", "netns", "pids", "layup_host2"], capture_output=True,
                          text=True, check=True).stdout.split()
    for pid in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(int(pid), signal.SIGKILL)
    gone.touch()
    _, stderr = drill.communicate(timeout=DEADLINE_S)
  finally:
    if drill.poll() is None:
      drill.send_signal(signal.SIGINT)
      drill.wait(timeout=DEADLINE_S)
  assert drill.returncode == 137
  assert stderr.splitlines() == [
      "error: cluster_drill.sh: process 2 (host 2) ended with status 137"]


@needs_netns
@needs_tc
@pytest.mark.parametrize("target", ["group", "process"])
def test_bench_cluster_interrupted_lets_the_drill_clean_up_and_writes_what_finished(netns,
                                                                                     target):
  """Ctrl-C (SIGINT to the whole process group, the drill included) or SIGINT to
  bench_cluster.py alone: it must let the drill clean up (subprocess.run would SIGKILL the drill
  0.25 s after the interrupt, which, interrupted alone, never starts its cleanup) and write the
  table of what finished, marked stopped."""
  started, out = netns / "started", netns / "bench.json"
  python = _stand_in(netns, "sleeps", f'touch "{started}.${{@: -1}}"; exec sleep 60')
  bench = subprocess.Popen(
      [*INTERRUPTIBLE, sys.executable, "scripts/bench_cluster.py", "--layouts", "3x1", "--rates",
       "20mbit", "--algorithms", "layup", "--repeats", "1", "--out", str(out)],
      cwd=ROOT, env=_environment(PYTHON=python), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    _wait_for(pathlib.Path(f"{started}.--config.distributed.process_id=2"), bench)
    if target == "group":
      os.killpg(bench.pid, signal.SIGINT)
    else:
      bench.send_signal(signal.SIGINT)
    _, stderr = bench.communicate(timeout=DEADLINE_S)
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(bench.pid, signal.SIGKILL)
  assert bench.returncode == 130, stderr[-2000:]
  assert json.loads(out.read_text())["stopped"] is True


@needs_netns
def test_a_drill_refuses_to_start_over_a_namespace_or_a_link_of_its_names(netns):
  python = _stand_in(netns, "python", "exit 0")
  args = ["--hosts", "2", "--devices-per-host", "1", "--", "x"]
  subprocess.run(["ip", "netns", "add", "layup_host1"], check=True)
  try:
    result = _drill(args, _environment(PYTHON=python))
  finally:
    subprocess.run(["ip", "netns", "del", "layup_host1"], check=True)
  assert result.returncode == 2
  assert len(result.stderr.splitlines()) == 1
  assert "namespace layup_host1 exists" in result.stderr
  # A veth end a killed drill left behind.
  subprocess.run(["ip", "link", "add", "layup_h1", "type", "veth", "peer", "name", "layup_x1"],
                 check=True)
  try:
    result = _drill(args, _environment(PYTHON=python))
    assert _left_over() == ["layup_h1", "layup_x1"]  # the bridge was not made
  finally:
    subprocess.run(["ip", "link", "del", "layup_h1"], check=False)
  assert result.returncode == 2
  assert len(result.stderr.splitlines()) == 1 and "link layup_h1 exists" in result.stderr


@needs_netns
@pytest.mark.skipif(shutil.which("taskset") is None or not hasattr(os, "sched_getaffinity")
                    or len(os.sched_getaffinity(0)) < 2,
                    reason="--cpus-per-host needs taskset and two CPUs")
def test_with_cpus_per_host_each_host_runs_on_cpus_of_its_own(netns):
  record = netns / "cpus"
  python = _stand_in(netns, "python", f'''
grep Cpus_allowed_list /proc/self/status | cut -f2 > "{record}.${{@: -1}}"''')
  result = _drill(["--hosts", "2", "--devices-per-host", "1", "--cpus-per-host", "1", "--",
                   "x"], _environment(PYTHON=python))
  assert result.returncode == 0, result.stderr
  cpus = [pathlib.Path(f"{record}.--config.distributed.process_id={k}").read_text().strip()
          for k in range(2)]
  allowed = sorted(os.sched_getaffinity(0))
  assert cpus == [str(allowed[0]), str(allowed[1])]
