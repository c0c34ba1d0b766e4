"""Starts a multi-process run on this machine: N training processes joined by JAX's runtime,
and the coordination service in a process of its own.

  python -m layup_jax.launch --processes 2 [--devices-per-process 4] -- \\
      --config configs/<name>.py --workdir DIR [--config.key=value ...]

It starts the coordinator (`python -m layup_jax.multiprocess.coordinator` on a free port:
jax's coordination service, no devices), then each training process: `python -m
layup_jax.train` with the arguments after `--` and the `config.distributed` keys of its place
(the coordinator's address, `external_coordinator`, its process id). With the service apart,
any training process may be lost, process 0 included (`--no-coordinator`: the service runs
inside process 0, as `jax.distributed` does by default, and its loss stops the run). On CPU each
process gets `--devices-per-process` fake devices (`num_devices` counts all of them); on an
NVIDIA host each gets its own `--devices-per-process` GPUs through CUDA_VISIBLE_DEVICES
(process k the k-th group of those this launcher sees), since a process of a distributed JAX run
otherwise takes every GPU it sees. (On a cluster, start the coordinator and one training process
per host or per GPU with the same keys: docs/guide/several_hosts.md.) Process 0's output is
shown as is, the others' prefixed `[pK]`, the coordinator's `[coordinator]`. When one process
fails, the others are stopped and the launcher exits with its status; with `--keep-going`, a
failed training process is reported and the others go on (a gossip run trains on without it,
docs/guide/elastic.md; a DDP or periodic run stops itself in one line); with `--restart N`
(implies `--keep-going`) it is also started again with its command, at most N times per
process, while another runs (LayUp and GoSGD take it back into the running run). The
coordinator's own failure stops every process.
"""

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def commands(processes: int, port: int, train_args: list[str],
             external_coordinator: bool = False) -> list[list[str]]:
  """The train command of each process."""
  external = (["--config.distributed.external_coordinator=True"] if external_coordinator
              else [])
  return [[sys.executable, "-m", "layup_jax.train", *train_args,
           f"--config.distributed.coordinator_address=127.0.0.1:{port}",
           f"--config.distributed.num_processes={processes}", *external,
           f"--config.distributed.process_id={k}"] for k in range(processes)]


def coordinator_command(processes: int, port: int) -> list[str]:
  """The coordinator's command: the coordination service for `processes`, on loopback `port`
  (the processes it serves run on this machine)."""
  return [sys.executable, "-m", "layup_jax.multiprocess.coordinator", "--host", "127.0.0.1",
          "--port", str(port),
          "--processes", str(processes)]


# The run's secret, as `layup_jax.multiprocess.signed.SECRET_VARIABLE` names it (this module
# imports nothing of the package's, so that it starts at once).
SECRET_VARIABLE = "LAYUP_JAX_RUN_SECRET"


def environment(devices_per_process: int) -> dict[str, str]:
  """The training processes' environment: this one's, each process's fake device count, and
  the run's secret (a fresh one unless the caller set it), with which they sign and check what
  they exchange through the coordination service."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  return {**os.environ, "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
          .strip(),
          SECRET_VARIABLE: os.environ.get(SECRET_VARIABLE) or secrets.token_hex(32)}


def visible_gpus(environ: dict[str, str], driver_dir: str = "/proc/driver/nvidia/gpus"
                 ) -> list[str] | None:
  """The GPUs this launcher hands out: CUDA_VISIBLE_DEVICES's entries where it is set, else one
  index per GPU the NVIDIA driver lists; None where there are none (a CPU run)."""
  if "CUDA_VISIBLE_DEVICES" in environ:
    listed = [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    return listed or None
  count = len(os.listdir(driver_dir)) if os.path.isdir(driver_dir) else 0
  return [str(i) for i in range(count)] or None


def gpu_groups(processes: int, devices_per_process: int, gpus: list[str] | None
               ) -> list[str | None]:
  """Each process's CUDA_VISIBLE_DEVICES (None: left as it is, a CPU run); too few GPUs stop
  the launch in one line."""
  if gpus is None:
    return [None] * processes
  needed = processes * devices_per_process
  if needed > len(gpus):
    raise SystemExit(f"launch: {processes} processes x {devices_per_process} devices need "
                     f"{needed} GPUs; {len(gpus)} are visible ({','.join(gpus)})")
  return [",".join(gpus[k * devices_per_process:(k + 1) * devices_per_process])
          for k in range(processes)]


def _shell_status(returncode: int) -> int:
  """A child's exit status as a shell reports it (128 + N for a process killed by signal N)."""
  return returncode if returncode >= 0 else 128 - returncode


USER_ERROR = 2  # a training process's exit status for a bad input, said in its own line


def _relay(process: subprocess.Popen, prefix: str, errors_shown: set[str],
           lock: threading.Lock) -> None:
  """Copies a process's output, prefixed; an `error:` line another process of the run printed
  already (`errors_shown`: every process refuses a bad config alike) is shown once."""
  for line in process.stdout:
    if line.startswith("error:"):
      with lock:
        if line in errors_shown:
          continue
        errors_shown.add(line)
    sys.stdout.write(prefix + line if prefix else line)
    sys.stdout.flush()


