"""An `AsyncRuntime`'s checkpoint: what resumes it, assembled from its parts.

At a consistent point (every task idle between iterations) the runtime's state is each device's
replica and stage keys (the rows this process writes of one array per dtype,
`checkpointing.DeviceRows`), the exchange's own state, and metadata: iterations, push-sum
weights, peer samplers, straggler clocks, losses not yet recorded, skip counts. Across
processes each process writes its own devices' rows and process 0 the rest, gathered; a
checkpoint resumes on another device count (remapped, layup_jax/pushsum/remap.py). An elastic run that
lost a process writes the live processes' devices only (the rows the gather's members hold), so
its checkpoints hold fewer devices than the run started with.
"""

from typing import Any

import jax
import numpy as np

from layup_jax.checkpoint.layout import DeviceRows, device_arrays_like
from layup_jax.errors import ConfigError
from layup_jax.multiprocess import gathers, wire
from layup_jax.pushsum import remap
from layup_jax.runtime.replicas import ReplicaStore

PyTree = Any
# 2: per-stage push-sum weights, step-driven schedules; 3: replicas and stage keys as rows of
# arrays sharded over the devices (`checkpointing.DeviceRows`).
CHECKPOINT_FORMAT = 3
_OWN_ARRAYS = ("replicas", "stage_keys")  # the runtime's checkpoint arrays; the others: exchange


def _exchange_arrays(arrays: dict) -> dict:
  """The exchange's entries of a checkpoint's arrays (all but `_OWN_ARRAYS`)."""
  return {key: value for key, value in arrays.items() if key not in _OWN_ARRAYS}


