"""Cooperative tasks on one thread: how the runtime drives every device without waiting on one.

A task is a generator. It runs until it has to wait, and then yields what it waits for:

  Ready(tree)              every array of `tree` computed (looked at with `is_ready`, never
                           blocked on, so one slow device holds up only its own tasks)
  Until(predicate, what)   a condition that another task or thread makes true
  Sleep(seconds)           host time passing (a host-side straggler's idling)

A `Scheduler` runs many tasks on the thread that calls `run`: each pass resumes every task whose
wait is over, and when none is, the thread sleeps until `wake()` (another thread changed
something a task waits for) or a short poll interval passes (arrays cannot announce that they
are computed). The runtime has one scheduler for the devices' compute tasks and one for their
updater tasks, each on its own thread: two threads per process, where sixteen (a compute and
an updater thread per device) spent most of a device-iteration's host time taking turns on the
interpreter (docs/host.md).

`drive(task)` runs one task to its end on the calling thread, blocking on each wait: the
deterministic serial mode, and the synchronous callers of the same code (DDP's straggler clock).
Tests step a scheduler by hand (`step`) or drive a task with their own waits (a simulated
device's clock).
"""

import dataclasses
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import jax

PyTree = Any
Task = Generator[Any, None, Any]
_FIRST_POLL_S = 20e-6  # an idle scheduler looks again after this long, doubling up to ...
MAX_POLL_S = 1e-4  # ... this by default (a readiness it missed costs at most this latency)
_HOLD_S = 2e-3  # a busy scheduler hands the turn to a waiting thread after this long


@dataclasses.dataclass
class Ready:
  """Wait until every array of `tree` is computed."""

  tree: PyTree

  def __post_init__(self):
    self._leaves = [leaf for leaf in jax.tree.leaves(self.tree) if hasattr(leaf, "is_ready")]

  def over(self) -> bool:
    while self._leaves and self._leaves[-1].is_ready():
      self._leaves.pop()
    return not self._leaves


@dataclasses.dataclass
class Until:
  """Wait until `predicate()` holds; `what` names it in errors."""

  predicate: Callable[[], bool]
  what: str = "a condition"

  def over(self) -> bool:
    return bool(self.predicate())


@dataclasses.dataclass
class Sleep:
  """Wait until `seconds` of the scheduler's clock have passed."""

  seconds: float
  now: Callable[[], float] = time.perf_counter

  def __post_init__(self):
    self._until = self.now() + self.seconds

  def over(self) -> bool:
    return self.now() >= self._until


class TaskFailed(Exception):
  """A task raised; `name` says which, `__cause__` what."""

  def __init__(self, name: str, error: BaseException):
    super().__init__(f"{name}: {type(error).__name__}: {error}")
    self.name, self.error = name, error


@dataclasses.dataclass
class _Running:
  name: str
  task: Task
  waiting: Any = None


class Turns:
  """The turn that the runtime's threads take in running their schedulers: a thread holds it
  while it has tasks to run and lets go when it has none (or has held it `_HOLD_S` while
  another waits). Every call into jax releases the interpreter lock; two busy threads would
  hand it over at nearly every call, each hand-over a wake-up and a context switch (on the
  2-core development machine two threads that way took 1.45x the time of one, docs/host.md);
  taking turns per stretch of work instead keeps the hand-overs few."""

  def __init__(self):
    self._lock = threading.Lock()
    self._waiting = 0

  def acquire(self) -> None:
    if self._lock.acquire(blocking=False):
      return
    self._waiting += 1  # a hint for the holder, read without a lock
    try:
      self._lock.acquire()
    finally:
      self._waiting -= 1

  def release(self) -> None:
    self._lock.release()

  def wanted(self) -> bool:
    return self._waiting > 0


class _NoTurn:
  """A turn that is never contended (a scheduler alone on its thread)."""

  def acquire(self) -> None:
    pass

  def release(self) -> None:
    pass

  def wanted(self) -> bool:
    return False


