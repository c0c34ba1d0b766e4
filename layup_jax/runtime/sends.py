"""How a stage gets from device i to peer j (paper Algorithm 1: `send(x^{i,l}, j)`, peer update):
each device's `Outbox` of posted sends, and one `Transport` for a peer in this process or another.

A send takes stage s from the sender's replica together with the push-sum weight it carries
(`ReplicaStore.take`), waits (in the sender's updater task) until that version of the stage is
computed on the sender's device, copies it to the peer's device and merges it there
(`ReplicaStore.merge`: the peer's next program that reads the stage mixes it in). Waiting first is
what keeps devices independent: a device runs its programs in the order they were dispatched, so a
merge whose input were still being computed on the sender would hold up every program dispatched
on the peer after it, and a slow device would stall each device it sends to. The wait is on the
sender's own work and in its own task; the peer's device only ever receives finished arrays, and
the peer's tasks never wait.

Sends leave in the order they were posted. A posted stage goes as soon as it is computed: each
send first sends the posted stages that are ready (without waiting), and `flush`, a task
(`layup_jax.runtime.scheduler`), waits for the rest without blocking the thread that runs it. With
`max_in_flight`, at most that many of its sends may be on their way to peers (copied or merged
there not yet computed) before it waits for the oldest (that waits on a peer: the price of
bounding what peers hold).

A device admits a bounded number of programs in flight (32 per device in XLA's CPU client):
dispatching onto a device whose queue is full blocks the dispatching thread until it drains. A
slow device that every peer keeps sending to fills its queue with their merges, and then every
sender waits for it. So, with `reroute_congested` (the threaded runtime), a per-stage push-sum
send whose peer already has `CONGESTED_AT` merges pending goes to a random peer that has fewer,
when there is one: each stage is its own push-sum instance, so which peer receives it does not
matter to the sum. (Per-model weights are added to the chosen peer for the whole model, so those
sends are never rerouted.)

`Transport`: a send of a computed stage (`send`) or AD-PSGD's pairwise average (`average`) to a
device of this process is a copy to its device and an atomic write of the replica store; to a
device of another process it goes through that process (layup_jax/multiprocess/remote_peers.py), which merges
it or answers with its half. After `compress_sends` (a runtime whose exchange pushes stages,
`Exchange.sends_stages`) a send to another process travels compressed, with error feedback
(layup_jax/pushsum/compression.py): encoded when it is posted, so that the compressed stage is computed
right after the stage, the mass it held back returned at each consistent point (`settle`);
AD-PSGD's pairwise averages travel as they are. The outboxes and the algorithms call this
interface only; the runtime runs its receiver loops (`loops`) and, at a consistent point, waits
until every send to another process has been merged there (`quiesce`).

Why one module of this size: a send's whole path, from the choice of the peer through the
outbox to the transport that copies and merges it, reads and bounds one queue of posted sends.
"""

import collections
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from layup_jax.multiprocess import remote_peers
from layup_jax.multiprocess.traffic import BytesSent
from layup_jax.pushsum import compression
from layup_jax.runtime import transfer
from layup_jax.runtime.replicas import ReplicaStore
from layup_jax.runtime.scheduler import Ready, Task

PyTree = Any


