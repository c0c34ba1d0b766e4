"""Checkpoints of a whole run with Orbax, in `WORKDIR/checkpoints/<step>`.

A checkpoint has two Orbax items: `arrays` (every device array the runtime needs: per-device
params, BatchNorm state, Optax state, RNG key data, and what an algorithm adds) and `meta`
(JSON: step counters, push-sum weights, peer RNG states, data iterator states, the config).
The arrays are saved packed: one flat array per unit (one stage of a replicated model, ...)
and dtype, copied off the devices in one batch. Orbax pays a fixed cost per array, and a
replica has hundreds of small leaves: packed, a digits-task checkpoint of 8 replicas (688
leaves) saves in about 0.1 s instead of 1.5 s. The live runtime's shapes unpack it.

Units of which every device has one (its replica, its stage keys) come as `DeviceRows` and are
saved as one array per dtype of shape (devices, size), its rows sharded over the run's devices:
across processes each process writes its own devices' rows (Orbax multi-process: one file set
per process) and reads back only those, and the checkpoint is the same whichever processes
wrote it. A run in one process reads every row, which is what resuming on another device
count (`layup_jax.pushsum.remap`) or another process layout needs.
Orbax writes a step into a temporary folder and renames it when complete, so a run killed while
saving leaves the previous checkpoints as they were. A run's processes resume from the newest
step every one of them reads (`Checkpoints.restore`); a damaged step (a truncated or missing
file) is moved to `WORKDIR/checkpoints_unreadable/` with a warning and the one before it is
used; any other read error stops the run in one line, after retries, with nothing moved.
"""

import concurrent.futures
import dataclasses
import os
import pathlib
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from layup_jax.checkpoint.layout import pack, packed_template, unpack
from layup_jax.errors import ConfigError, StorageError
from layup_jax.platform import compat

PyTree = Any
# Waits before the second and third tries of a checkpoint read that failed other than as damage.
_RETRY_WAITS_S = (1.0, 4.0)

# OSErrors that say a file is missing or of the wrong kind: a checkpoint's damage, not the
# storage's trouble of the moment.
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)

# Words of TensorStore's status codes for trouble of the moment, in a ValueError's text.
_TRANSIENT_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED",
                     "CANCELLED")


def is_damage(error: BaseException) -> bool:
  """Whether a read failed on the checkpoint's data (truncated or missing files, unparsable
  metadata: Orbax and TensorStore raise ValueError, KeyError, JSON errors) rather than on the
  storage or the host of the moment (any other OSError, MemoryError, a TensorStore status of
  trouble of the moment), or on something unknown: only damage moves a checkpoint aside."""
  chain, seen = [], error
  while seen is not None and len(chain) < 16:
    chain.append(seen)
    seen = seen.__cause__ or seen.__context__
  for cause in chain:
    if isinstance(cause, MemoryError) or (isinstance(cause, OSError)
                                          and not isinstance(cause, _MISSING)):
      return False
    if isinstance(cause, ValueError) and any(w in str(cause) for w in _TRANSIENT_STATUS):
      return False
  return isinstance(error, (ValueError, KeyError, IndexError, EOFError, StopIteration, *_MISSING))


@dataclasses.dataclass(frozen=True)
class Peers:
  """The processes that restore a run together: `gather(value)` gives every one's value (plain
  data), in order, each process calling it at the same points; `leads`: this one moves damaged
  checkpoints aside."""
  gather: Callable[[Any], list]
  leads: bool

  @staticmethod
  def alone() -> "Peers":
    return Peers(lambda value: [value], True)


class _SaveThread:
  """Runs the saves in order on one thread of our own.

  Not a daemon thread, nor then are the threads Orbax starts from it (a thread takes its
  creator's flag): at the interpreter's exit Python ends a daemon thread that wakes into it,
  and one doing so from C++ aborts the process (`FATAL: exception not rethrown`, status 134:
  3 in 10 runs of the README's digits command at 35c7733, with this thread a daemon; none in
  12 without). A save given up when a process was lost (`Checkpoints.limit_to`) stays in
  Orbax's barrier for ever: the process that gave it up leaves with `os._exit`
  (layup_jax/train.py). Every other save is waited for by `Checkpoints.wait`/`close`."""

  stuck = 0  # this process's save threads left in a barrier (see `leave_if_saves_stuck`)

  def __init__(self):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._run, name="checkpoint").start()

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((future, fn, args))
    return future

  def shutdown(self) -> None:
    self._queue.put(None)

  def _run(self) -> None:
    while (work := self._queue.get()) is not None:
      future, fn, args = work
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it
          future.set_exception(error)


