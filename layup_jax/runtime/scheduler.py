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
interpreter (docs/records/host.md).

`drive(task)` runs one task to its end on the calling thread, blocking on each wait: the
deterministic serial mode, and the synchronous callers of the same code (DDP's straggler clock).
Tests step a scheduler by hand (`step`) or drive a task with their own waits (a simulated
device's clock).

`Threads` is the only place training threads are started: each runs one loop (a scheduler's,
or a receiver's from another process) until the run stops; the first exception of any loop
stops them all and is kept for the caller to raise. `Budget` counts the iterations the compute
tasks may start and those finished: when every granted one is, the run is at a consistent point.

Why one module of this size: the tasks, the two threads that step them, the turn they take and
the budget that lets tasks start iterations are one mechanism; each reads the others' state.
"""

import dataclasses
import os
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
  2-core development machine two threads that way took 1.45x the time of one, docs/records/host.md);
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

  def __init__(self, name: str, turn: Any = None, max_poll_s: float = MAX_POLL_S,
               clock: Callable[[], float] = time.perf_counter,
               idle_wait: Callable[[float], Any] | None = None):
    """`max_poll_s`: the longest an idle `run` sleeps before it looks at its tasks again (the
    runtime's `tuning.idle_poll_s`): each look costs the host CPU time, each missed readiness
    at most this much latency. `clock` times the waits (`idle_s`, `turn_wait_s`) and the turn
    held; `idle_wait(timeout)` is how an idle `run` waits for `wake()` or the timeout (tests
    give both their own: a simulated clock, a recorded wait)."""
    self.name = name
    self.max_poll_s = max_poll_s
    self._clock = clock
    self._idle_wait = idle_wait or self._wait_for_wake
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
          if self._clock() - held_since > _HOLD_S and turn.wanted():
            turn.release()
            held_since = self._take(turn)
          continue
        turn.release()
        asleep = self._clock()
        self._idle_wait(poll)
        self.idle_s += self._clock() - asleep
        self.idle_waits += 1
        poll = min(2 * poll, self.max_poll_s)
        held_since = self._take(turn)
    finally:
      turn.release()

  def _wait_for_wake(self, timeout: float) -> None:
    self._wake.wait(timeout)
    self._wake.clear()

  def _take(self, turn) -> float:
    """Acquires the turn; returns when (counting the wait in `turn_wait_s`)."""
    asked = self._clock()
    turn.acquire()
    now = self._clock()
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


# How long an idle scheduler sleeps at most (`tuning.idle_poll_s` = -1) where the devices are
# the host's CPUs: 1 ms (on the 2-core development machine the scheduler's default, 0.1 ms,
# cost its threads 1.4-1.7x the CPU time and 5-10 % of the samples per second: docs/records/host.md
# "The idle poll"); elsewhere the scheduler's default (a GPU's stages are short; its host has
# cores to spare).
CPU_IDLE_POLL_S = 1e-3


def idle_poll_s(configured: float, platform: str) -> float:
  """How long an idle scheduler sleeps at most before it looks at its tasks again
  (`tuning.idle_poll_s`; -1: `CPU_IDLE_POLL_S` where the devices are the host's own CPUs, whose
  every look takes time from the devices' work, else the scheduler's default)."""
  if configured > 0:
    return configured
  return CPU_IDLE_POLL_S if platform == "cpu" else MAX_POLL_S


def pins_threads(mode: str, two_threads: bool, platform: str) -> bool:
  """Whether the dispatcher and updater threads share one CPU (`tuning.pin_host_threads`):
  only where there are two, and under "auto" only where the devices are not the host's own
  CPUs (their work would then share that CPU too)."""
  return two_threads and (mode == "on" or (mode == "auto" and platform != "cpu"))


def shared_core(index: int) -> set[int] | None:
  """One CPU for the runtime's turn-taking threads (the dispatcher and the updater) of the
  `index`-th process on a host: the process's allowed CPUs in turn, so that processes sharing a
  host pin to different ones. None where there is nothing to choose (one CPU, or a platform
  without CPU affinity).

  The two threads never run at once (they take turns, `scheduler.Turns`), so one core loses no
  parallelism, and the objects both touch stay in that core's caches instead of moving between
  cores at each hand-over."""
  if not hasattr(os, "sched_getaffinity"):
    return None
  allowed = sorted(os.sched_getaffinity(0))
  return {allowed[index % len(allowed)]} if len(allowed) > 1 else None


def pin_calling_thread(cpus: set[int] | None) -> None:
  """Restricts the calling thread (only it: Linux affinity is per thread) to `cpus`."""
  if cpus is not None:
    os.sched_setaffinity(0, cpus)


class Threads:
  """Loops on daemon threads, a shared stop flag, and the first loop that failed."""

  def __init__(self, on_failure: Callable[[], None] = lambda: None):
    """`on_failure()` runs (on the failing thread) once a loop has raised: it wakes whatever
    waits for the loops, which then find `failure` set."""
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._on_failure = on_failure
    self.failure: tuple[str, BaseException] | None = None  # (thread name, error)

  @property
  def started(self) -> bool:
    return bool(self._threads)

  def stopped(self) -> bool:
    return self._stop.is_set()

  def start(self, loops: list[tuple[str, Callable[[], None]]]) -> None:
    for name, loop in loops:
      thread = threading.Thread(target=self._run, args=(name, loop), name=name, daemon=True)
      self._threads.append(thread)
      thread.start()

  def _run(self, name: str, loop: Callable[[], None]) -> None:
    try:
      loop()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller (`failure`)
      if self.failure is None:
        self.failure = (name, exc)
      self._stop.set()
      self._on_failure()

  def stop(self) -> None:
    """Asks every loop to stop (they poll `stopped`)."""
    self._stop.set()

  def join(self, timeout_s: float = 10.0) -> None:
    """Waits for every thread; raises if one did not stop."""
    for thread in self._threads:
      thread.join(timeout=timeout_s)
    alive = [t.name for t in self._threads if t.is_alive()]
    if alive:
      raise RuntimeError(f"threads did not stop: {alive}")


class Budget:
  """Iterations the compute tasks may start, how many their updaters have finished and of how
  many the compute tasks have recorded the loss.

  Guards only this bookkeeping (a condition variable), never model state. When every granted
  iteration is finished and recorded, every task is idle between iterations: a consistent
  point. An iteration's index (how many started before it) gives the run's global step.
  `on_grant` is called whenever more iterations may start (to wake the dispatcher).
  """

  def __init__(self, num_devices: int = 1, on_grant: Callable[[], None] = lambda: None):
    self._cond = threading.Condition()
    self.granted = self.started = self.finished = self.recorded = 0
    self.closed = False
    self._num_devices = num_devices
    self._on_grant = on_grant

  def may_start(self, own: int | None) -> bool:
    """Whether an iteration is granted to a device that has taken `own` (None: any device may
    take any granted iteration; else each takes its equal share, `granted / num_devices`)."""
    return self.started < self.granted and (own is None
                                            or own < self.granted // self._num_devices)

  def try_acquire(self, own: int | None = None) -> int | None:
    """Starts an iteration if one is granted now (`may_start`); returns its index."""
    with self._cond:
      if self.may_start(own) and not self.closed:
        self.started += 1
        return self.started - 1
      return None

  def start_now(self) -> int:
    """Grants and starts one iteration (the serial mode); returns its index."""
    with self._cond:
      self.granted = max(self.granted, self.started + 1)
      self.started += 1
      return self.started - 1

  def finish(self) -> None:
    with self._cond:
      self.finished += 1
      self._cond.notify_all()

  def record(self) -> None:
    with self._cond:
      self.recorded += 1
      self._cond.notify_all()

  def grant(self, total: int) -> None:
    with self._cond:
      self.granted = max(self.granted, total)
      self._cond.notify_all()
    self._on_grant()

  def hold(self, multiple: int) -> int:
    """Grants nothing beyond the next multiple of `multiple` iterations; returns that total."""
    with self._cond:
      self.granted = min(self.granted, -(-self.started // multiple) * multiple)
      self._cond.notify_all()
      return self.granted

  def reset(self, total: int) -> None:
    """Counts `total` iterations as granted, started, finished and recorded (a restored run)."""
    with self._cond:
      self.granted = self.started = self.finished = self.recorded = total

  def wait_finished(self, total: int, timeout: float) -> bool:
    """Waits until `total` iterations are finished and recorded, or the timeout passes."""
    done = lambda: self.finished >= total and self.recorded >= total
    with self._cond:
      self._cond.wait_for(lambda: done() or self.closed, timeout)
      return done()

  def close(self) -> None:
    with self._cond:
      self.closed = True
      self._cond.notify_all()
    self._on_grant()
