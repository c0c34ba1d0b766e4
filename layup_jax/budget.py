"""The iteration budget of the asynchronous runtime: how many iterations its compute tasks may
start, and how many are finished and recorded (a consistent point when every granted one is)."""

import threading
from collections.abc import Callable


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
