"""The heartbeat watchdog: ends a process in one line when another stops answering, or, in an
elastic gossip run, has process 0 declare it lost so that the others train on."""

import contextlib
import os
import sys
import threading
import time

import jax

from layup_jax.multiprocess import membership, signed
from layup_jax.multiprocess.membership import run_finished, try_get

_FAREWELL_S = 120.0  # how long process 0 of an elastic run waits for the others at the end
_FAREWELL_GRACE_S = 1.0  # and then, for their last word to the service


class ProgressClock:
  """When each process last made progress, from what its heartbeats carry: its iterations so
  far and whether it waits on the others (outside training, or in a wait with a deadline of its
  own). A process is stalled when it trains, has been seen making progress, and its iterations
  have not moved for `timeout_s` (0: never): its heartbeat may beat on while its training
  hangs. One not yet seen moving may still be compiling; its heartbeat judges it."""

  def __init__(self, timeout_s: float):
    self.timeout_s = timeout_s
    self._last: dict[int, tuple[int, float, bool]] = {}  # iterations, since when, ever moved

  def observe(self, k: int, iterations: int, idle: bool, now: float) -> bool:
    """Takes process k's state read at `now`; returns whether k is stalled."""
    last = self._last.get(k)
    if last is None or iterations != last[0] or idle:
      moved = last is not None and (last[2] or iterations != last[0])
      self._last[k] = (iterations, now, moved)
      return False
    return last[2] and self.timeout_s > 0 and now - last[1] > self.timeout_s

  def has_trained(self, k: int) -> bool:
    """Whether k was seen making progress (then a wait on it has a deadline)."""
    return k in self._last and self._last[k][2]

  def forget(self, k: int) -> None:
    """k was lost or rejoins: judged afresh."""
    self._last.pop(k, None)


def beat_value(beat: int, iterations: int, idle: bool) -> str:
  """What a heartbeat carries: its counter, the process's iterations, whether it waits."""
  return f"{beat} {iterations} {int(idle)}"


def read_beat(value: str | None) -> tuple[str, int, bool] | None:
  """A heartbeat's (counter, iterations, waits), or None where it is not one."""
  parts = (value or "").split()
  if len(parts) != 3 or not all(p.isdigit() for p in parts) or parts[2] not in ("0", "1"):
    return None
  return parts[0], int(parts[1]), parts[2] == "1"


