"""Gossip with devices of other processes: the arrays through `jax.experimental.transfer`, the
notices and acknowledgements through the coordination service's key-value store.

A send to a device of another process (an outbox's send, layup_jax/runtime/sends.py) offers the
computed stage to this process's transfer server under a fresh uuid (`await_pull`) and then
queues a notice `(uuid, peer, stage, push-sum amount)` for `layup_jax/gossip/<to>/<from>/<b>/<n>`,
n counting the notices from this process to that one (b = its batch of 16). A notice writer per
other process (a thread of its own) writes them in order and reads that process's
acknowledgements while any is outstanding: each is a round trip to the coordination service,
which on the updater's thread took half of its time at remote peers 1 in 2
(docs/records/multihost.md). The peer's process has one receiver thread per other process (started by
the runtime): it waits for notice n, pulls the arrays onto the peer's device, merges them into
the replica with the same atomic write as a local send (`ReplicaStore.merge`: the push-sum
amount added to w_{j,s} with the stage), and acknowledges with
`layup_jax/gossip-ack/<from>/<to> = n` (every 16 notices, and whenever none is waiting),
deleting a batch's notices once all are merged. Only announced uuids are pulled: a pull of a
uuid never offered waits forever (docs/records/multihost_probes.md).

The sender never waits for the receiver's device: the offer is of a stage already computed, and
the notice is a few bytes. It waits only when `max_in_flight` notices to one process are not
acknowledged yet (what the transfer server holds for pulls stays bounded), and in `quiesce`,
where the runtime's threads are idle: every notice acknowledged means every share in flight has
been added on its peer, so the per-stage push-sum sum over all processes is exact again there.
"""

import collections
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from layup_jax.multiprocess import gathers, membership, signed, traffic
from layup_jax.multiprocess.wire import (
  _address_key,
  _host_of,
  await_transfer,
  shut_sockets_to,
  start_server,
  transfer_host,
)

PyTree = Any
_NOTICE_WAIT_MS = 200  # a receiver looks at the stop flag this often while no notice comes
# Key-value writes cost milliseconds on a busy host, more than a pull and a merge of a stage:
# a receiver acknowledges every `_ACK_EVERY` notices, or as soon as no notice is waiting
# (within `_IDLE_MS`), and deletes its notices a batch directory at a time.
_ACK_EVERY = 16
_IDLE_MS = 2
# Notices per batch directory: the receiver reads the rest of the current batch in one call
# after each notice it waited for, so a smaller batch is fewer bytes per read (64: 5.4 MB a
# digits run from the store's host, 16: 3.6 MB; docs/records/multihost.md), at one delete per batch.
_BATCH = 16
_ACK_POLL_S = 0.002  # how often a notice writer reads the acknowledgements while any is due
_PULL_POLL_S = 0.001  # how often an elastic run's pull looks whether its source was lost


_NOTICE_FIELDS = frozenset({"uuid", "peer", "stage", "amount", "encoded", "offered_at"})


