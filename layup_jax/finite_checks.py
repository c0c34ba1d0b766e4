"""The runtime's reading of non-finite losses and gradients under `faults.nonfinite`.

Each iteration's gradient checks are device scalars (layup_jax/nonfinite.py) read one iteration
later, when they are computed anyway: `stop` raises `NonFiniteError` naming the device, the
first stage found non-finite and the step; `skip` counts the skipped update in the run's
statistics (the update itself was left out on the device).
"""

import collections
import math
from typing import Any

from layup_jax.errors import NonFiniteError
from layup_jax.run_stats import RunStats


class FiniteChecks:
  """Per device: the gradient checks not read yet, (iteration, stages in update order,
  first_nonfinite), and how many iterations its updater has applied (`applied`)."""

  def __init__(self, num_devices: int, policy: str, stats: RunStats, loss_stage: int):
    self._pending = [collections.deque() for _ in range(num_devices)]
    self.applied = [0] * num_devices
    self._policy, self._stats, self._loss_stage = policy, stats, loss_stage

  def applied_one(self, i: int, closed: tuple[Any, Any] | None) -> None:
    """Device i's updater applied an iteration; `closed` is its (order, first_nonfinite)."""
    if closed is not None:
      self._pending[i].append((self.applied[i], *closed))
    self.applied[i] += 1

  def read(self, i: int, wait: bool = True) -> None:
    """Reads device i's checks: counts skipped iterations, or raises NonFiniteError. Without
    `wait` it stops at the first check not yet computed (an updater never waits for its
    device)."""
    pending = self._pending[i]
    while pending and (wait or pending[0][2].is_ready()):
      iteration, order, first_nonfinite = pending.popleft()
      position = int(first_nonfinite)
      if position < 0:
        continue
      if self._policy != "skip":
        raise NonFiniteError(
            f"non-finite gradient of stage {order[position]} on device {i} at its step "
            f"{iteration} (backward order: the first stage found non-finite)")
      self._stats.skipped[i] += 1

  def record_loss(self, i: int, iteration: int, loss: float) -> None:
    """Keeps a finite loss; raises NonFiniteError unless non-finite steps are skipped."""
    if math.isfinite(loss):
      self._stats.record_loss(i, loss)
    elif self._policy != "skip":
      raise NonFiniteError(
          f"non-finite training loss ({loss}) on device {i} at its step {iteration}, in stage "
          f"{self._loss_stage} (the loss stage)")