class PeerSampler:
  """Each device's peers: uniformly random among the other devices, from the device's own
  seeded RNG (the paper's randomized gossip), unless a test scripted the next one.

  In a run across processes a process samples for its own devices, `first .. first + count -
  1` of the run's `num_devices`: `pick(i)` takes the position i among them and returns a
  peer's position in the whole run (in one process the two are the same)."""

  def __init__(self, num_devices: int, seed: int, gossip: bool = True, first: int = 0,
               count: int | None = None, remote_probability: float = -1.0):
    """`remote_probability` (a run across processes): the chance that a peer is another
    process's device, else one of this process's, each uniformly; -1: uniform over the run."""
    self.num_devices, self.gossip, self.first = num_devices, gossip, first
    count = num_devices if count is None else count
    self._rngs = [np.random.default_rng([seed, 1, first + i]) for i in range(count)]
    self._scripted: dict[int, int | None] = {}
    self._local = range(first, first + count)
    self._remote_probability = (remote_probability if 1 < count < num_devices
                                else -1.0)  # with no other local or remote device: uniform
    self._lost: frozenset[int] = frozenset()  # devices of lost processes (an elastic run)

  def lose(self, devices) -> None:
    """Peers are drawn among the other devices from now on (their process is lost)."""
    self._lost = self._lost | frozenset(devices)

  def rejoin(self, devices) -> None:
    """`devices` are peers again (their process rejoined)."""
    self._lost = self._lost - frozenset(devices)

  def pick(self, i: int) -> int | None:
    """Device i's next peer, or None when there is none (one device, or gossip off)."""
    if i in self._scripted:
      return self._scripted.pop(i)
    if self.num_devices == 1 or not self.gossip:
      return None
    me, rng = self.first + i, self._rngs[i]
    if self._lost:
      return self._pick_live(me, rng)
    if self._remote_probability >= 0:
      local = self._local
      if rng.random() < self._remote_probability:  # one of the other processes' devices
        j = int(rng.integers(self.num_devices - len(local)))
        return j if j < local.start else j + len(local)
      j = local.start + int(rng.integers(len(local) - 1))
      return j if j < me else j + 1
    j = int(rng.integers(self.num_devices - 1))
    return j if j < me else j + 1

  def _pick_live(self, me: int, rng: np.random.Generator) -> int | None:
    """`pick` among the devices not lost: the same rule, over the live ones."""
    local = [j for j in self._local if j != me]
    remote = [j for j in range(self.num_devices)
              if j not in self._lost and j not in self._local]
    if self._remote_probability >= 0 and local and remote:
      group = remote if rng.random() < self._remote_probability else local
    else:
      group = local + remote
    return group[int(rng.integers(len(group)))] if group else None

  def choose(self, i: int, candidates: list[int]) -> int:
    """One of `candidates`, uniformly, from device i's RNG."""
    return candidates[int(self._rngs[i].integers(len(candidates)))]

  def script(self, i: int, peer: int | None) -> None:
    """Makes `peer` device i's next pick (None: no peer)."""
    self._scripted[i] = peer

  def get_state(self) -> list:
    return [g.bit_generator.state for g in self._rngs]

  def set_state(self, states: list) -> None:
    for rng, state in zip(self._rngs, states):
      rng.bit_generator.state = state


