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
count (`layup_jax.remap`) or another process layout needs.
Orbax writes a step into a temporary folder and renames it when complete, so a run killed while
saving leaves the previous checkpoints as they were; a step that still fails to restore (a
truncated or damaged file) is moved to `WORKDIR/checkpoints_unreadable/` with a warning and the
one before it is used.
"""

import concurrent.futures
import json
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
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from layup_jax import compat, distributed
from layup_jax.errors import ConfigError, StorageError

PyTree = Any
_ROWS_AXIS = "rows"
# Keys that decide the shapes and structure of the saved arrays: a checkpoint written with other
# values cannot be loaded into this run.
STRUCTURAL_KEYS = ("algorithm", "model", "optimizer.name", "data.name", "layup.pack_stages")


class DeviceRows(list):
  """One unit per device of the run, of which this process holds its own devices' (`self[k]`
  is device `first + k`'s, of `total`). `devices` are the run's devices in position order:
  saved, the units become rows of arrays sharded over them. As a restore template, `devices`
  None reads every row to the host (`total` units here) and devices given read this
  process's rows. A list, so that code reading a state's replicas reads them as before."""

  def __init__(self, units, first: int = 0, total: int | None = None,
               devices: tuple | None = None):
    super().__init__(units)
    self.first = first
    self.total = len(self) if total is None else total
    self.devices = None if devices is None else tuple(devices)

  def like(self, units) -> "DeviceRows":
    return DeviceRows(units, self.first, self.total, self.devices)

  def rows_sharding(self) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(self.devices), (_ROWS_AXIS,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(_ROWS_AXIS))


jax.tree_util.register_pytree_node(
    DeviceRows, lambda rows: (list(rows), (rows.first, rows.total, rows.devices)),
    lambda aux, units: DeviceRows(units, *aux))


def _unit_sizes(unit: PyTree) -> dict[str, int]:
  sizes: dict[str, int] = {}
  for leaf in jax.tree.leaves(unit):
    dtype = _dtype_name(leaf.dtype)
    sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(leaf.shape))
  return sizes


def _pack_unit(unit: PyTree) -> dict[str, np.ndarray]:
  groups: dict[str, list[np.ndarray]] = {}
  for leaf in jax.device_get(jax.tree.leaves(unit)):  # one batch of device-to-host copies
    groups.setdefault(_dtype_name(leaf.dtype), []).append(np.asarray(leaf).ravel())
  return {dtype: np.concatenate(parts) for dtype, parts in groups.items()}


def _pack_rows(rows: DeviceRows) -> dict[str, jax.Array]:
  """Per dtype, this process's units as its rows of a (total, size) array over the run's
  devices (each row on its own device: Orbax writes the rows a process can address)."""
  packed = [_pack_unit(unit) for unit in rows]
  sharding = rows.rows_sharding()
  out = {}
  for dtype in sorted({d for unit in packed for d in unit}):
    flats = [unit[dtype] for unit in packed]
    if len({flat.size for flat in flats}) > 1:
      raise ValueError(f"device rows of {dtype} differ in size: {[f.size for f in flats]}")
    shards = [jax.device_put(flat[None], rows.devices[rows.first + k])
              for k, flat in enumerate(flats)]
    out[dtype] = jax.make_array_from_single_device_arrays(
        (rows.total, flats[0].size), sharding, shards)
  return out


def _units(tree: dict[str, Any]) -> list[tuple[str, PyTree]]:
  """The runtime's arrays dict (less its `DeviceRows`) as named units whose leaves share a
  device (or a sharding): top-level entries, lists split per element (`results.3`)."""
  units = []
  for key, value in tree.items():
    if isinstance(value, DeviceRows):
      continue
    if isinstance(value, list):
      units.extend((f"{key}.{j}", item) for j, item in enumerate(value))
    else:
      units.append((key, value))
  return units


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def pack(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """`{unit: {dtype: flat host array}}`, every leaf of a unit raveled in tree order, and
  `{key: {dtype: (devices, size) array}}` for each `DeviceRows` entry."""
  packed = {name: _pack_unit(unit) for name, unit in _units(tree)}
  for key, value in tree.items():
    if isinstance(value, DeviceRows):
      packed[key] = _pack_rows(value)
  return packed


def packed_template(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """What Orbax restores `pack`'s output into for arrays shaped like `template`: host arrays,
  and for `DeviceRows` host arrays of every row or this process's rows on its devices."""
  packed: dict[str, dict[str, Any]] = {
      name: {dtype: np.zeros(size, dtype) for dtype, size in _unit_sizes(unit).items()}
      for name, unit in _units(template)}
  for key, rows in template.items():
    if not isinstance(rows, DeviceRows):
      continue
    sizes = _unit_sizes(rows[0])
    if rows.devices is None:
      packed[key] = {dtype: np.zeros((rows.total, size), dtype) for dtype, size in sizes.items()}
    else:
      sharding = rows.rows_sharding()
      packed[key] = {dtype: jax.ShapeDtypeStruct((rows.total, size), np.dtype(dtype),
                                                 sharding=sharding)
                     for dtype, size in sizes.items()}
  return packed