class Watchdog:
  """Ends this process with one line when another process of the run stops answering, or, in
  an elastic run (gossip), has process 0 declare it lost and trains on without it.

  Each process's watchdog thread writes a counter to the coordination service's key-value
  store every second and reads the others'. A process whose counter has not moved for
  `timeout_s` (it died, or lost the coordinator; one waiting in a collective still answers,
  the watchdog being a thread of its own) is named, and this process exits with status 4 at
  once: a collective with a dead peer would otherwise wait, and JAX's own heartbeat, set
  longer, would abort the process without saying which one. A process that finished says so
  and is not waited for. Losing the coordination service (in process 0, or in a process of
  its own) is reported the same way.

  `elastic`: a silent process is not fatal: the run's leader declares it lost (`Membership`;
  the leader itself is declared by the process next in line) and says so in one line; every
  process reads the declarations each period. Where the service runs inside process 0, that
  process's silence is fatal for all, as the service's loss is.
  """

  EXIT_STATUS = 4

  def __init__(self, timeout_s: float, period_s: float = 1.0, elastic: bool = False,
               progress_timeout_s: float = 0.0, max_dropped_sends: int = 0):
    self._client = signed.client()
    self._me, self._count = jax.process_index(), jax.process_count()
    self._timeout_s, self._period_s = timeout_s, period_s
    self._elastic = membership.members.elastic = elastic
    membership.members.progress_timeout_s = progress_timeout_s
    membership.members.max_dropped_sends = max_dropped_sends
    self._progress = ProgressClock(progress_timeout_s)
    membership.members.watched = True
    self._external = membership.members.external_coordinator
    if elastic:  # a never-seen process is given 3x the timeout, then the leader declares it
      membership.members.grace_s = 3 * timeout_s + 2 * period_s
    if elastic and self._me == 0 and not self._exists(self._key("alive", self._me)):
      print(self._elastic_line(), file=sys.stderr, flush=True)
    if elastic and (self._me != 0 or self._external) and self._exists(
        self._key("alive", self._me)):
      self._await_declared_lost()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
    self._thread.start()

  def _elastic_line(self) -> str:
    """What an elastic run survives, said once at its start."""
    if self._external:
      return ("elastic gossip: a lost process is left behind and the others train on (the same "
              "command started again for it rejoins); the coordination service runs in a "
              "process of its own, whose loss stops every process (rerun to resume from the "
              "last checkpoint)")
    return ("elastic gossip: a lost process other than 0 is left behind and the others train "
            "on (the same command started again for it rejoins); process 0 hosts the run's "
            "coordination service, so its loss stops every process (rerun to resume from the "
            "last checkpoint; `launch` runs the service apart, and so survives process 0)")

  def _key(self, kind: str, k: int) -> str:
    return f"layup_jax/{kind}/{k}"

  def _await_declared_lost(self) -> None:
    """This process was started again into a running run (its earlier self's heartbeat is in
    the store): it stays silent until the run's leader has declared that one lost, then
    rejoins (`Membership.await_admission`, from the runtime)."""
    print(f"process {self._me} started again into its running run: it rejoins once the run "
          f"has declared its earlier run lost (within {3 * self._timeout_s:g} s)",
          file=sys.stderr, flush=True)
    # Process 0 waits for a process that is rejoining before it ends the run (`finish`).
    self._client.key_value_set(self._key("joining", self._me), "1", allow_overwrite=True)
    while self._value(self._key("lost", self._me)) is None:
      if run_finished():
        self._leave_unadmitted()
      time.sleep(self._period_s / 2)
    membership.members.rejoining = True


  def _watch(self) -> None:
    beat = 0
    seen = {k: (None, time.monotonic()) for k in range(self._count)}  # counter, when it moved
    members = membership.members
    while not self._stop.wait(self._period_s):
      now = time.monotonic()
      try:
        beat += 1
        iterations, idle = members.own_iterations(), members.idle()
        self._client.key_value_set(self._key("alive", self._me),
                                   beat_value(beat, iterations, idle), allow_overwrite=True)
        self_stalled = self._progress.observe(self._me, iterations, idle, now)
        if self._elastic:
          members.refresh(self._client)
          if members.rejoining and run_finished():
            self._leave_unadmitted()
          if members.is_lost(self._me) and not members.rejoining:  # fenced off
            self._die(f"the run declared this process lost at step {members.lost[self._me]} "
                      f"({self._why_lost()})", "The others train on without it")
          self._judge_accusations()
        stalled, silent = [], []
        for k in range(self._count):
          if members.is_lost(k):  # and if it rejoins, its heartbeat is timed afresh
            seen[k] = (None, now)
            self._progress.forget(k)
            continue
          if k == self._me or self._exists(self._key("done", k)):
            continue
          value = self._value(self._key("alive", k))
          if value is not None and value != seen[k][0]:
            seen[k] = (value, now)
          state = read_beat(value)
          if state is not None and self._progress.observe(k, state[1], state[2], now):
            stalled.append(k)
          if state is not None:  # whether it waits on another process itself (`accuse`)
            (members.held.add if state[2] else members.held.discard)(k)
          if self._progress.has_trained(k):
            members.trained.add(k)
          # A process not seen yet may still be starting (a loaded host): 3x the time.
          limit = self._timeout_s * (1 if seen[k][0] is not None else 3)
          if now - seen[k][1] > limit:
            silent.append(k)
        for k in silent:
          self._silent(k, set(silent))
        self._stalled(stalled, self_stalled or idle)
      except Exception as error:  # noqa: BLE001 - the coordination service itself is gone
        if self._stop.is_set():
          return
        where = "its own process" if self._external else "process 0"
        self._die(f"lost the run's coordination service ({where}: {type(error).__name__}: "
                  f"{(str(error).splitlines() or [''])[0][:160]}); no checkpoint can be written "
                  f"without it (the processes' saves meet at its barriers)")

  def _stalled(self, stalled: list[int], held: bool) -> None:
    """Processes whose training made no progress for the progress timeout. In an elastic run
    each is declared lost (by the leader). In any other the rest cannot go on without them:
    once this process is held too (it waits, or made no progress either), it stops in one
    line naming the first (the others then find it silent)."""
    timeout = self._progress.timeout_s
    if self._elastic:
      for k in stalled:
        self._declare(k, f"its training made no progress for {timeout:g} s")
    elif stalled and held:
      self._die(f"process {stalled[0]} of the run made no progress for {timeout:g} s (its "
                f"training hangs, or waits on a link that does not answer)")

  def _judge_accusations(self) -> None:
    """The deciding process declares lost each process that another live one accused (a wait on
    it past its deadline, its malformed sends past the bound). Where two accuse each other (the
    link between them failed) one is declared: the first in order, or, if one leads, the other
    (the leader's word stands), and the other's accusation then comes from a lost process."""
    members = membership.members
    accusations = members.accusations(self._client)
    pairs = {(k, accuser) for k, accuser, _ in accusations}
    for k, accuser, why in accusations:
      if members.is_lost(k) or members.is_lost(accuser):
        continue
      if k == members.leader and (accuser, k) in pairs:
        continue
      self._declare(k, f"process {accuser}: {why}")

  def _why_lost(self) -> str:
    """What the run said when it declared this process lost."""
    return self._value(f"layup_jax/lost_why/{self._me}") or "no reason given"

  def _silent(self, k: int, silent: set[int]) -> None:
    """Process k has not answered for `timeout_s` (nor have the processes `silent`)."""
    if not self._elastic or (k == 0 and not self._external):
      self._die(f"process {k} of the run stopped answering for {self._timeout_s:g} s "
                f"(it died, or lost the coordinator)")
    self._declare(k, f"silent for {self._timeout_s:g} s", silent)

  def _declare(self, k: int, why: str, silent: set[int] = frozenset()) -> None:
    """Process k is lost, in an elastic run: the leader declares it (the process next in line,
    when k leads), and says why. Process 0 cannot be lost where it hosts the service.

    The one that decides is the lowest live process this one does not find `silent`: the
    leader, or when the leader is silent the next in line, or the one after where that one is
    silent too. Only the leader and the next in line deciding, a run whose leader and next in
    line died within one timeout of each other stood still for good: nobody declared either
    (found in a churn drill). A live process's beat moves at every read, so a process that was
    paused itself finds none of the live ones silent."""
    if k == 0 and not self._external:
      self._die(f"process 0, which hosts the run's coordination service, failed ({why})")
    members = membership.members
    if k != members.leader and members.leader not in silent:
      decides = members.leader
    else:  # the leader is k, or silent itself
      decides = members.next_leader(skip={k, *silent})
    if self._me != decides or members.is_lost(k):
      return  # the leader decides (and says so); the leader, the process next in line
    step = members.step
    members.declare(self._client, k, step, why)
    live = set(members.live())
    devices = sum(1 for d in jax.devices() if d.process_index in live)
    print(f"process {k} lost at step {step}; {devices} devices train on ({why})",
          file=sys.stderr, flush=True)

  def _leave_unadmitted(self) -> None:
    """A process that was rejoining finds the run ended: it says so and lets the others go."""
    self._client.key_value_set(self._key("done", self._me), "1", allow_overwrite=True)
    self._die("the run ended before this process could rejoin it", "Nothing to do")

  def _value(self, key: str) -> str | None:
    return try_get(self._client, key)

  def _exists(self, key: str) -> bool:
    return self._value(key) is not None

  def _die(self, why: str, then: str = "Rerun the same command on every process to resume "
                                        "from the last checkpoint") -> None:
    print(f"error: {why}; process {self._me} stops. {then}", file=sys.stderr, flush=True)
    os._exit(self.EXIT_STATUS)

  def finish(self) -> None:
    """This process is done (or failed on its own): the others stop waiting for it.

    In an elastic run JAX keeps no shutdown barrier (recoverability), so process 0, where it
    hosts the coordination service, would leave while another process still uses it, and
    that one's client aborts it (found: the last process of a finished run ended by SIGABRT).
    So the others leave JAX's runtime right after saying they are done, and process 0 waits
    for every live or rejoining process's word (at most `_FAREWELL_S`) and a moment more. With
    the service in a process of its own, every process leaves at once. The leader also says
    the run is done (a process still waiting to rejoin then leaves)."""
    self._stop.set()
    self._thread.join(timeout=5)
    membership.members.watched = False
    with contextlib.suppress(Exception):  # the service may be gone already: nothing to tell
      self._client.key_value_set(self._key("done", self._me), "1", allow_overwrite=True)
      if self._me == membership.members.leader and not membership.members.rejoining:
        self._client.key_value_set(membership.FINISHED_KEY, "1", allow_overwrite=True)
    if not self._elastic:
      return
    if self._me != 0 or self._external:
      with contextlib.suppress(Exception):
        jax.distributed.shutdown()
      return
    deadline = time.monotonic() + _FAREWELL_S
    with contextlib.suppress(Exception):
      while time.monotonic() < deadline and not all(
          self._exists(self._key("done", k))
          or membership.members.is_lost(k) and not self._exists(self._key("joining", k))
          for k in range(self._count)):
        membership.members.refresh(self._client)
        time.sleep(0.1)
    time.sleep(_FAREWELL_GRACE_S)
