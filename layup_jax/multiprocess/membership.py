"""Which processes of a run are lost, which rejoin, and the order of the run's gathers: the
state every process keeps about the others, read from the coordination service's key-value
store (an elastic gossip run, docs/guide/elastic.md)."""

import contextlib
import json
import os
import sys
import threading
import time
from typing import Callable

import jax

from layup_jax.errors import RejoinError
from layup_jax.multiprocess import signed


def try_get(client, key: str) -> str | None:
  """The store's value of `key`, or None while it is not written (anything else is raised)."""
  try:
    return client.key_value_try_get(key)
  except Exception as error:  # NOT_FOUND: not written yet
    if "NOT_FOUND" in str(error):
      return None
    raise


FINISHED_KEY = "layup_jax/finished"  # written by the run's leader when the run is done


def run_finished() -> bool:
  """Whether the run's leader has said the run is done (`Watchdog.finish`)."""
  return try_get(signed.client(), FINISHED_KEY) is not None


class ProcessLostError(RuntimeError):
  """A wait (a gather, a pull) on a process that was declared lost meanwhile."""

  def __init__(self, process: int):
    super().__init__(f"process {process} was declared lost")
    self.process = process


class GatherOrder:
  """Every process gathers in the same order, so the n-th gather of one process meets the
  others' n-th under one key directory. A restarted process takes the live processes' `next`
  from its admission (gathers run on the main thread)."""

  def __init__(self):
    self.next = 0

  def prefix(self) -> str:
    """The key directory of this process's next gather."""
    self.next += 1
    return f"layup_jax/gather/{self.next - 1}"


gather_order = GatherOrder()


