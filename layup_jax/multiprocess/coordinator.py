"""The run's coordination service in a process of its own, so that any training process may be
lost, process 0 included.

  python -m layup_jax.multiprocess.coordinator --port 12355 --processes 3

It hosts jax's coordination service (the key-value store, barriers and liveness every training
process uses) and nothing else: no devices, no backend, no training. The training processes
0 .. N-1 join it as clients (`config.distributed.external_coordinator=True`, with
`coordinator_address` naming this host and port); `python -m layup_jax.launch` starts it for
them. It runs until SIGTERM or Ctrl-C. Its own loss stops every training process (the service
keeps its state in memory only; jax refuses a restarted service under live clients): each says
so in one line, and the same commands, run again, resume from the last checkpoint.
"""

import argparse
import signal
import sys
import threading

from layup_jax.platform import compat

# jax's heartbeat to the service: a client silent for this long is let go (the watchdog of a
# training process names a silent peer sooner, `distributed.heartbeat_timeout_s`).
HEARTBEAT_TIMEOUT_S = 60


def serve(port: int, processes: int, host: str = "[::]",
          heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
          stop: threading.Event | None = None, tls: dict | None = None) -> None:
  """Hosts the service for `processes` training processes on `host:port` until `stop` is set
  (by default: until SIGTERM or SIGINT); `tls`: jax's mutual-TLS arguments."""
  if stop is None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, lambda *_: stop.set())
  service = compat.start_coordination_service(f"{host}:{port}", processes, heartbeat_timeout_s,
                                              tls=tls)
  print(f"coordinator: serving {processes} training processes on port {port}", file=sys.stderr,
        flush=True)
  try:
    while not stop.wait(1.0):
      pass
  finally:
    service.shutdown()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--port", type=int, required=True, help="the port the processes connect to")
  parser.add_argument("--processes", type=int, required=True,
                      help="training processes in the run (config.distributed.num_processes)")
  parser.add_argument("--host", default="[::]", help="the address to listen on (default: all)")
  parser.add_argument("--heartbeat-timeout-s", type=int, default=HEARTBEAT_TIMEOUT_S)
  for name in ("cert", "key", "ca"):
    parser.add_argument(f"--tls-{name}-file", default="",
                        help=f"mutual TLS: as config.distributed.tls_{name}_file (all three, or "
                             f"none)")
  args = parser.parse_args(argv)
  if args.processes < 1 or not 0 < args.port < 65536:
    parser.error("--processes must be >= 1 and --port a port number")
  if not compat.EXTERNAL_COORDINATOR:
    sys.exit("error: this jax gives no way to run the coordination service apart "
             "(layup_jax/platform/compat.py); start the training processes without "
             "config.distributed.external_coordinator")
  from layup_jax.errors import ConfigError
  from layup_jax.multiprocess.setup import tls_arguments

  try:
    tls = tls_arguments({f"tls_{n}_file": getattr(args, f"tls_{n}_file") for n in
                         ("cert", "key", "ca")})
  except ConfigError as error:
    parser.error(str(error).replace("config.distributed.tls_", "--tls-").replace("_file", "-file"))
  serve(args.port, args.processes, args.host, args.heartbeat_timeout_s, tls=tls)


if __name__ == "__main__":
  main()
