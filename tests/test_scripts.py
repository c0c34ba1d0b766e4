"""The scripts with modes (scripts/README.md): each mode takes its own options, a script without a
default mode refuses a missing or unknown one in one line, and `sweep.py --every-algorithm`
judges and records its runs."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def _script(name: str):
  spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _main(name: str, argv: list[str]) -> int | str | None:
  """`scripts/NAME.py ARGV`'s exit status (0 after --help, 2 for a bad option or mode)."""
  try:
    _script(name).main(argv)
  except SystemExit as done:
    return done.code
  return 0


@pytest.mark.parametrize("name, argv, option", [
    ("bench_io", ["input", "--help"], "--read-threads"),
    ("bench_io", ["checkpoint", "--help"], "--every"),
    ("bench_cluster", ["--help"], "processes"),
    ("bench_cluster", ["hosts", "--help"], "--cpus-per-host"),
    ("bench_cluster", ["processes", "--help"], "--layouts"),
    ("drill_process_loss", ["--help"], "kill-resume"),
    ("drill_process_loss", ["kill-resume", "--help"], "--checkpoint-every"),
    ("drill_process_loss", ["elastic", "--help"], "--kill-during-save"),
    ("drill_process_loss", ["vanish", "--help"], "--slow"),
    ("drill_process_loss", ["churn", "--help"], "--mtbf-s"),
    ("bench_cluster", ["--help"], "--slow-factors"),
])
def test_each_mode_takes_its_own_options(capsys, name, argv, option):
  assert _main(name, argv) == 0
  assert option in capsys.readouterr().out


def test_bench_cluster_without_a_mode_is_the_hosts_benchmark(capsys):
  assert _main("bench_cluster", ["--rates", "20mbit", "--repeats-typo", "1"]) == 2
  assert "bench_cluster.py [hosts]" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bench_io", "drill_process_loss"])
@pytest.mark.parametrize("argv", [[], ["--repeats", "1"], ["inputs"]])
def test_a_missing_or_unknown_mode_is_refused_in_one_line(capsys, name, argv):
  assert _main(name, argv) == 2
  said = capsys.readouterr().err.splitlines()
  assert len(said) == 1 and said[0].startswith("error: the first argument is a mode, one of ")


def test_a_sweep_needs_a_workdir_but_every_algorithm_does_not(monkeypatch, tmp_path, capsys):
  sweep = _script("sweep")
  monkeypatch.setattr("sys.argv", ["sweep.py", "--config", "configs/digits.py"])
  with pytest.raises(SystemExit) as refused:
    sweep.main()
  assert refused.value.code == 2
  assert "--workdir" in capsys.readouterr().err
  # Every algorithm, both ways a user types it: the rows recorded, exit 1 when one falls short.
  made = []

  def run(command, workdir):
    made.append(command)
    accuracy = 0.5 if "ddp" in command[-1] else 0.97
    return {"command": " ".join(command), "rc": 0, "seconds": 1.0, "notes": [],
            "accuracy": accuracy}

  monkeypatch.setattr(sweep, "every_algorithm_run", run)
  out = tmp_path / "every.json"
  monkeypatch.setattr("sys.argv", ["sweep.py", "--every-algorithm", "--config", "configs/digits.py",
                                   "--algorithms", "layup", "ddp", "--out", str(out)])
  with pytest.raises(SystemExit) as done:
    sweep.main()
  assert done.value.code == 1  # DDP's 0.5 is below the default 0.95
  assert made == [["--config=configs/digits.py:layup"],
                  ["--config=configs/digits.py", "--config.algorithm=layup"],
                  ["--config=configs/digits.py:ddp"],
                  ["--config=configs/digits.py", "--config.algorithm=ddp"]]
  record = json.loads(out.read_text())
  assert record["all_reached"] is False and len(record["rows"]) == 4
  assert [(r["algorithm"], r["form"]) for r in record["rows"]][:2] == [
      ("layup", "suffix"), ("layup", "override")]
  assert "| layup | 0.9700 | 0.9700 |" in capsys.readouterr().out


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_every_shell_script_prints_its_usage_for_help_and_exits_0(script, tmp_path):
  for flag in ("--help", "-h"):
    done = subprocess.run(["bash", str(SCRIPTS / script), flag], capture_output=True, text=True,
                          timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "usage" not in done.stderr.lower()
    assert not done.stdout.startswith(("#", "!")), done.stdout[:200]
  assert list(tmp_path.iterdir()) == []  # ran nothing, wrote nothing


def test_bench_gpu_refuses_a_before_tree_that_is_not_a_checkout_in_one_line(tmp_path):
  done = subprocess.run(["bash", str(SCRIPTS / "bench_gpu.sh"), str(tmp_path / "nowhere")],
                        capture_output=True, text=True, timeout=60, check=False,
                        env={**os.environ, "OUT": str(tmp_path / "out")})
  assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
  assert done.stderr.startswith("error: BEFORE must be another checkout of the project")
  assert not (tmp_path / "out").exists()


def _state_and_parent(pid: int) -> tuple[str, int] | None:
  """Process `pid`'s state letter and parent (Linux's /proc), or None once it is gone."""
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return None
  return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
  found = _state_and_parent(pid)
  return found is not None and found[0] != "Z"


def _children(pid: int) -> list[int]:
  """The live processes whose parent is `pid`."""
  found = ((int(p.name), _state_and_parent(int(p.name)))
           for p in pathlib.Path("/proc").iterdir() if p.name.isdigit())
  return [k for k, seen in found if seen is not None and seen[0] != "Z" and seen[1] == pid]


def test_a_churn_drill_stopped_by_sigterm_stops_its_processes_and_keeps_their_outputs(tmp_path):
  # Stopped from outside (kill, a scheduler's timeout), the drill must not leave its training
  # processes running, and must write what each start said: the only record of a stall.
  out = tmp_path / "churn.json"
  drill = subprocess.Popen(
      [sys.executable, str(SCRIPTS / "drill_process_loss.py"), "churn", "--mtbf-s", "1000",
       "--num-steps", "100000", "--no-uninterrupted", "--out", str(out)],
      cwd=SCRIPTS.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  started = []
  for _ in range(600):  # the coordinator and the 3 training processes
    started = _children(drill.pid)
    if len(started) >= 4 or drill.poll() is not None:
      break
    time.sleep(0.1)
  assert len(started) >= 4, drill.stderr.read() if drill.poll() is not None else started
  drill.terminate()
  assert drill.wait(timeout=120) == 128 + 15
  assert [pid for pid in started if _alive(pid)] == []
  logs = sorted(p.name for p in (tmp_path / "churn.json.logs").iterdir())
  assert logs == [f"start_{k}_process_{k}.log" for k in range(3)]
