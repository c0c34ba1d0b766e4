"""The straggler's clock (paper Section 5.4): a device slowed by a multiple of its own time."""

import statistics
import time

import jax

from layup_jax import straggler


def _seconds(run) -> float:
  start = time.perf_counter()
  jax.block_until_ready(run())
  return time.perf_counter() - start


def test_a_device_side_stragglers_measured_iteration_is_its_own_not_the_queued_delays():
  """Device mode dispatches delay programs without waiting; the iterations it measures must
  not include the delays still queued on the device before them, else the mean grows with the
  delay and the delay with the mean (it reached hundreds of times the iteration's time)."""
  device = jax.devices()[0]
  iteration = straggler.DelayProgram(device)
  iteration.calibrate()
  alone = statistics.median(_seconds(lambda: iteration(0.01)) for _ in range(5))
  clock = straggler.IterationClock(2.0, "device", device)
  clock.compile()
  for _ in range(3 * clock.MEASURE_EVERY):
    clock.start_iteration()
    clock.end_iteration(iteration(0.01))
  assert clock.mean() > 0
  assert clock.mean() < 3 * alone, (clock.mean(), alone)