def _unpack_unit(flats: dict[str, np.ndarray], unit: PyTree, name: str) -> PyTree:
  leaves, treedef = jax.tree.flatten(unit)
  offsets: dict[str, int] = {}
  arrays = []
  for leaf in leaves:
    dtype, size = _dtype_name(leaf.dtype), int(np.prod(leaf.shape))
    start = offsets.get(dtype, 0)
    flat = flats[dtype]
    if start + size > flat.size:
      raise ValueError(f"checkpoint unit {name} holds fewer {dtype} values than this run needs")
    arrays.append(distributed.put(flat[start:start + size].reshape(leaf.shape), leaf.sharding))
    offsets[dtype] = start + size
  return jax.tree.unflatten(treedef, arrays)


def _row_flats(packed_rows: dict[str, Any], rows: DeviceRows) -> list[dict[str, np.ndarray]]:
  """Per unit of the template `rows`, its flat host arrays per dtype."""
  flats: list[dict[str, np.ndarray]] = [{} for _ in rows]
  for dtype, array in packed_rows.items():
    if isinstance(array, jax.Array):  # this process's rows, one per device
      for shard in array.addressable_shards:
        k = (shard.index[0].start or 0) - rows.first
        if 0 <= k < len(rows):
          flats[k][dtype] = np.asarray(shard.data)[0]
    else:
      for k in range(len(rows)):
        flats[k][dtype] = np.asarray(array[k])
  return flats


def unpack(packed: dict[str, dict[str, Any]], template: dict[str, Any]) -> dict[str, Any]:
  """`pack`'s inverse: arrays of `template`'s tree, shapes and shardings (device-committed)."""
  units = {name: _unpack_unit(packed[name], unit, name) for name, unit in _units(template)}
  tree = {}
  for key, value in template.items():
    if isinstance(value, DeviceRows):
      rows = _row_flats(packed[key], value)
      tree[key] = value.like([_unpack_unit(rows[k], unit, f"{key}.{value.first + k}")
                              for k, unit in enumerate(value)])
    elif isinstance(value, list):
      tree[key] = [units[f"{key}.{j}"] for j in range(len(value))]
    else:
      tree[key] = units[key]
  return tree


def tree_bytes(tree: PyTree) -> int:
  """The bytes of a checkpoint of `tree`: `DeviceRows` count every process's rows."""
  size = lambda t: sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize
                       for leaf in jax.tree.leaves(t))
  rows = [v for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, DeviceRows))
          if isinstance(v, DeviceRows)]
  return size(tree) + sum(size(list(r)) * (r.total - len(r)) // max(len(r), 1) for r in rows)


def check_storage(workdir: pathlib.Path, checkpoint_bytes: int, keep: int) -> None:
  """Fails before training when the workdir cannot be written or cannot hold the checkpoints.

  Orbax writes a new checkpoint before it deletes the oldest, so `keep + 1` must fit.
  """
  directory = workdir / "checkpoints"
  try:
    directory.mkdir(parents=True, exist_ok=True)
    # One name per process: processes sharing the workdir must not remove each other's probe.
    probe = directory / f".write_test.{jax.process_index()}.{os.getpid()}"
    probe.write_bytes(b"0" * 4096)
    probe.unlink()
  except OSError as error:
    raise StorageError(f"the workdir {workdir} is not writable ({error.strerror or error}); "
                       f"choose another --workdir") from error
  needed = checkpoint_bytes * (keep + 1)
  free = shutil.disk_usage(directory).free
  if free < needed:
    raise StorageError(
        f"the checkpoints need about {needed / 2**20:.1f} MiB in {directory} ({keep} kept + 1 "
        f"being written, {checkpoint_bytes / 2**20:.1f} MiB each) but only "
        f"{free / 2**20:.1f} MiB are free; free space, lower checkpoint.keep, choose another "
        f"--workdir, or set checkpoint.enabled=False")


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{name}."))
    else:
      flat[name] = value
  return flat


def config_differences(saved_json: str, current_json: str) -> dict[str, tuple[Any, Any]]:
  """`{key: (saved, current)}` for every config value that differs."""
  saved, current = _flatten(json.loads(saved_json)), _flatten(json.loads(current_json))
  return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
          if saved.get(k) != current.get(k)}