def run(processes: int, devices_per_process: int, train_args: list[str],
        keep_going: bool = False, restarts: int = 0, coordinator: bool = True) -> int:
  """Runs the processes to the end; the first failure's exit status (0 when all succeed).
  `keep_going`: a failed training process does not stop the others (reported in one line;
  the launcher's status is then that of the processes that ended the run). `restarts`: such a
  process is also started again, at most that many times, while another runs. `coordinator`:
  the coordination service in a process of its own (else inside process 0, which then may not
  be lost: it is never kept going without, nor started again)."""
  env = environment(devices_per_process)
  gpus = gpu_groups(processes, devices_per_process, visible_gpus(env))
  keep_going = keep_going or restarts > 0
  port = free_port()
  every = commands(processes, port, train_args, external_coordinator=coordinator)
  relays: list[threading.Thread] = []
  errors_shown, errors_lock = set(), threading.Lock()  # the run's `error:` lines, once each

  def spawn(command: list[str], prefix: str, environ: dict[str, str]) -> subprocess.Popen:
    child = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
    relay = threading.Thread(target=_relay, args=(child, prefix, errors_shown, errors_lock),
                             daemon=True)
    relay.start()
    relays.append(relay)
    return child

  def start(k: int) -> subprocess.Popen:
    mine = env if gpus[k] is None else {**env, "CUDA_VISIBLE_DEVICES": gpus[k]}
    return spawn(every[k], f"[p{k}] " if k else "", mine)

  service = spawn(coordinator_command(processes, port), "[coordinator] ",
                  {**env, "JAX_PLATFORMS": "cpu"}) if coordinator else None
  children = [start(k) for k in range(processes)]
  restarted = [0] * processes
  spared = range(processes) if coordinator else range(1, processes)  # may be kept going

  def forward(signum, frame):  # Ctrl-C / SIGTERM: every process saves and stops
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)

  signal.signal(signal.SIGINT, forward)
  signal.signal(signal.SIGTERM, forward)
  status, reported = 0, set()

  def stop_all(why: str, code: int) -> None:
    nonlocal status
    if not status:
      status = code
      if code != USER_ERROR:  # a bad input: the process's own line said why
        print(f"launch: {why}; stopping the others (rerun the same command to resume from "
              f"the last checkpoint)", file=sys.stderr, flush=True)
      for child in children:
        if child.poll() is None:
          child.kill()

  service_lost_at = None
  while [child.poll() for child in children].count(None):  # polls each (any() would stop early)
    if service is not None and service.poll() is not None and service_lost_at is None:
      # Each training process finds the service gone and says so in one line (its watchdog);
      # those still running after a minute are stopped.
      service_lost_at = time.monotonic()
      status = status or _shell_status(service.returncode) or 1
      print(f"launch: the coordinator exited with status {_shell_status(service.returncode)}; "
            f"the training processes stop (rerun the same command to resume from the last "
            f"checkpoint)", file=sys.stderr, flush=True)
    if service_lost_at is not None:
      if time.monotonic() - service_lost_at > 60:
        for child in children:
          if child.poll() is None:
            child.kill()
      time.sleep(0.1)
      continue
    failed = [(k, c.returncode) for k, c in enumerate(children)
              if c.returncode not in (None, 0) and (k, c.pid) not in reported]
    for k, code in failed:
      reported.add((k, children[k].pid))
      how = (f"was killed by {signal.Signals(-code).name}" if code < 0
             else f"exited with status {code}")
      others_run = any(c.poll() is None for j, c in enumerate(children) if j != k)
      if keep_going and k in spared:
        if restarted[k] < restarts and others_run:
          restarted[k] += 1
          print(f"launch: process {k} {how}; starting it again (--restart, {restarted[k]} of "
                f"{restarts})", file=sys.stderr, flush=True)
          children[k] = start(k)
          continue
        print(f"launch: process {k} {how}; the others go on (--keep-going)", file=sys.stderr,
              flush=True)
        continue
      stop_all(f"process {k} {how}", _shell_status(code))
    time.sleep(0.1)
  if service is not None and service.poll() is None:
    service.terminate()
    service.wait(timeout=30)
  for relay in relays:
    relay.join(timeout=5)
  if not status:  # a lost process was reported already: the others' statuses are the run's
    kept = [c for k, c in enumerate(children) if (k, c.pid) not in reported]
    status = next((_shell_status(c.returncode) for c in kept if c.returncode), 0 if kept else 1)
  return status


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description="Start N training processes on this machine, joined by JAX's distributed "
                  "runtime; the arguments after -- go to python -m layup_jax.train.")
  parser.add_argument("--processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=4,
                      help="devices per process: fake CPU devices, or on an NVIDIA host "
                           "its own GPUs (CUDA_VISIBLE_DEVICES)")
  parser.add_argument("--keep-going", action="store_true",
                      help="a training process that fails does not stop the others (a gossip "
                           "run trains on without it)")
  parser.add_argument("--restart", type=int, default=0, metavar="N",
                      help="also start a failed training process again, at most N times "
                           "(implies --keep-going; LayUp and GoSGD take it back)")
  parser.add_argument("--no-coordinator", action="store_true",
                      help="run the coordination service inside process 0, as jax does by "
                           "default (its loss then stops the run) instead of apart")
  parser.add_argument("train_args", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
  if args.processes < 1 or args.devices_per_process < 1 or args.restart < 0:
    parser.error("--processes and --devices-per-process must be >= 1, --restart >= 0")
  if not train_args:
    parser.error("give the train arguments after --, e.g. -- --config configs/digits.py")
  sys.exit(run(args.processes, args.devices_per_process, train_args, args.keep_going,
               args.restart, coordinator=not args.no_coordinator))


if __name__ == "__main__":
  main()
