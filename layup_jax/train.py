"""Command line: flags -> `runner.run(config, workdir)`.

  python -m layup_jax.train --config configs/<name>.py [--config.key=value] --workdir DIR

SIGTERM or Ctrl-C: the run stops at the next consistent point, saves a checkpoint and exits 0;
re-running the same command resumes. A second Ctrl-C stops at once without saving.
"""

import os
import signal
import sys
import traceback

# Eight fake CPU devices unless the user chose a number; this must precede the first JAX import.
# It only shapes the host platform: GPUs are listed first when present.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

from absl import app, flags, logging
from ml_collections import config_flags

from layup_jax.defaults import RENAMED
from layup_jax.errors import RejoinError, UserError
from layup_jax.platform import allocator

USAGE = """usage: python -m layup_jax.train --config FILE[:ALGORITHM] [--config.KEY=VALUE ...]
                                 [--workdir DIR]

Trains the config's model and writes metrics.jsonl, summary.json and checkpoints to DIR (default
runs/default); the same command again resumes from DIR's newest checkpoint. SIGTERM or Ctrl-C
saves a checkpoint and exits 0; a second Ctrl-C stops at once.

  --config FILE[:ALGORITHM]  a config file (configs/digits.py, ...); :ALGORITHM takes that
                             algorithm's column of the file's hyper-parameters (:ddp)
  --config.KEY=VALUE         sets one key, e.g. --config.num_steps=100 (every key and its
                             meaning: docs/reference/settings.md)
  --workdir DIR              where the run's records and checkpoints go
  -h, --help                 this text"""

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file (configs/<name>.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Where metrics and summaries go.")
flags.mark_flags_as_required(["config"])


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _fail_config_file(error: OSError) -> None:
  attempts = [line.strip() for line in str(error).splitlines() if "Errno" in line]
  _fail(f"cannot load the config file: {attempts[-1] if attempts else error}")


def _config_path(argv: list[str]) -> str | None:
  """The config file named on the command line (without its `:column`), or None."""
  for k, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1].split(":")[0]
    if arg == "--config" and k + 1 < len(argv):
      return argv[k + 1].split(":")[0]
  return None