class Scheduler:
  """Runs tasks cooperatively on the thread that calls `run` (or `step`)."""

  def __init__(self, name: str, turn: Any = None, max_poll_s: float = MAX_POLL_S):
    """`max_poll_s`: the longest an idle `run` sleeps before it looks at its tasks again (the
    runtime's `layup.idle_poll_s`): each look costs the host CPU time, each missed readiness
    at most this much latency."""
    self.name = name
    self.max_poll_s = max_poll_s
    self._turn = turn if turn is not None else _NoTurn()
    self._tasks: list[_Running] = []
    self._added: list[_Running] = []
    self._lock = threading.Lock()  # guards `_added` only: `spawn` may come from any thread
    self._wake = threading.Event()
    self.failure: TaskFailed | None = None
    self.cpu_s = 0.0  # CPU time the thread running `run` spent, outside its idle waits
    # Wall time `run` spent asleep with nothing to run, and waiting for the turn (the other
    # thread's): where a slow stretch of a run went (scripts/bench_step.py reports them).
    self.idle_s = self.turn_wait_s = 0.0
    self.idle_waits = 0  # how often `run` slept with nothing to run

  def spawn(self, name: str, task: Task) -> None:
    with self._lock:
      self._added.append(_Running(name, task))
    self.wake()

  def wake(self) -> None:
    """Makes an idle `run` look at its tasks now (any thread may call it)."""
    self._wake.set()

  def __len__(self) -> int:
    return len(self._tasks) + len(self._added)

  def step(self) -> bool:
    """Resumes, once each, the tasks whose wait is over; True if any ran. A task that raises
    is dropped, and `failure` names it (the first one)."""
    if self._added:
      with self._lock:
        self._tasks += self._added
        self._added = []
    ran = False
    for running in list(self._tasks):
      try:
        if running.waiting is not None and not running.waiting.over():
          continue
        ran = True
        running.waiting = next(running.task)
      except StopIteration:
        self._tasks.remove(running)
      except BaseException as error:  # noqa: BLE001 - reported to whoever runs the scheduler
        self._tasks.remove(running)
        if self.failure is None:
          self.failure = TaskFailed(running.name, error)
    return ran

  def run(self, stopped: Callable[[], bool]) -> None:
    """Steps until `stopped()` or a task fails; sleeps while nothing can run. Holds the turn
    (shared with the other schedulers' threads) while it has work, for at most `_HOLD_S` when
    another thread waits for it, and never while idle."""
    poll = _FIRST_POLL_S
    clock = time.thread_time()
    turn = self._turn
    held_since = self._take(turn)
    try:
      while not stopped() and self.failure is None:
        ran = self.step()
        now = time.thread_time()
        self.cpu_s, clock = self.cpu_s + now - clock, now
        if ran:
          poll = _FIRST_POLL_S
          if time.perf_counter() - held_since > _HOLD_S and turn.wanted():
            turn.release()
            held_since = self._take(turn)
          continue
        turn.release()
        asleep = time.perf_counter()
        self._wake.wait(poll)
        self._wake.clear()
        self.idle_s += time.perf_counter() - asleep
        self.idle_waits += 1
        poll = min(2 * poll, self.max_poll_s)
        held_since = self._take(turn)
    finally:
      turn.release()

  def _take(self, turn) -> float:
    """Acquires the turn; returns when (counting the wait in `turn_wait_s`)."""
    asked = time.perf_counter()
    turn.acquire()
    now = time.perf_counter()
    self.turn_wait_s += now - asked
    return now


def drive(task: Task, wait: Callable[[PyTree], Any] = jax.block_until_ready,
          sleep: Callable[[float], Any] = time.sleep) -> Any:
  """Runs `task` to its end on the calling thread, blocking on each wait (`wait` for arrays,
  `sleep` for host time); returns its value. A condition that does not hold raises: nothing
  else runs meanwhile that could make it true."""
  while True:
    try:
      request = next(task)
    except StopIteration as done:
      return done.value
    if isinstance(request, Ready):
      wait(request.tree)
    elif isinstance(request, Sleep):
      sleep(request.seconds)
    elif isinstance(request, Until) and not request.over():
      task.close()
      raise RuntimeError(f"serial mode: would wait forever for {request.what}")


def awaited(result: Any) -> Task:
  """`result`, waited for if it is a task: hooks may be plain functions or tasks, and a task
  calls either one with `value = yield from awaited(hook(...))`."""
  if isinstance(result, Generator):
    return (yield from result)
  return result