def leave_if_saves_stuck(status: int) -> None:
  """Ends the process now with `status` if a given-up save's thread still waits in Orbax's
  barrier (the interpreter would wait for it at exit for ever); else returns."""
  if _SaveThread.stuck:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Checkpoints:
  """The run's Orbax CheckpointManager: asynchronous saves, the last `keep` kept.

  Saves run in order on one background thread (packing, then Orbax, which writes the files on
  its own threads); a save's error is raised by the next `save` or by `wait`.

  `processes` (an elastic run after a loss, `limit_to`): the processes that save, Orbax's
  active processes, whose barriers wait for them alone; `None`: every process of the run.
  """

  def __init__(self, directory: pathlib.Path, keep: int, async_save: bool = True,
               read_only: bool = False):
    self.directory = directory.absolute()
    self._keep, self._async, self._read_only = keep, async_save, read_only
    self.processes: tuple[int, ...] | None = None
    self._since_step = 0
    self._manager = self._open()
    self._worker = _SaveThread()
    self._pending: list[concurrent.futures.Future] = []
    self._started: list[int] = []  # the steps of the saves started since the last full wait

  def _open(self) -> ocp.CheckpointManager:
    if jax.process_count() > 1:
      # Orbax's default barrier between processes is a device collective, which, run from the
      # save thread while the training step runs its own collectives, deadlocks (the processes
      # order the two differently); the coordination service's barrier touches no device.
      compat.use_orbax_coordination_barrier()
    # Read only (another run's folder): no folder created, no leftover temporary save of a run
    # that may still be writing there cleaned up.
    multiprocessing = ocp.options.MultiprocessingOptions()
    if self.processes is not None:  # every member opens it at the same step: the same prefix
      # Process 0 may be among the lost: the lowest member writes what one process writes.
      # Orbax's array handler keeps a primary host of its own (0 by default), which alone
      # creates each array's metadata: left to a lost process 0, the others' writes of their
      # rows waited for ever (found with the coordinator apart, process 0 killed).
      verbosity = logging.get_verbosity()
      logging.set_verbosity(logging.ERROR)  # (Orbax warns of every override)
      try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(primary_host=min(self.processes)),
            override=True)
      finally:
        logging.set_verbosity(verbosity)
      multiprocessing = ocp.options.MultiprocessingOptions(
          primary_host=min(self.processes),
          active_processes=set(self.processes),
          barrier_sync_key_prefix=f"live-{'-'.join(map(str, self.processes))}-"
                                  f"{self._since_step}")
    # With active processes Orbax leaves the folder to us: the run's first manager made it.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self._keep, enable_async_checkpointing=self._async,
        create=not self._read_only and self.processes is None,
        cleanup_tmp_directories=not self._read_only,
        read_only=self._read_only, multiprocessing_options=multiprocessing)
    handlers = None
    if self.processes is not None:  # Orbax's item handlers keep a primary host of their own
      handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
      arrays = ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing)
      meta = ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)
      for item, handler, kinds in (("arrays", arrays, (ocp.args.StandardSave,
                                                       ocp.args.StandardRestore)),
                                   ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore))):
        for kind in kinds:
          handlers.add(item, kind, handler)
    return ocp.CheckpointManager(self.directory, options=options, handler_registry=handlers)

  def limit_to(self, processes, step: int, patience_s: float) -> list[int]:
    """Saves from `step` on among `processes` only (an elastic run that lost a process), with
    a manager of their own. Every member calls it at the same step; returns the steps given up.

    The saves under way are given `patience_s` to be written (or to fail). One still waiting
    then waits in Orbax's barrier for the lost process's part, which will never come (found:
    the survivors hung at their next save), and is given up with its save thread: left to
    that thread, its error unread, its temporary folder removed when a manager next
    opens the folder. The earlier manager is dropped, not closed (closing would wait for every
    process of its set)."""
    processes = tuple(sorted(processes))
    if processes == self.processes:
      return []
    under_way = self._worker.submit(self._manager.wait_until_finished)  # after the saves queued
    try:
      under_way.result(timeout=patience_s)
    except concurrent.futures.TimeoutError:  # waits for the lost process: left to its thread
      self._worker.shutdown()
      self._worker = _SaveThread()
      _SaveThread.stuck += 1
    except Exception:  # noqa: BLE001, S110 - a save that failed with the lost process: given up
      pass
    self._pending = []
    self.processes, self._since_step = processes, step
    self._manager = self._open()
    newest = max(self.steps(), default=-1)  # (older ones may have been deleted, `keep`)
    given_up, self._started = [s for s in self._started if s > newest], []
    return given_up

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, arrays: PyTree, meta: dict[str, Any],
           arrays_stay_valid: bool = False) -> None:
    """Starts saving `arrays` (a dict of device arrays) and `meta` (JSON) as `step`.

    Returns once the arrays are copied to the host, as a runtime that donates or deletes them
    needs; with `arrays_stay_valid` (a runtime that only ever replaces its arrays) at once, the
    copy then also happening in the background.
    """
    self._raise_finished_errors()
    packed = None if arrays_stay_valid else pack(arrays)
    self._started.append(step)
    self._pending.append(self._worker.submit(self._write, self._manager, step, arrays, packed,
                                             meta))

  def _write(self, manager: ocp.CheckpointManager, step: int, arrays: PyTree, packed,
             meta: dict[str, Any]) -> None:
    try:
      packed = pack(arrays) if packed is None else packed
      manager.save(step, args=ocp.args.Composite(
          arrays=ocp.args.StandardSave(packed), meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as error:  # also the previous asynchronous write's error
      raise self._save_error(step, error) from error

  def _raise_finished_errors(self) -> None:
    done = [f for f in self._pending if f.done()]
    self._pending = [f for f in self._pending if not f.done()]
    for future in done:
      future.result()

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    pending, self._pending = self._pending, []
    for future in pending:
      future.result()
    try:
      self._manager.wait_until_finished()
    except Exception as error:
      raise self._save_error(self._manager.latest_step(), error) from error
    self._started = []

  def _save_error(self, step, error: BaseException) -> StorageError:
    previous = [s for s in self.steps() if s != step]
    kept = f"checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    return StorageError(f"saving checkpoint {step} in {self.directory} failed "
                        f"({type(error).__name__}: {str(error).splitlines()[0][:300]}); {kept}")

  def restore(self, template_of: Callable[[dict], PyTree], step: int | None = None,
              quarantine: bool = True, peers: "Peers | None" = None
              ) -> tuple[int, PyTree, dict] | None:
    """The newest checkpoint (or `step`) that every process of the run can read, as
    `(step, arrays, meta)`; None if there is none. `template_of(meta)` gives the arrays'
    shapes and target devices (and may raise ConfigError for an incompatible checkpoint).

    The processes (`peers`; this one alone by default) agree: they try the steps every one of
    them sees, newest first, each the same step, and take the first that all read. Only damage
    moves a checkpoint aside (with `quarantine`, by the leader, so that its step can be saved
    again): a step that some process failed to read as data (a truncated or missing file,
    unparsable metadata), and a step newer than the one taken that not every process sees. Any
    other error (an I/O error, memory) is tried again (`_RETRY_WAITS_S`), then stops every
    process in one line (StorageError), nothing moved: a run never starts again from step 0
    unasked. Where every step a run saw was damaged, the run stops too, once they are moved
    aside (its rerun starts from step 0)."""
    peers = peers or Peers.alone()
    views = peers.gather([step] if step is not None else self.steps())
    common = sorted(set.intersection(*map(set, views)), reverse=True)
    partial = set().union(*map(set, views)) - set(common)
    if partial and not common:  # one process sees none of another's: not the same folder
      seen = "; ".join(f"process {k}: {sorted(v) or 'none'}" for k, v in enumerate(views))
      raise StorageError(
          f"the processes see different checkpoints in {self.directory} and none in common "
          f"({seen}); every process must see the same workdir (shared storage): rerun once "
          f"they do")
    damaged: list[tuple[int, str]] = []
    chosen = None
    for candidate in common:
      result, failure = self._read(candidate, template_of)
      failures = [(k, f) for k, f in enumerate(peers.gather(failure)) if f is not None]
      if not failures:
        chosen = (candidate, *result)
        break
      config_errors = [f for _, f in failures if f[0] == "config"]
      if config_errors:
        raise ConfigError(config_errors[0][1])
      errors = [(k, f) for k, f in failures if f[0] == "error"]
      if errors:
        k, (_, what) = errors[0]
        raise StorageError(
            f"checkpoint {self.directory}/{candidate} could not be read (process {k}: {what}) "
            f"after {len(_RETRY_WAITS_S) + 1} tries; nothing was moved or restarted: rerun the "
            f"same command to try again once the storage answers")
      k, (_, what) = failures[0]
      logging.warning("checkpoint %s/%d is damaged (process %d: %s); trying the previous one",
                      self.directory, candidate, k, what)
      damaged.append((candidate, what))
    newer = sorted(s for s in partial if chosen is not None and s > chosen[0])
    if newer:
      logging.warning("checkpoints %s of %s are not seen by every process; the run resumes "
                      "from an earlier one", newer, self.directory)
    if quarantine:
      aside = [s for s, _ in damaged] + newer
      if aside:
        if peers.leads:
          self._move_aside(aside)
        peers.gather(None)  # every process reopens once the leader has moved them
        self._manager.close()
        self._manager = self._open()
      if chosen is None and damaged:
        raise StorageError(
            f"no checkpoint in {self.directory} could be read: steps "
            f"{', '.join(str(s) for s, _ in damaged)} were damaged ({damaged[0][1]}) and were "
            f"moved to {self._aside_directory()}/; rerun the same command to start from step "
            f"0, or name another run's checkpoints with --config.restore")
    return chosen

  def _read(self, step: int, template_of: Callable[[dict], PyTree]
            ) -> tuple[tuple[PyTree, dict] | None, tuple[str, str] | None]:
    """Step `step` read here: ((arrays, meta), None), or (None, (kind, what)) where kind is
    "damage" (`is_damage`), "error" (after the retries) or "config" (incompatible)."""
    for wait in (*_RETRY_WAITS_S, None):
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        template = template_of(meta)
        packed = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(packed_template(template))))["arrays"]
        return (unpack(packed, template), meta), None
      except ConfigError as error:
        return None, ("config", str(error))
      except Exception as error:  # noqa: BLE001 - sorted into damage and everything else
        what = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        if is_damage(error):
          return None, ("damage", what)
        if wait is None:
          return None, ("error", what)
        logging.warning("reading checkpoint %s/%d failed (%s); trying again in %g s",
                        self.directory, step, what, wait)
        time.sleep(wait)
    raise AssertionError("unreachable")

  def _aside_directory(self) -> pathlib.Path:
    return self.directory.parent / f"{self.directory.name}_unreadable"

  def _move_aside(self, steps: list[int]) -> None:
    aside = self._aside_directory()
    aside.mkdir(exist_ok=True)
    for step in steps:
      source = self.directory / str(step)
      if source.exists():
        shutil.move(source, aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")

  def close(self) -> None:
    """Finishes the saves under way (their errors were or will be reported by `wait`)."""
    concurrent.futures.wait(self._pending)
    self._worker.shutdown()
    self._manager.close()


def open_restore_path(path: str, keep: int) -> tuple[Checkpoints, int | None]:
  """`--config.restore=PATH`: a checkpoints folder (its newest readable step) or one step's
  folder in it. Read only: nothing there is moved."""
  location = pathlib.Path(path).expanduser()
  if not location.is_dir():
    raise ConfigError(f"config.restore={path!r}: no such checkpoint folder")
  if location.name.isdigit() and (location / "meta").exists():
    return Checkpoints(location.parent, keep, async_save=False, read_only=True), int(location.name)
  return Checkpoints(location, keep, async_save=False, read_only=True), None