class Transport:
  """Sends to the run's devices (peers are positions in the run; the store holds positions
  `first .. first + store.num_devices - 1`)."""

  def __init__(self, store: ReplicaStore, first: int, total_devices: int, transfer_host: str,
               stopped: Callable[[], bool], max_remote_backlog: int = 0):
    """`max_remote_backlog`: from how many unmerged sends to one other process a send there
    goes to a device of this process instead (`backlogged`; 0: never)."""
    self._store, self._first, self._stopped = store, first, stopped
    self.max_remote_backlog = max_remote_backlog
    self.rerouted = 0  # sends that went to a device of this process instead of a backlogged one
    self._remote = None
    # What this process sends to other processes: its gossip, and the periodic algorithms'
    # averages (counted by them, `traffic.compiled_share`).
    self.sent = BytesSent()
    if store.num_devices < total_devices:  # a run across processes
      self._remote = remote_peers.RemotePeers(
          [d.process_index for d in jax.devices()[:total_devices]], first, store.num_devices,
          store.part_template, store.device,
          lambda j, s, received, amount: store.merge(j, s, received, amount, True),
          lambda j, s: store.take(j, s, halve=False)[0], store.correct_toward,
          host=transfer_host, sent=self.sent, num_stages=store.num_stages)
    self.across_processes = self._remote is not None
    # Seconds from offer to merge of each send from another process (None in one process).
    self.latencies = self._remote.latencies if self._remote is not None else None

  def compress_sends(self, codec: str) -> None:
    """Sends to other processes travel as `codec` from now on (layup_jax/pushsum/compression.py;
    "none", or a run in one process: as they are). Called once, before the run."""
    if self._remote is None or codec == "none":
      return
    store = self._store
    self._remote.compressor = compression.Compressor(
        codec, [store.part_template(s) for s in range(store.num_stages)],
        [store.device(j) for j in range(store.num_devices)])

  @property
  def sends_dropped(self) -> int:
    """Sends from other processes dropped as malformed (0 in one process)."""
    return sum(self._remote.dropped.values()) if self._remote is not None else 0

  @property
  def compressor(self) -> compression.Compressor | None:
    """The codec and residuals of compressed sends (`compress_sends`), kept where they are
    decoded (layup_jax/multiprocess/remote_peers.py); None when sends travel as they are."""
    return self._remote.compressor if self._remote is not None else None

  def backlogged(self, peer: int) -> bool:
    """Whether `peer` is another process's device to whose process `max_remote_backlog` sends
    are not merged yet."""
    if self._remote is None or not self.max_remote_backlog or self.local(peer) is not None:
      return False
    return self._remote.backlog(peer) >= self.max_remote_backlog

  def lose(self, process: int) -> None:
    """An elastic run goes on without `process` (layup_jax/multiprocess/setup.py `Membership`)."""
    if self._remote is not None:
      self._remote.lose(process)

  def rejoin(self, process: int) -> list[tuple[str, Callable[[], None]]]:
    """`process` is admitted back (layup_jax/multiprocess/setup.py `Membership`); returns its new
    receiver loop, to run on a thread of its own."""
    self._remote.rejoin(process)
    return [self._loop(process)]

  def forget(self, process: int) -> None:
    """Process 0, admitting `process` back: its earlier run's notices and acknowledgements go."""
    self._remote.forget(process)

  def set_lost(self, processes) -> None:
    """A process that rejoined: the processes still lost; the others' addresses as they are
    now (`RemotePeers.readdress`)."""
    if self._remote is not None:
      self._remote.lost = set(processes)
      self._remote.readdress()

  def give(self, peer: int, s: int, part: PyTree, amount: float) -> None:
    """Sends the computed `part` uncompressed to another process's device `peer` with push-sum
    `amount` (a share given to a device that rejoins: a replica, not an update)."""
    self._remote.send(peer, s, part, amount, self._stopped)

  def is_lost(self, peer: int) -> bool:
    """Whether `peer` is a device of a process declared lost."""
    return self._remote is not None and self._remote.is_lost(peer)

  def local(self, peer: int) -> int | None:
    """`peer`'s index in this process's store, or None if it is another process's device."""
    j = peer - self._first
    return j if 0 <= j < self._store.num_devices else None

  def global_position(self, j: int) -> int:
    """The run position of this process's device j."""
    return self._first + j

  def encode(self, i: int, peer: int, s: int, part: PyTree, amount: float
             ) -> tuple[PyTree, bool]:
    """What a send of device i's stage s to `peer` carries: compressed (and True) when `peer`
    is another process's device and the run compresses, else `part` (and False)."""
    if self.compressor is None or self.local(peer) is not None:
      return part, False
    return self.compressor.encode(i, s, part, amount), True

  def send(self, peer: int, s: int, part: PyTree, amount: float,
           add_weight: bool, encoded: bool = False) -> PyTree | None:
    """Mixes the computed `part` (`encode`'s, if `encoded`) into `peer`'s stage s with push-sum
    `amount` (added to its weight if `add_weight`). Returns what marks the merge as landed, or
    None when it is timed on the receiving process."""
    j = self.local(peer)
    if j is None:
      self._remote.send(peer, s, part, amount, self._stopped, encoded)
      return None
    received = transfer.to_device(part, self._store.device(j))
    if encoded:  # an encoded send that went to a device of this process (`backlogged`)
      received = self.compressor.decode(s, received)
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
    """The loops to run on threads of their own: per other process, a receiver and a notice
    writer (remote_peers.RemotePeers.write_notices; it outlives a rejoin of that process)."""
    if self._remote is None:
      return []
    others = self._remote.other_processes()
    return [self._loop(k) for k in others] + [
        (f"layup-notices-{k}", lambda k=k: self._remote.write_notices(k, self._stopped))
        for k in others]

  def _loop(self, k: int) -> tuple[str, Callable[[], None]]:
    return (f"layup-receiver-{k}", lambda: self._remote.receive(k, self._stopped))

  def quiesce(self) -> None:
    """Waits until every send to another process has been merged there (nothing in one)."""
    if self._remote is not None:
      self._remote.quiesce(self._stopped)

  def settle(self) -> None:
    """At a consistent point: compressed sends give back the mass they held out, so the
    push-sum sums are exact there (nothing without compression)."""
    if self.compressor is not None:
      weights = self._store.weights.values
      self.compressor.settle(lambda i, s: weights[i][s], self._store.add_to_params)

  def compile(self) -> list:
    """Compiles what compressed sends run (nothing without compression); returns outputs."""
    if self.compressor is None:
      return []
    store = self._store
    outputs = self.compressor.compile(
        [[store.take(j, s, halve=False)[0] for s in range(store.num_stages)]
         for j in range(store.num_devices)])
    # And `settle`'s return of a (here zero) residual: x + 0 leaves every replica as it is.
    self.compressor.settle(lambda i, s: 1.0, store.add_to_params)
    return outputs

  def remote_sends(self) -> int:
    """Sends this process made to other processes' devices."""
    return self._remote.sends() if self._remote is not None else 0

# Merges pending on a device from which it counts as congested: a quarter of the 32 programs
# XLA's CPU client admits per device, leaving room for the device's own iteration (a forward,
# a backward and an update per stage, dispatched ahead).
CONGESTED_AT = 8


# A scalar computed from a landed stage on its device: ready once the stage is there, and
# holding it (to bound the sends in flight) keeps no copy of the stage alive.
_landed = jax.jit(lambda leaf: jnp.sum(leaf.ravel()[:1]))


def compile_landed(store: ReplicaStore) -> list:
  """Runs the landed-scalar function once per stage on every device (used with a bound)."""
  return [_landed(jax.tree.leaves(store.params(j, s))[0])
          for j in range(store.num_devices) for s in range(store.num_stages)]


