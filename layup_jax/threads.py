"""The runtime's threads: the only place training threads are started.

Each thread runs one loop (a scheduler's, or a receiver's from another process) until the
run stops; the first exception of any loop stops them all and is kept for the caller to raise
(`failure`). `stopped()` is what every loop and wait polls.
"""

import os
import threading
from collections.abc import Callable

from layup_jax.scheduler import MAX_POLL_S

# How long an idle scheduler sleeps at most (`layup.idle_poll_s` = -1) where the devices are
# the host's CPUs: 1 ms (on the 2-core development machine the scheduler's default, 0.1 ms,
# cost its threads 1.4-1.7x the CPU time and 5-10 % of the samples per second: docs/host.md
# "The idle poll"); elsewhere the scheduler's default (a GPU's stages are short; its host has
# cores to spare).
CPU_IDLE_POLL_S = 1e-3


def idle_poll_s(configured: float, platform: str) -> float:
  """How long an idle scheduler sleeps at most before it looks at its tasks again
  (`layup.idle_poll_s`; -1: `CPU_IDLE_POLL_S` where the devices are the host's own CPUs, whose
  every look takes time from the devices' work, else the scheduler's default)."""
  if configured > 0:
    return configured
  return CPU_IDLE_POLL_S if platform == "cpu" else MAX_POLL_S


def pins_threads(mode: str, two_threads: bool, platform: str) -> bool:
  """Whether the dispatcher and updater threads share one CPU (`layup.pin_host_threads`):
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