def _in_config_file(error: BaseException, path: str | None) -> str | None:
  """`PATH line N` where `error` was raised while the config file ran, else None."""
  if path is None:
    return None
  where = os.path.realpath(path)
  if isinstance(error, SyntaxError) and error.filename and (
      os.path.realpath(error.filename) == where):
    return f"{path} line {error.lineno}"
  lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
           if os.path.realpath(frame.filename) == where]
  return f"{path} line {lines[-1]}" if lines else None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with a config override that names no key (or a wrong type), a config file
  that fails to run or has no `get_config`, in one line; `--help` prints the usage and exits 0."""
  if any(arg in ("-h", "--help", "--helpshort", "--helpfull") for arg in argv[1:]):
    print(USAGE)
    sys.exit(0)
  path = _config_path(argv)
  try:
    return flags.FLAGS(argv)
  except Exception as error:  # noqa: BLE001 - every failure here is one line
    where = _in_config_file(error, path)
    if where is not None:
      _fail(f"the config file failed: {where}: {type(error).__name__}: {error}")
    if isinstance(error, AttributeError) and "get_config" in str(error):
      _fail(f"the config file {path} has no get_config() (it defines get_config() returning "
            "an ml_collections.ConfigDict, as configs/digits.py does)")
    _fail_parse(error, argv)
  raise AssertionError("unreachable")


def _fail_parse(error: Exception, argv: list[str]) -> None:
  """One line for a command line absl or the config flag refused."""
  if isinstance(error, flags.Error):
    lines = [line for line in str(error).splitlines() if line.strip()]
    if "Traceback" in str(error):  # an exception inside the config file: its last line says why
      _fail(f"{lines[0]} {lines[-1]}")
    _fail(lines[0])
  if isinstance(error, OSError):
    _fail_config_file(error)
  if not isinstance(error, (AttributeError, KeyError, TypeError, ValueError)):
    _fail(f"cannot read the command line: {type(error).__name__}: {error}")
  detail = " ".join(str(error).replace("\\n", " ").replace("\\'", "").strip("'\"").split())
  overrides = [a.split("=")[0][2:] for a in argv[1:] if a.startswith("--config.")]
  key = next((o for o in overrides if o.rsplit(".", 1)[-1] in detail), None)
  moved = RENAMED.get((key or "").removeprefix("config."))
  if isinstance(error, (AttributeError, KeyError)) and moved:
    _fail(f"config key {key} is now config.{moved} (--config.{moved}=...)")
  if isinstance(error, (AttributeError, KeyError)) and key:
    hint = detail.split("?")[0].split("Did you mean")[-1] if "Did you mean" in detail else ""
    suggestion = f" (did you mean{hint}?)" if hint else ""
    _fail(f"unknown config key {key}{suggestion}; every key is listed in layup_jax/defaults.py")
  _fail(f"bad config override {key or ''}: {detail}")


class StopRequest:
  """Set by SIGTERM or SIGINT; `runner.run` polls it (`__call__`)."""

  def __init__(self):
    self.signal_name: str | None = None

  def install(self) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, self._handle)

  def _handle(self, signum: int, frame) -> None:
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
    self.signal_name = signal.Signals(signum).name
    print(f"\n{self.signal_name}: saving a checkpoint at the next consistent point, then "
          f"stopping (Ctrl-C again stops at once)", file=sys.stderr, flush=True)

  def __call__(self) -> bool:
    return self.signal_name is not None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  try:
    config = _CONFIG.value
    config.keys()  # a config file that failed to load raises only when first used
  except OSError as error:
    _fail_config_file(error)
  try:
    note = allocator.use(config.tuning.host_allocator)  # may start this command again, under it
  except ValueError as error:
    _fail(str(error))
  # Imported only now: a command started again under another allocator imports jax once.
  from layup_jax import algorithms
  from layup_jax.checkpoint import manager
  from layup_jax.multiprocess import membership, setup
  from layup_jax.multiprocess.watchdog import Watchdog
  from layup_jax.run import runner

  stop, watchdog = StopRequest(), None
  try:
    # A gossip run goes on when a process other than 0 is lost (docs/guide/elastic.md).
    elastic = algorithms.get(config.algorithm).gossip if config.algorithm in algorithms.names() \
        else False
    if setup.initialize(config.distributed, recoverable=elastic):  # before any backend use
      watchdog = Watchdog(config.distributed.heartbeat_timeout_s, elastic=elastic,
                          progress_timeout_s=config.distributed.progress_timeout_s,
                          max_dropped_sends=config.distributed.max_dropped_sends)
      if membership.members.rejoining and not algorithms.get(config.algorithm).rejoins:
        raise RejoinError(f"{config.algorithm} has no rejoin: only push-sum gossip (layup, "
                          f"gosgd) gives a process a replica and a weight share; the others "
                          f"train on without this process")
    stop.install()  # after: JAX's preemption notifier would take SIGTERM otherwise
    summary = runner.run(config, _WORKDIR.value, should_stop=stop)
  except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    failed = error.exit_code
  else:
    failed = None
  finally:
    if watchdog is not None:
      watchdog.finish()
  if failed is not None:
    manager.leave_if_saves_stuck(failed)
    sys.exit(failed)
  _report(summary, stop)
  if note and summary.get("primary", True):
    print(note, file=sys.stderr)  # after the run: a bad input still gets its one line alone
  # A save given up when a process was lost still waits, on its thread, in Orbax's barrier
  # inside jax's runtime: the interpreter would wait for it at exit for ever (and, were it a
  # daemon thread, end it in mid-call and abort: status -6 after a run that had ended well).
  # Everything of the run is written and waited for by now.
  manager.leave_if_saves_stuck(0)


def _report(summary: dict, stop: StopRequest) -> None:
  """The run's last line (process 0)."""
  if not summary.get("primary", True):
    return  # process 0 prints the run's line
  if summary.get("stopped"):
    where = (f"checkpoint {summary['checkpoint']} saved" if summary["checkpoint"]
             else "nothing new to save")
    print(f"stopped by {stop.signal_name} at step {summary['step']} of {summary['num_steps']}: "
          f"{where}; run the same command again to resume")
    return
  print(
      f"{summary['algorithm']} on {summary['num_devices']} devices: final consensus test accuracy "
      f"{summary['final_eval_accuracy']:.4f}, loss {summary['final_eval_loss']:.4f}, "
      f"{summary['wall_time_s']:.1f} s training, {summary['train_samples_per_s']:.0f} samples/s "
      f"(summary in {_WORKDIR.value}/summary.json)"
  )


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