def _is_ready(tree: PyTree) -> bool:
  return all(leaf.is_ready() for leaf in jax.tree.leaves(tree))


class Outbox:
  """Device `sender`'s sends not yet made, and its merges not yet landed on peers."""

  def __init__(self, store: ReplicaStore, sender: int, transport: Transport,
               choose: Any = None, max_in_flight: int = 0):
    """`choose(sender, candidates)` picks a peer among candidates (rerouted sends). Peers are
    positions in the run; `transport` takes a send to a device of this process or another."""
    self._store, self._sender, self._choose = store, sender, choose
    self._transport = transport
    self.reroute_congested = False
    # Posted sends: (peer, stage, part, amount, whether the merge adds it, future or None,
    # whether the part is compressed).
    self._pending: collections.deque = collections.deque()
    self._in_flight: collections.deque = collections.deque()  # landed markers, oldest first
    self.max_in_flight = max_in_flight or math.inf
    self.sent = 0  # sends made (to this process's devices and others')
    self.peak_in_flight = 0  # the most sends on their way at once, under `max_in_flight`
    self.watch = False  # whether a send returns a future of the merged stage (timed iterations)

  def send_halved(self, peer: int, s: int) -> Future | None:
    """Sends stage s to `peer` with per-stage push-sum weights: w_{i,s} halved now, in the
    same atomic write that takes the stage, and the half added to w_{j,s} by the merge."""
    return self._push(peer, s, None)

  def send_weighted(self, peer: int, s: int, amount: float) -> Future | None:
    """Sends stage s to `peer` with Algorithm 1's per-model weights: w_i was halved for the
    whole model (`ReplicaStore.halve_model_weight`), the merge mixes with `amount`, and the
    sender adds it to w_j once every stage has gone."""
    return self._push(peer, s, amount)

  def _push(self, peer: int, s: int, amount: float | None) -> Future | None:
    """Posts the send. With `watch`, returns a future of the merged stage (set once the send is
    made), else None. Never waits: what is not computed yet goes with a later send or
    `flush`."""
    part, halved = self._store.take(self._sender, s, halve=amount is None)
    amount = halved if amount is None else amount
    part, encoded = self._transport.encode(self._sender, peer, s, part, amount)
    merged = Future() if self.watch else None
    self._pending.append((peer, s, part, amount, halved is not None, merged, encoded))
    while self._pending and _is_ready(self._pending[0][2]) and self._room():
      self._send(*self._pending.popleft())
    return merged

  def flush(self) -> Task:
    """Sends every posted stage as it is computed on the sender's device (a task: it waits for
    that, and for room under `max_in_flight`)."""
    while self._pending:
      yield Ready(self._pending[0][2])  # computed on our device: the peer never waits on it
      while not self._room():  # bounds what peers hold of ours
        yield Ready(self._in_flight[0])
      self._send(*self._pending.popleft())

  def _room(self) -> bool:
    """Whether fewer than `max_in_flight` of our merges are uncomputed on peers."""
    while self._in_flight and self._in_flight[0].is_ready():
      self._in_flight.popleft()
    return len(self._in_flight) < self.max_in_flight

  def _send(self, peer: int, s: int, part: PyTree, amount: float, add_weight: bool,
            watched: Future | None, encoded: bool) -> None:
    """Sends a computed `part` (and room under the bound)."""
    self.sent += 1
    transport = self._transport
    if add_weight and (transport.is_lost(peer) or transport.backlogged(peer)):
      # Its process is lost, or the link's queue to it is full: a device of this process.
      others = [k for k in range(self._store.num_devices) if k != self._sender]
      if others:
        peer = transport.global_position(self._choose(self._sender, others))
        transport.rerouted += 1
    j = transport.local(peer)
    if j is not None and self.reroute_congested and add_weight:
      peer += self._uncongested(j) - j
    landed = self._transport.send(peer, s, part, amount, add_weight, encoded)
    if landed is None:  # timed on the receiving process (`remote_send_latency_ms`)
      if watched is not None:
        watched.set_result(None)
      return
    if self.max_in_flight < math.inf:
      self._in_flight.append(_landed(landed))
      self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
    if watched is not None:
      watched.set_result(landed)

  def _uncongested(self, peer: int) -> int:
    """`peer`, or a random peer with fewer than `CONGESTED_AT` merges pending if it has as
    many, and some other has fewer."""
    store = self._store
    if store.pending_merges(peer) < CONGESTED_AT:
      return peer
    free = [k for k in range(store.num_devices)
            if k != self._sender and store.pending_merges(k) < CONGESTED_AT]
    return self._choose(self._sender, free) if free else peer

  def in_flight(self) -> int:
    return len(self._in_flight)