class RuntimeCheckpoint:
  """`state_dict`, `restore_template` and `load_state_dict` of one `AsyncRuntime`."""

  # Optax states are donated to their updates: a checkpoint's arrays are copied before the
  # runtime trains on.
  arrays_stay_valid = False

  def __init__(self, runtime):
    self.rt = runtime
    # The algorithm's own state (the periodic baselines' averages), or nothing to save.
    self.extra = runtime.exchange.state or _NoState()

  def state_dict(self) -> tuple[PyTree, dict[str, Any]]:
    """(device arrays, JSON-able metadata) that resume the runtime; at a consistent point."""
    # Each device's replica and keys: rows of the checkpoint's arrays that this process writes.
    arrays = {key: DeviceRows(value, self.rt.first, self.rt.total_devices, self.rt.run_devices)
              for key, value in store_arrays(self.rt.store).items()}
    exchange_arrays, exchange_meta = self.extra.state_dict()
    arrays.update(exchange_arrays)
    meta = {
        "format": CHECKPOINT_FORMAT,
        "num_devices": self.rt.num_devices,
        "iterations_done": self.rt.iterations_done(),
        "iterations": [r.iteration for r in self.rt.store.replicas],
        "weights": [list(row) for row in self.rt.store.weights.values],
        "peer_rngs": self.rt.peers.get_state(),
        "clocks": [c.get_state() for c in self.rt.clocks],
        "losses": [list(per_device) for per_device in self.rt.stats.losses],
        "skipped": list(self.rt.stats.skipped),
        "exchange": exchange_meta,
    }
    if self.rt.across_processes:
      return self._whole_run_state(arrays, meta)
    return arrays, meta

  # Per-device entries of the checkpoint metadata (each process holds its devices' part).
  _PER_DEVICE_META = ("iterations", "weights", "peer_rngs", "clocks", "losses", "skipped")

  def _whole_run_state(self, arrays: PyTree,
                       meta: dict[str, Any]) -> tuple[PyTree, dict] | tuple[None, None]:
    """Across processes: the whole run's state, of which each process writes its own devices'
    replicas (`DeviceRows`) and process 0 the rest, which every process holds the same: the
    metadata of every process and the exchange's state, gathered (host copies of what differs
    between processes; what the exchange holds the same on every process is this process's
    copy). A collective, at a consistent point. (None, None) where every live process is one
    that rejoined, which writes none: then no checkpoint can be written."""
    exchange_arrays = _exchange_arrays(arrays)
    same = set(self.extra.same_on_every_process)
    own_copy = wire.host_tree({k: v for k, v in exchange_arrays.items() if k in same})
    parts = gathers.all_gather_data({
        "arrays": wire.host_tree({k: v for k, v in exchange_arrays.items()
                                          if k not in same}),
        "meta": meta, "first": self.rt.first, "process": jax.process_index(),
        "saves": self.rt.elastic.saves_checkpoints})
    # The gather's members (after a loss, the live processes) write the rows of their devices;
    # a process that rejoined takes part in the gather but writes none (`saves_checkpoints`).
    parts = [part for part in parts if part["saves"]]
    if not parts:  # every live process rejoined: none can write (every process sees this)
      return None, None
    members = {part["process"] for part in parts}
    live = self.rt.elastic.devices_of(members)
    devices = tuple(self.rt.run_devices[g] for g in live)
    whole = {key: DeviceRows(list(arrays[key]), live.index(self.rt.first), len(live), devices)
             for key in _OWN_ARRAYS if self.rt.elastic.saves_checkpoints}
    exchange_arrays, exchange_meta = self.extra.whole_run_state(
        [({**own_copy, **part["arrays"]}, part["meta"]["exchange"], part["first"])
         for part in parts])
    whole.update(exchange_arrays)
    whole_meta = {**meta, "num_devices": len(live), "exchange": exchange_meta,
                  "iterations_done": sum(part["meta"]["iterations_done"] for part in parts),
                  "processes": sorted(members), "devices_of_run": self.rt.total_devices}
    for key in self._PER_DEVICE_META:
      whole_meta[key] = [x for part in parts for x in part["meta"][key]]
    return whole, whole_meta

  def _own_part(self, arrays: PyTree, meta: dict[str, Any]) -> tuple[PyTree, dict]:
    """This process's devices' part of a whole-run checkpoint (`_whole_run_state`): its rows,
    or, from a checkpoint of another device count (an elastic run's, written after a loss),
    its devices' part of every saved replica remapped to this run's count as one process
    remaps them (`remap.remap_replicas`; every process read every row, `restore_template`)."""
    saved, count = meta["num_devices"], self.rt.num_devices
    own = range(self.rt.first, self.rt.first + count)
    if saved == self.rt.total_devices:
      part = {key: arrays[key] for key in _OWN_ARRAYS}
      if any(len(part[key]) != count for key in _OWN_ARRAYS):
        raise ValueError("across processes a state holds this process's replicas only")
      exchange_arrays, exchange_meta = self.extra.own_part(
          _exchange_arrays(arrays), meta["exchange"], self.rt.first, count)
      part.update(exchange_arrays)
      per_device = {key: [meta[key][k] for k in own] for key in self._PER_DEVICE_META}
    else:
      host = jax.tree.map(np.asarray, list(arrays["replicas"]))
      trees, weights, source = remap.remap_replicas(host, meta["weights"], self.rt.total_devices)
      fresh = store_arrays(self.rt.store)["stage_keys"]  # a device that did not exist keeps its own
      part = {"replicas": [trees[k] for k in own],
              "stage_keys": [arrays["stage_keys"][k] if k < saved else fresh[k - own.start]
                             for k in own]}
      exchange_meta = meta["exchange"]
      per_device = {"weights": [weights[k] for k in own],
                    "iterations": [meta["iterations"][source[k]] for k in own],
                    "peer_rngs": self.rt.peers.get_state(),
                    "clocks": [meta["clocks"][source[k]] for k in own],
                    "losses": [[] for _ in own],
                    "skipped": [meta["skipped"][source[k]] for k in own]}
    part_meta = {**meta, "num_devices": count, "exchange": exchange_meta,
                 "iterations_done": meta["iterations_done"] // saved * count, **per_device}
    return part, part_meta

  def _check_remappable(self, meta: dict[str, Any]) -> None:
    """Across processes, a checkpoint of another device count resumes remapped only where the
    algorithm keeps no state of its own beyond the replicas (the gossip algorithms')."""
    if meta["num_devices"] != self.rt.total_devices and not isinstance(self.extra, _NoState):
      raise ConfigError(f"this checkpoint holds {meta['num_devices']} devices' replicas; across "
                        f"processes this algorithm resumes on as many ({self.rt.total_devices} "
                        f"here)")

  def _check_format(self, meta: dict[str, Any]) -> None:
    if meta.get("format") != CHECKPOINT_FORMAT:
      raise ConfigError(
          f"this checkpoint was written by an earlier layup_jax (checkpoint format "
          f"{meta.get('format', 1)}, this version's: {CHECKPOINT_FORMAT}); resume it with the "
          f"version that wrote it, or start the run in a new workdir")

  def restore_template(self, meta: dict[str, Any]) -> PyTree:
    """Across processes, this process's devices' replicas (their rows of the checkpoint); in
    one process, or across processes from a checkpoint of another device count, every saved
    replica (remapped by `load_state_dict`)."""
    self._check_format(meta)
    if self.rt.across_processes and meta["num_devices"] == self.rt.total_devices:
      template = {key: DeviceRows(value, self.rt.first, self.rt.total_devices, self.rt.run_devices)
                  for key, value in store_template(self.rt.store, self.rt.num_devices).items()}
    else:  # one process, or another device count across processes: every saved row
      if self.rt.across_processes:
        self._check_remappable(meta)
      template = {key: DeviceRows(value) for key, value in
                  store_template(self.rt.store, meta["num_devices"]).items()}
    template.update(self.extra.restore_template(meta["exchange"]))
    return template

  def load_state_dict(self, arrays: PyTree, meta: dict[str, Any]) -> None:
    """Continues from `state_dict()`'s output, remapped if it was saved on other devices."""
    self._check_format(meta)
    if self.rt.across_processes:
      arrays, meta = self._own_part(arrays, meta)
    saved = meta["num_devices"]
    source = self.rt.store.load(arrays, meta["weights"], meta["iterations"])
    stats = self.rt.stats
    for k in range(self.rt.num_devices):
      if k < saved:  # a device that existed keeps its clock and skip count
        self.rt.clocks[k].set_state(meta["clocks"][k])
        stats.skipped[k] = int(meta["skipped"][source[k]])
        if saved == self.rt.num_devices:
          stats.losses[k] = list(meta["losses"][k])
    if saved == self.rt.num_devices:
      self.rt.peers.set_state(meta["peer_rngs"])
    else:
      self.rt.peers.set_state(meta["peer_rngs"][:self.rt.num_devices]
                              + self.rt.peers.get_state()[saved:])
    self.extra.load_state_dict(arrays, meta["exchange"], saved)
    self.rt.restored(meta["iterations_done"] // saved * self.rt.num_devices)


class _NoState:
  """The `ExchangeState` of an algorithm that keeps nothing beyond the replicas."""

  same_on_every_process: tuple[str, ...] = ()

  def state_dict(self) -> tuple[dict, dict]:
    return {}, {}

  def restore_template(self, meta: dict) -> dict:
    return {}

  def load_state_dict(self, arrays: dict, meta: dict, saved_devices: int) -> None:
    pass

  def whole_run_state(self, parts: list[tuple[dict, dict, int]]) -> tuple[dict, dict]:
    return parts[0][0], parts[0][1]

  def own_part(self, arrays: dict, meta: dict, first: int, count: int) -> tuple[dict, dict]:
    return arrays, meta


def replica_arrays(store: ReplicaStore, i: int) -> dict[str, list]:
  """Device i's replica as the checkpoint holds it: per-stage params, state and Optax state."""
  r = store.replicas[i]
  return {"params": list(r.params), "state": list(r.state), "opt_state": list(r.opt_state)}


def store_arrays(store: ReplicaStore) -> PyTree:
  """Every replica of this process, and its stage keys (as key data)."""
  return {"replicas": [replica_arrays(store, i) for i in range(store.num_devices)],
          "stage_keys": [[jax.random.key_data(k) for k in r.stage_keys]
                         for r in store.replicas]}


def store_template(store: ReplicaStore, saved_devices: int) -> PyTree:
  """Shapes, dtypes and target devices of `saved_devices` replicas (device k % M each)."""
  device_of = lambda j: store.device(j % store.num_devices)
  return {
      "replicas": device_arrays_like(replica_arrays(store, 0), device_of, saved_devices),
      "stage_keys": device_arrays_like([jax.random.key_data(k)
                                        for k in store.replicas[0].stage_keys],
                                       device_of, saved_devices),
  }