class Membership:
  """Which processes of the run are lost (an elastic gossip run goes on without them), and
  which of them rejoin.

  The run's leader is the one authority: process 0, and once the leader is lost the lowest
  live process (every process reads the same declarations, so all agree; a process that
  rejoins does not take the lead back). Its watchdog declares a silent process lost
  (`declare`, a key `layup_jax/lost/<k>` holding the step; the leader itself is declared by
  the process that leads after it), every process's watchdog reads those keys (`refresh`) and
  calls its listeners once per lost process. A gather between processes then takes the live
  ones only, with the leader naming each gather's members, so that every survivor reads the
  same set even when a process, the leader included, dies mid-gather.

  A lost process started again with its id (`rejoining`) asks to rejoin (`await_admission`);
  at the run's next consistent point the leader admits it (`joining`, `clear`, `admit`: the
  step and the gather it joins at, and who leads), and every live process calls its
  listeners' `on_rejoined` (`rejoined`)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.elastic = False  # set by the watchdog of a gossip run across processes
    self.watched = False  # a watchdog guards the run's processes (set while it runs)
    self.lost: dict[int, int] = {}  # process -> the step at which it was declared lost
    self._listeners: list = []
    self._rejoin_listeners: list = []
    self.step = 0  # the run's step as this process last saw it (the runner's progress)
    # How long a thread that lost contact with a process waits for it to be declared lost
    # before it fails (set by the watchdog of an elastic run).
    self.grace_s = 0.0
    # This process was started again after being declared lost, and is not admitted yet.
    self.rejoining = False
    self.leader = 0  # the process that writes the records and decides for the run
    # The coordination service runs in a process of its own: process 0 may be lost too.
    self.external_coordinator = False
    # Liveness by progress (`distributed.progress_timeout_s`; 0: heartbeats only): a process
    # that trains but whose iterations do not move for this long is declared lost, and a wait
    # on another process past it accuses that process (`accuse`).
    self.progress_timeout_s = 0.0
    self.max_dropped_sends = 0  # a sender past this many malformed sends is accused (0: never)
    self.own_iterations: Callable[[], int] = lambda: 0  # this process's progress (the runtime's)
    self.training = False  # between consistent points (`Session`); else it waits on the others
    self._waits = 0  # this process's threads waiting on another process now (`waiting`)
    self.trained: set[int] = set()  # processes seen making progress (the watchdog's)
    self.held: set[int] = set()  # processes whose last heartbeat says they wait (the watchdog's)

  @contextlib.contextmanager
  def waiting(self):
    """A thread of this process waits on another process: meanwhile this process is not judged
    by its progress (the wait's own deadline judges the other)."""
    with self._lock:
      self._waits += 1
    try:
      yield
    finally:
      with self._lock:
        self._waits -= 1

  def idle(self) -> bool:
    """Whether this process waits on the others (outside training, or a thread in a wait)."""
    with self._lock:
      return not self.training or self._waits > 0

  def deadline(self) -> float | None:
    """When a wait on another process that starts now ends in an accusation (None: never)."""
    return time.monotonic() + self.progress_timeout_s if self.progress_timeout_s else None

  def accuse(self, client, process: int, why: str, insist: bool = True) -> bool:
    """This process found `process` failing it (a wait past its deadline, sends past the bound
    of malformed ones): in an elastic run the leader declares it lost (the watchdog reads the
    accusations); in any other run nothing can go on without it, and this process stops in one
    line (the others then find it silent). Unless `insist`, a process that itself waits on
    another (its heartbeat says so) is not accused: the one it waits for is found by its own
    deadline or progress (a run's leader waits for a hung process's part of a gather while the
    others wait for the leader). A wait accuses once without insisting, then, a deadline later,
    insisting (two processes that wait on each other across a cut link). Returns whether it
    accused."""
    if not insist and process in self.held:
      return False
    me = jax.process_index()
    if not self.elastic:
      print(f"error: {why}; process {me} stops. Rerun the same command on every process to "
            f"resume from the last checkpoint", file=sys.stderr, flush=True)
      os._exit(4)
    key = f"layup_jax/accused/{process}/{me}"
    if try_get(client, key) is None:
      print(f"process {me}: {why}; it asks the run to declare process {process} lost",
            file=sys.stderr, flush=True)
      client.key_value_set(key, why[:300], allow_overwrite=True)
    return True

  def accusations(self, client) -> list[tuple[int, int, str]]:
    """(accused, accuser, why) of every accusation in the store, accused not yet lost."""
    found = []
    for key, why in client.key_value_dir_get("layup_jax/accused/"):
      parts = key.split("/")
      if len(parts) == 4 and parts[2].isdigit() and parts[3].isdigit():
        accused, accuser = int(parts[2]), int(parts[3])
        if accused < jax.process_count() and not self.is_lost(accused):
          found.append((accused, accuser, why))
    return sorted(found)

  def next_leader(self, skip=()) -> int | None:
    """The process that leads should the leader be lost: the lowest other live process not in
    `skip` (processes found silent, not declared yet)."""
    with self._lock:
      return min((k for k in range(jax.process_count())
                  if k not in self.lost and k != self.leader and k not in skip), default=None)

  def await_loss(self, process: int) -> bool:
    """Whether `process` is declared lost within `grace_s` (a pull from it just failed)."""
    deadline = time.monotonic() + self.grace_s
    while not self.is_lost(process) and time.monotonic() < deadline:
      time.sleep(0.1)
    return self.is_lost(process)

  def listen(self, on_lost, on_rejoined=None) -> None:
    """Calls `on_lost(process, step)` for each process found lost from now on (and those
    already found), and `on_rejoined(process)` for each admitted back."""
    with self._lock:
      self._listeners.append(on_lost)
      if on_rejoined is not None:
        self._rejoin_listeners.append(on_rejoined)
      known = dict(self.lost)
    for process, step in known.items():
      on_lost(process, step)

  def live(self) -> list[int]:
    with self._lock:
      return [k for k in range(jax.process_count()) if k not in self.lost]

  def is_lost(self, process: int) -> bool:
    with self._lock:
      return process in self.lost

  def declare(self, client, process: int, step: int, why: str = "") -> None:
    """The leader: `process` is lost at `step` (then every process learns it by `refresh`);
    `why` is kept for the lost process to say (`Watchdog`)."""
    if why:
      client.key_value_set(f"layup_jax/lost_why/{process}", why[:300], allow_overwrite=True)
    client.key_value_set(f"layup_jax/lost/{process}", str(step), allow_overwrite=True)
    self.refresh(client)

  def refresh(self, client) -> list[tuple[int, int]]:
    """Reads the lost keys; calls the listeners for each process newly found lost. The read
    is under the lock: a process admitted meanwhile (its key cleared first, `clear`) is never
    found lost again from a read made before."""
    with self._lock:
      found = [(int(key.rsplit("/", 1)[1]), int(value))
               for key, value in client.key_value_dir_get("layup_jax/lost/")]
      new = [(k, step) for k, step in found if k not in self.lost]
      self.lost.update(new)
      if self.leader in self.lost:  # the lowest live process leads from now on
        self.leader = min((k for k in range(jax.process_count()) if k not in self.lost),
                          default=self.leader)
      listeners = list(self._listeners)
    for process, step in new:
      for on_lost in listeners:
        on_lost(process, step)
    return new

  # --- rejoining ------------------------------------------------------------------------------

  def joining(self) -> list[int]:
    """The leader, at a consistent point: the lost process that asked to rejoin first, if any
    (one per consistent point)."""
    client = signed.client()
    asked = sorted(int(key.rsplit("/", 1)[1])
                   for key, _ in client.key_value_dir_get("layup_jax/join/"))
    return [k for k in asked if self.is_lost(k)][:1]

  @staticmethod
  def clear(process: int) -> None:
    """The leader, before telling the others: `process` is no longer declared lost (nor
    accused: its earlier run's accusations go with it)."""
    client = signed.client()
    for kind in ("lost", "lost_why", "join", "joining"):
      client.key_value_delete(f"layup_jax/{kind}/{process}")
    for key, _ in client.key_value_dir_get(f"layup_jax/accused/{process}/"):
      client.key_value_delete(key)

  def admit(self, process: int, step: int) -> None:
    """The leader, right after the gather that told every live process: `process` joins at
    `step`, its next gather being the live processes' next."""
    with self._lock:
      lost = [[k, s] for k, s in self.lost.items() if k != process]
    admission = {"step": step, "gather": gather_order.next, "lost": lost, "leader": self.leader}
    signed.client().key_value_set(f"layup_jax/admit/{process}",
                                               json.dumps(admission), allow_overwrite=True)

  def rejoined(self, process: int) -> None:
    """Every live process: `process` is admitted back (its listeners' `on_rejoined`)."""
    with self._lock:
      self.lost.pop(process, None)
      listeners = list(self._rejoin_listeners)
    for on_rejoined in listeners:
      on_rejoined(process)

  def await_admission(self) -> dict:
    """The restarted process: asks to rejoin and waits until the leader admits it at a
    consistent point; then gathers with the others. Returns the admission (`step`, and the
    processes still `lost`); raises if the run ends first."""
    me, client = jax.process_index(), signed.client()
    client.key_value_set(f"layup_jax/join/{me}", "1", allow_overwrite=True)
    print(f"process {me} is ready and asks to rejoin at the run's next evaluation or "
          f"checkpoint step", file=sys.stderr, flush=True)
    while True:
      try:
        admission = json.loads(client.blocking_key_value_get(f"layup_jax/admit/{me}", 1000))
        break
      except Exception as error:  # DEADLINE_EXCEEDED: not admitted yet
        if "DEADLINE_EXCEEDED" not in str(error):
          raise
        if run_finished():
          raise RejoinError(f"process {me} was not admitted back: the run ended first")
    client.key_value_delete(f"layup_jax/admit/{me}")
    gather_order.next = admission["gather"]
    self.leader = admission.get("leader", 0)
    with self._lock:
      self.lost = {k: step for k, step in admission["lost"]}
      self.rejoining = False
    return admission


members = Membership()


class AccusingWait:
  """A wait on one other process that ends in an accusation (`Membership.accuse`): past the
  progress timeout without progress it accuses `process`, not insisting; where that process
  waits itself, once more a deadline later, insisting. `restart` when the process was seen to
  move; `check` while waiting."""

  def __init__(self, client, process: int):
    self._client, self._process = client, process
    self.restart()

  def restart(self) -> None:
    self._accuse_at, self._insist = members.deadline(), False

  def check(self, why: Callable[[float], str]) -> None:
    """Accuses the process if its deadline has passed; `why(seconds waited)` says why."""
    if self._accuse_at is None or time.monotonic() <= self._accuse_at:
      return
    waited = members.progress_timeout_s * (2 if self._insist else 1)
    if members.accuse(self._client, self._process, why(waited), self._insist):
      self._accuse_at = None
    else:  # it waits itself: a deadline more
      self._accuse_at, self._insist = members.deadline(), True
