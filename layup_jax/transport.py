"""Where a stage sent to peer j goes: one interface for a peer in this process or another.

A send of a computed stage (`send`) or AD-PSGD's pairwise average (`average`) to a device of
this process is a copy to its device and an atomic write of the replica store; to a device of
another process it goes through that process (layup_jax/crossprocess.py), which merges it or
answers with its half. The outboxes and the algorithms call this interface only; the runtime
runs its receiver loops (`loops`) and, at a consistent point, waits until every send to another
process has been merged there (`quiesce`).
"""

from collections.abc import Callable
from typing import Any

import jax

from layup_jax import crossprocess, transfer
from layup_jax.replicas import ReplicaStore
from layup_jax.scheduler import Task

PyTree = Any


class Transport:
  """Sends to the run's devices (peers are positions in the run; the store holds positions
  `first .. first + store.num_devices - 1`)."""

  def __init__(self, store: ReplicaStore, first: int, total_devices: int, transfer_host: str,
               stopped: Callable[[], bool]):
    self._store, self._first, self._stopped = store, first, stopped
    self._remote = None
    if store.num_devices < total_devices:  # a run across processes
      self._remote = crossprocess.RemotePeers(
          [d.process_index for d in jax.devices()[:total_devices]], first, store.num_devices,
          store.part_template, store.device,
          lambda j, s, received, amount: store.merge(j, s, received, amount, True),
          lambda j, s: store.take(j, s, halve=False)[0], store.correct_toward,
          host=transfer_host)
    self.across_processes = self._remote is not None
    # Seconds from offer to merge of each send from another process (None in one process).
    self.latencies = self._remote.latencies if self._remote is not None else None

  def local(self, peer: int) -> int | None:
    """`peer`'s index in this process's store, or None if it is another process's device."""
    j = peer - self._first
    return j if 0 <= j < self._store.num_devices else None

  def send(self, peer: int, s: int, part: PyTree, amount: float,
           add_weight: bool) -> PyTree | None:
    """Mixes the computed `part` into `peer`'s stage s with push-sum `amount` (added to its
    weight if `add_weight`). Returns what marks the merge as landed, or None when it is timed
    on the receiving process."""
    j = self.local(peer)
    if j is None:
      self._remote.send(peer, s, part, amount, self._stopped)
      return None
    received = transfer.to_device(part, self._store.device(j))
    return self._store.merge(j, s, received, amount, add_weight)

  def average(self, i: int, peer: int, s: int) -> Task:
    """AD-PSGD's pairwise average of stage s between this process's device i and `peer` (a
    task: it waits for both models to be computed)."""
    j = self.local(peer)
    if j is None:
      self._remote.average(i, peer, s, self._stopped)  # the peer's process corrects its side
      return
    yield from self._store.average_pair(i, j, s)

  def loops(self) -> list[tuple[str, Callable[[], None]]]:
    """The receiver loops to run on threads of their own: one per other process."""
    if self._remote is None:
      return []
    return [(f"layup-receiver-{k}", lambda k=k: self._remote.receive(k, self._stopped))
            for k in self._remote.other_processes()]

  def quiesce(self) -> None:
    """Waits until every send to another process has been merged there (nothing in one)."""
    if self._remote is not None:
      self._remote.quiesce(self._stopped)

  def remote_sends(self) -> int:
    """Sends this process made to other processes' devices."""
    return self._remote.sends() if self._remote is not None else 0