def check_compatible(saved_json: str, current_json: str, where: pathlib.Path) -> None:
  """ConfigError if the checkpoint cannot resume this config; a warning for other changes."""
  differences = config_differences(saved_json, current_json)
  structural = {k: v for k, v in differences.items()
                if any(k == s or k.startswith(f"{s}.") for s in STRUCTURAL_KEYS)}
  if structural:
    key, (saved, current) = next(iter(structural.items()))
    raise ConfigError(
        f"the checkpoint in {where} was written with {key}={saved!r} (this run: {current!r}), "
        f"which changes what is saved; resume with the config it was written with, or use "
        f"another --workdir to start afresh")
  changed = [k for k in differences if k not in ("restore", "progress_bar")]
  if changed:
    logging.warning("resuming from %s with a config that differs in %s", where,
                    ", ".join(f"{k} ({differences[k][0]!r} -> {differences[k][1]!r})"
                              for k in changed))


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
      multiprocessing = ocp.options.MultiprocessingOptions(
          active_processes=set(self.processes),
          barrier_sync_key_prefix=f"live-{'-'.join(map(str, self.processes))}-"
                                  f"{self._since_step}")
    # With active processes Orbax leaves the folder to us: the run's first manager made it.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self._keep, enable_async_checkpointing=self._async,
        create=not self._read_only and self.processes is None,
        cleanup_tmp_directories=not self._read_only,
        read_only=self._read_only, multiprocessing_options=multiprocessing)
    return ocp.CheckpointManager(self.directory, options=options)

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
              quarantine: bool = True) -> tuple[int, PyTree, dict] | None:
    """The newest readable checkpoint (or `step`) as `(step, arrays, meta)`, None if there is
    none. `template_of(meta)` gives the arrays' shapes and target devices (and may raise
    ConfigError for an incompatible checkpoint). Unreadable steps are skipped with a warning and,
    with `quarantine`, moved aside so that their step numbers can be saved again."""
    candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
    unreadable = []
    try:
      for candidate in candidates:
        try:
          meta = self._manager.restore(candidate, args=ocp.args.Composite(
              meta=ocp.args.JsonRestore()))["meta"]
          template = template_of(meta)
          packed = self._manager.restore(candidate, args=ocp.args.Composite(
              arrays=ocp.args.StandardRestore(packed_template(template))))["arrays"]
          return candidate, unpack(packed, template), meta
        except ConfigError:
          raise
        except Exception as error:  # noqa: BLE001 - any damage: try the previous step
          first_line = (str(error).strip().splitlines() or [""])[0][:200]
          logging.warning("checkpoint %s/%d is unreadable (%s: %s); trying the previous one",
                          self.directory, candidate, type(error).__name__, first_line)
          unreadable.append(candidate)
      return None
    finally:
      if quarantine and unreadable:
        self._quarantine(unreadable)

  def _quarantine(self, steps: list[int]) -> None:
    aside = self.directory.parent / f"{self.directory.name}_unreadable"
    aside.mkdir(exist_ok=True)
    for step in steps:
      source = self.directory / str(step)
      if source.exists():
        shutil.move(source, aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    self._manager.close()
    self._manager = self._open()

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