def _parse_notice(text: str) -> dict:
  """A notice as written (JSON); what does not parse to a dict is an empty one, which
  `notice_problem` refuses."""
  try:
    notice = json.loads(text)
  except ValueError:
    return {}
  return notice if isinstance(notice, dict) else {}


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@jax.jit
def _all_finite(tree: PyTree) -> jax.Array:
  """Whether every value of a received stage is finite (one program on its device)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


class RemotePeers:
  """This process's sends to, and receipts from, the devices of the other processes."""

  def __init__(self, process_of: list[int], first: int, count: int,
               part_template: Callable[[int], PyTree], device_of: Callable[[int], jax.Device],
               merge: Callable[[int, int, PyTree, float], None],
               read: Callable[[int, int], PyTree],
               correct: Callable[[int, int, PyTree, PyTree], None], host: str = "",
               max_in_flight: int = 64, sent: traffic.BytesSent | None = None,
               num_stages: int = 0):
    """`process_of[g]`: the process of global device g; this process drives devices
    `first .. first + count - 1` (store indices 0 .. count - 1). `part_template(s)`: the
    pytree of ShapeDtypeStructs of what a send of stage s carries; `merge(j, s, received,
    amount)`: the store's merge into local device j; `read(j, s)` and `correct(j, s, before,
    other)`: the store's reads and pairwise-average corrections (AD-PSGD); `sent` counts the
    bytes of every offer (each is pulled once, by another process). `compressor`
    (layup_jax/pushsum/compression.py), set before the run when sends travel compressed, decodes
    them."""
    self._client = signed.client()
    self._me, self._process_of = jax.process_index(), list(process_of)
    self._first, self._count = first, count
    self._template, self._device_of, self._merge = part_template, device_of, merge
    self._read, self._correct = read, correct
    self.num_stages = num_stages  # a notice names one of them (`notice_problem`)
    self.compressor: Any = None
    self.max_in_flight = max_in_flight
    self.sent = sent if sent is not None else traffic.BytesSent()
    self._server = start_server(transfer_host(host), count)
    # Each process's address also stays in the store, where a process that rejoins finds the
    # others' (and they its new one).
    self._client.key_value_set(_address_key(self._me), self._server.address(),
                               allow_overwrite=True)
    if membership.members.rejoining:  # the others are past this gather
      self._addresses = {k: self._client.blocking_key_value_get(_address_key(k), 10_000)
                         for k in self.other_processes()}
    else:
      self._addresses = dict(enumerate(gathers.all_gather_json(self._server.address())))
    self._connections: dict[int, Any] = {}
    self._lock = threading.Lock()  # notice counters and acknowledgements, shared by senders
    self._sent = {k: 0 for k in self.other_processes()}
    self._acked = {k: 0 for k in self.other_processes()}
    # Per other process, the notices (key, value) not yet written, in order (`write_notices`).
    self._outgoing = {k: collections.deque() for k in self.other_processes()}
    self._queued = threading.Condition(self._lock)
    # Per received send: seconds from its offer (the sender's clock) to its merge dispatched
    # here; comparable clocks on one host, an estimate across hosts.
    self.latencies: collections.deque = collections.deque()
    self.lost: set[int] = set()  # processes declared lost (an elastic run goes on without them)
    # Per other process, the count of its rejoins: a receiver loop of an earlier one ends.
    self._joins = {k: 0 for k in self.other_processes()}
    self.dropped: dict[int, int] = {}  # per other process, its sends dropped as malformed

  def lose(self, process: int) -> None:
    """Process `process` is lost: nothing more goes to it or waits for it; its receiver loop
    ends. What was announced to it and not merged is lost with it.

    A process killed on a live host has its connections closed by that host; one whose host
    vanished (power, a cable, a link down) leaves them open, and the transfer library's
    receive threads block in `recv` on them for as long as TCP retransmits (minutes): the
    pulls from live processes queued on those threads wait too, and every survivor stalls
    at its next consistent point (found in the vanished-host drill, docs/records/elastic.md). So its
    host's sockets are shut down here, as if it had closed them, unless a live process (or
    this one) has the same address: processes sharing a host are lost together when it
    vanishes, and one killed alone closes its own."""
    self.lost = self.lost | {process}
    with self._lock:
      self._outgoing[process].clear()
    if process not in self._addresses:  # lost before the addresses were gathered
      return
    host = _host_of(self._addresses[process])
    live = {_host_of(self._server.address())} | {
        _host_of(a) for k, a in self._addresses.items() if k not in self.lost}
    if host not in live:
      shut_sockets_to(host)

  def rejoin(self, process: int) -> None:
    """`process` was started again and admitted (at a consistent point, every notice to and
    from its earlier run cleared, `forget`): sends and pulls go to its new transfer server,
    counted afresh; a new receiver loop (`receive`) takes its notices."""
    address = self._client.blocking_key_value_get(_address_key(process), 10_000)
    with self._lock:
      self._sent[process] = self._acked[process] = 0
      self._outgoing[process].clear()
      self._addresses[process] = address
      self._connections.pop(process, None)
      self._joins[process] += 1
    self.lost = self.lost - {process}

  def readdress(self) -> None:
    """This process, admitted back: every live process's transfer address as the store holds
    it now. Read at this process's start, a process that was itself started again after that
    (two restarts waiting at once) had the address of its earlier run, gone with it: every pull
    from it blocked, the share it gave this process among them (a churn drill's stall)."""
    for process in self.other_processes():
      if process not in self.lost:
        address = self._client.blocking_key_value_get(_address_key(process), 10_000)
        with self._lock:
          self._addresses[process] = address
          self._connections.pop(process, None)

  def forget(self, process: int) -> None:
    """The leader, admitting `process` back: deletes every notice and acknowledgement between
    its earlier run and the others (no process sends or receives at this point)."""
    self._client.key_value_delete(f"layup_jax/gossip/{process}")
    self._client.key_value_delete(f"layup_jax/gossip-ack/{process}")
    for k in range(jax.process_count()):
      if k != process:
        self._client.key_value_delete(f"layup_jax/gossip/{k}/{process}")
        self._client.key_value_delete(f"layup_jax/gossip-ack/{k}/{process}")

  def other_processes(self) -> list[int]:
    return sorted({p for p in self._process_of if p != self._me})

  def is_remote(self, device: int) -> bool:
    return not self._first <= device < self._first + self._count

  def is_lost(self, device: int) -> bool:
    """Whether global device `device` belongs to a process declared lost."""
    return self._process_of[device] in self.lost

  # --- sending --------------------------------------------------------------------------------

  def send(self, peer: int, s: int, part: PyTree, amount: float,
           stopped: Callable[[], bool], encoded: bool = False) -> None:
    """Offers `part` (computed; compressed if `encoded`) for `peer`'s process to pull and merge
    into stage s with the push-sum `amount` (its latency is recorded there, in `latencies`)."""
    process = self._process_of[peer]
    notice = self._next_notice(process)
    while notice - self._acked[process] > self.max_in_flight:  # read by its notice writer
      if stopped() or process in self.lost:
        break
      time.sleep(_ACK_POLL_S)
    if process in self.lost:  # lost meanwhile: its amount goes with it
      return
    self._offer_and_announce(process, notice, peer, s, part, amount, encoded=encoded)

  def _next_notice(self, process: int) -> int:
    """The number of this process's next notice to `process` (counted per receiving process)."""
    with self._lock:
      self._sent[process] += 1
      return self._sent[process]

  def _offer_and_announce(self, process: int, notice: int, peer: int, s: int, part: PyTree,
                          amount: float, average: bool = False, encoded: bool = False) -> int:
    """Offers `part` under a fresh uuid, then writes notice number `notice` to `process`;
    returns the uuid."""
    offered_at = time.time()
    uuid = self._offer(part)
    value = json.dumps({"uuid": uuid, "peer": peer, "stage": s, "amount": amount,
                        "offered_at": offered_at, "average": average, "encoded": encoded})
    with self._lock:  # written by `write_notices`, in the order of the notices' numbers
      self._outgoing[process].append((self._notice_key(process, self._me, notice), value))
      self._queued.notify_all()
    return uuid

  def write_notices(self, process: int, stopped: Callable[[], bool]) -> None:
    """The notice writer for `process` (a runtime thread), until `stopped()`: writes the queued
    notices in order, and while any notice to it is unacknowledged reads its acknowledgements
    (every `_ACK_POLL_S`), which `backlog` and `send` then read without a round trip. Nothing
    goes to a process declared lost (`lose` drops its queue)."""
    queue = self._outgoing[process]
    while not stopped():
      with self._lock:
        if not queue:  # a queued notice wakes it at once
          outstanding = self._acked[process] < self._sent[process]
          self._queued.wait(_ACK_POLL_S if outstanding else _NOTICE_WAIT_MS / 1e3)
        batch = list(queue)
        queue.clear()
      try:
        for key, value in batch:
          if process in self.lost:
            break
          self._client.key_value_set(key, value, allow_overwrite=True)  # over a stranger's
        if self._acked[process] < self._sent[process] and process not in self.lost:
          self.acknowledged(process)
      except Exception:
        if process not in self.lost and not membership.members.await_loss(process):
          raise

  def _offer(self, part: PyTree) -> int:
    """Offers `part` (computed) to one pull under a fresh random uuid (62 bits: a client that
    reaches the transfer server cannot guess one to pull a replica's stage); returns it."""
    uuid = 1 + secrets.randbits(62)
    leaves = jax.tree.leaves(part)
    self._server.await_pull(uuid, leaves)
    self.sent.add(traffic.tree_bytes(leaves))
    return uuid

  def sends(self) -> int:
    """How many sends this process has made to other processes' devices."""
    with self._lock:
      return sum(self._sent.values())

  def backlog(self, peer: int) -> int:
    """Sends to `peer`'s process not merged there yet, by the acknowledgements its notice
    writer read (every `_ACK_POLL_S` while any is outstanding; a read of the store costs more
    than a send)."""
    process = self._process_of[peer]
    with self._lock:
      return self._sent[process] - self._acked[process]

  def acknowledged(self, process: int) -> int:
    """How many of this process's notices to `process` it has merged (read from the store)."""
    value = self._try_get(f"layup_jax/gossip-ack/{self._me}/{process}")
    with self._lock:
      if value is not None:
        self._acked[process] = max(self._acked[process], int(value))
      return self._acked[process]

  def quiesce(self, stopped: Callable[[], bool]) -> None:
    """Waits until every notice sent so far is acknowledged (at a consistent point). A process
    whose acknowledgements do not move for the progress timeout is accused (it hangs, or the
    link to it is cut while the store still answers) and waited for until it is declared."""
    members = membership.members
    with members.waiting():
      for process in self.other_processes():
        acked, patience = self.acknowledged(process), membership.AccusingWait(self._client,
                                                                              process)
        while (acked < self._sent[process] and not stopped() and process not in self.lost):
          time.sleep(_ACK_POLL_S)
          if (now := self.acknowledged(process)) != acked:
            acked = now
            patience.restart()
          else:
            patience.check(lambda waited: f"sends to process {process} were not "
                                          f"acknowledged for {waited:g} s")

  # --- receiving ------------------------------------------------------------------------------

  def receive(self, source: int, stopped: Callable[[], bool]) -> None:
    """The receiver loop for notices from process `source` (a runtime thread), until
    `stopped()`, `source` is lost (then a pull from it that fails ends the loop quietly), or
    it rejoins (a new loop takes over)."""
    run = self._joins[source]
    ended = lambda: stopped() or source in self.lost or self._joins[source] != run
    try:
      self._receive(source, ended)
    except Exception:
      # A pull from a process that died fails at once; in an elastic run it is declared lost
      # within the watchdog's timeout, and then this loop just ends.
      if not (source in self.lost or self._joins[source] != run
              or membership.members.await_loss(source)):
        raise

  def _receive(self, source: int, ended: Callable[[], bool]) -> None:
    """Waits for the next notice, then takes every later one already written to its batch in
    one read, and merges them in order."""
    received = acknowledged = 0
    while not ended():
      key = self._notice_key(self._me, source, received + 1)
      try:
        first = self._client.blocking_key_value_get(
            key, _IDLE_MS if acknowledged < received else _NOTICE_WAIT_MS)
      except Exception as error:  # DEADLINE_EXCEEDED: nothing yet
        if "DEADLINE_EXCEEDED" not in str(error):
          raise
        if acknowledged < received:  # idle: acknowledge what is merged
          acknowledged = self._acknowledge(source, received)
        continue
      notices = [_parse_notice(first)]
      if received % _BATCH != _BATCH - 1:  # not the batch's last: more may wait behind it
        batch = self._batch_key(self._me, source, received + 1)
        waiting = {int(k.rsplit("/", 1)[1]): v
                   for k, v in self._client.key_value_dir_get(batch + "/")}
        n = received + 2
        while n in waiting:
          notices.append(_parse_notice(waiting[n]))
          n += 1
      for notice in notices:
        if notice.get("average") is True:
          self._answer_average(source, notice)
        else:
          self._receive_one(source, notice)
        received += 1
        if received % _BATCH == 0:  # the batch's notices are all merged
          self._client.key_value_delete(self._batch_key(self._me, source, received))
        if received - acknowledged >= _ACK_EVERY:
          acknowledged = self._acknowledge(source, received)

  def _pull(self, source: int, uuid: int, j: int, s: int, encoded: bool = False) -> PyTree:
    """An announced offer of stage s from process `source`, onto local device j (as it
    travelled: compressed if `encoded`)."""
    template = self.compressor.wire_templates[s] if encoded else self._template(s)
    sharding = jax.sharding.SingleDeviceSharding(self._device_of(j))
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sharding)
             for t in jax.tree.leaves(template)]
    leaves = self._connection(source).pull(uuid, specs)
    return jax.tree.unflatten(jax.tree.structure(template), leaves)

  def _receive_one(self, source: int, notice: dict) -> None:
    """Pulls one announced send onto its device and merges it, if the notice is well formed
    and what arrived is finite (else it is dropped, `_drop`)."""
    problem = self.notice_problem(notice)
    if problem is not None:
      self._drop(source, problem)
      return
    j, s = notice["peer"] - self._first, notice["stage"]
    received = self._arrived(source, self._pull(source, notice["uuid"], j, s, notice["encoded"]))
    if notice["encoded"]:
      received = self.compressor.decode(s, received)
    if not bool(_all_finite(received)):
      self._drop(source, f"stage {s} for device {notice['peer']} holds non-finite values")
      return
    self._merge(j, s, received, float(notice["amount"]))
    self.latencies.append(time.time() - notice["offered_at"])

  def notice_problem(self, notice: Any, average: bool = False) -> str | None:
    """What is wrong with a received gossip notice (None: nothing): its peer must be a device of
    this process, its stage one of the model's, its push-sum amount finite and in (0, 1] (a
    pairwise average's, `average`, carries none)."""
    if not isinstance(notice, dict) or not _NOTICE_FIELDS <= set(notice):
      return "a notice without its fields"
    peer, stage, amount = notice["peer"], notice["stage"], notice["amount"]
    if not _is_int(peer) or not self._first <= peer < self._first + self._count:
      return f"a notice for device {peer!r}, not one of this process's"
    if not _is_int(stage) or not 0 <= stage < self.num_stages:
      return f"a notice for stage {stage!r} of {self.num_stages}"
    if not average and (not isinstance(amount, (int, float)) or isinstance(amount, bool)
                        or not 0.0 < amount <= 1.0):  # NaN compares false: refused too
      return f"a notice carrying push-sum amount {amount!r}, not in (0, 1]"
    if not _is_int(notice["uuid"]) or not isinstance(notice["encoded"], bool) or not isinstance(
        notice["offered_at"], (int, float)):
      return "a notice with a malformed offer"
    return None

  def _drop(self, source: int, problem: str) -> None:
    """A bad send from `source` is dropped and counted; its sender is named once."""
    self.dropped[source] = count = self.dropped.get(source, 0) + 1
    if count == 1:
      print(f"process {self._me}: dropped a send from process {source}: {problem} (sends "
            f"dropped are counted, this line is not repeated)", file=sys.stderr, flush=True)
    bound = membership.members.max_dropped_sends
    if bound and count == bound:  # past it the sender is treated as lost
      membership.members.accuse(self._client, source,
                                f"{count} malformed sends ({problem})")

  # --- pairwise averages (AD-PSGD) ------------------------------------------------------------

  def average(self, i: int, peer: int, s: int, stopped: Callable[[], bool]) -> None:
    """AD-PSGD's pairwise average of stage s of local device i with `peer` on another
    process: offers i's version (the store's read, computed), waits for the peer's version
    read when the peer's process took the offer, and corrects i toward the pair's average (the
    store's `correct_toward`); the peer's process corrects its side the same way
    (`_answer_average`), so the sum of the two models is kept. Synchronous by definition: the
    caller waits for the peer's process (its receiver thread, never its updater)."""
    process = self._process_of[peer]
    mine = jax.block_until_ready(self._read(i, s))
    notice = self._next_notice(process)
    uuid = self._offer_and_announce(process, notice, peer, s, mine, 0.0, average=True)
    reply = f"layup_jax/gossip-reply/{self._me}/{uuid}"
    members = membership.members
    patience = membership.AccusingWait(self._client, process)
    with members.waiting():
      while True:
        try:
          theirs_uuid = int(self._client.blocking_key_value_get(reply, _NOTICE_WAIT_MS))
          break
        except Exception as error:  # DEADLINE_EXCEEDED: not answered yet
          if process in self.lost:  # no answer will come: this side stays as it was
            return
          if "DEADLINE_EXCEEDED" not in str(error) or stopped():
            raise
        patience.check(lambda waited: f"a pairwise average with process {process} was not "
                                      f"answered for {waited:g} s")
    self._client.key_value_delete(reply)
    try:  # in an elastic run, waited for here, where a dead peer's failure can be caught
      theirs = self._arrived(process, self._pull(process, theirs_uuid, i, s))
    except Exception:
      if membership.members.await_loss(process):  # died mid-pull: this side stays as it was
        return
      raise
    self._correct(i, s, mine, theirs)

  def _answer_average(self, source: int, notice: dict) -> None:
    """The peer's side of `average`: offers its version as read now, then pulls the
    requester's and corrects its own toward the average (unless the notice is malformed or
    what arrives is not finite: dropped, `_drop`)."""
    problem = self.notice_problem(notice, average=True)
    if problem is not None:
      self._drop(source, problem)
      return
    j, s = notice["peer"] - self._first, notice["stage"]
    theirs = jax.block_until_ready(self._read(j, s))
    uuid = self._offer(theirs)
    self._client.key_value_set(f"layup_jax/gossip-reply/{source}/{notice['uuid']}", str(uuid))
    other = self._arrived(source, self._pull(source, notice["uuid"], j, s))
    if not bool(_all_finite(other)):
      self._drop(source, f"stage {s} for device {notice['peer']} holds non-finite values")
      return
    self._correct(j, s, theirs, other)
    self.latencies.append(time.time() - notice["offered_at"])

  def _arrived(self, source: int, pulled: PyTree) -> PyTree:
    """`await_transfer` of `pulled` from `source`, which this process may find lost."""
    return await_transfer(pulled, source, lambda process: process in self.lost, self._me)

  def _acknowledge(self, source: int, received: int) -> int:
    self._client.key_value_set(f"layup_jax/gossip-ack/{source}/{self._me}", str(received),
                               allow_overwrite=True)
    return received

  def _connection(self, process: int):
    """One connection per process, shared by the receiver and AD-PSGD's requesters."""
    with self._lock:
      if process not in self._connections:
        self._connections[process] = self._server.connect(self._addresses[process])
      return self._connections[process]

  @staticmethod
  def _batch_key(to: int, source: int, n: int) -> str:
    """The directory of notice n (1-based) and its batch: deleted in one call once merged."""
    return f"layup_jax/gossip/{to}/{source}/{(n - 1) // _BATCH}"

  @classmethod
  def _notice_key(cls, to: int, source: int, n: int) -> str:
    return f"{cls._batch_key(to, source, n)}/{n}"

  def _try_get(self, key: str) -> str | None:
    return membership.try_get(self._client, key)
