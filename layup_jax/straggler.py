"""Straggler injection (paper Section 5.4): one device slowed by a multiple of its own iteration time.

`straggler.mode` says where the slowness is:
  host:   the device's compute thread idles `delay_iters` x its mean iteration time before each
          iteration. The host is slow; the device idles with it.
  device: before its iterations the compute thread dispatches a program that keeps the device
          busy for `delay_iters` x its mean iteration time, and goes on dispatching. The device
          is slow (thermal throttling, a GPU shared with another job) while its host thread is
          not (`IterationClock` says how the iteration time is measured). A device runs its programs in the order they were dispatched, so the straggler's
          own iteration waits for the delay program; any other device that is handed work
          depending on the straggler's unfinished programs waits too, which is what this mode
          exposes.
On a CPU the fake devices share the host's cores, so the delay program also takes a core from
the other devices; on a GPU it occupies only the straggler.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("host", "device")
_BUSY_SIZE = 64  # the delay program multiplies 64x64 matrices: one unit of device work
_CALIBRATION_S = 0.02  # the delay program is timed on runs at least this long


def _busy(x: jax.Array, units: jax.Array) -> jax.Array:
  """`units` dependent 64x64 matrix products: device time proportional to `units`."""
  return jax.lax.fori_loop(0, units, lambda _, v: jnp.tanh(v @ v), x)[0, 0]


class DelayProgram:
  """Keeps one device busy for a given time without blocking the calling thread."""

  def __init__(self, device: jax.Device):
    self._device = device
    self._x = jax.device_put(np.full((_BUSY_SIZE, _BUSY_SIZE), 0.01, np.float32), device)
    self._busy = jax.jit(_busy)
    self.seconds_per_unit: float | None = None

  def _time(self, units: int) -> float:
    start = time.perf_counter()
    self._busy(self._x, np.int32(units)).block_until_ready()
    return time.perf_counter() - start

  def calibrate(self) -> None:
    """Measures the device time of one unit: the slope between runs of n and 2n units, n
    doubled until a run takes `_CALIBRATION_S` (the call's fixed cost drops out), at least
    half the 2n run's mean per unit."""
    self._time(1)  # compiles
    units = 16
    while self._time(units) < _CALIBRATION_S:
      units *= 2
    double = self._time(2 * units)
    slope = (double - self._time(units)) / units
    # On a loaded host the difference can come out near zero or negative: then a delay of
    # seconds would become millions of units. The mean per unit of the longer run bounds it.
    self.seconds_per_unit = max(slope, 0.5 * double / (2 * units))

  def __call__(self, seconds: float) -> jax.Array:
    """Dispatches about `seconds` of work on the device; the result is ready when it is done."""
    if self.seconds_per_unit is None:
      self.calibrate()
    units = max(1, round(seconds / self.seconds_per_unit))
    return self._busy(self._x, np.int32(units))

  def drain(self) -> None:
    """Returns once the device has run everything dispatched to it before this call: a device
    runs its programs in dispatch order, so a one-unit program's result marks the queue's end
    (an iteration's own outputs cannot: later steps donate them)."""
    self._busy(self._x, np.int32(1)).block_until_ready()


class IterationClock:
  """Measures a straggler's iteration time and slows it by `delay_iters` times its mean.

  The time of an iteration runs from its start to its last outputs being computed: the clock
  waits for them, since with asynchronous dispatch the time (and with it the delay) would
  otherwise shrink towards the dispatch time alone. Host mode measures every iteration and
  idles before each. Device mode measures only iterations that carry no delay, one in
  `MEASURE_EVERY`: where a delay program runs, the device finishes it and the iteration's
  programs while the host may still be dispatching, so the iteration's own time cannot be
  told apart from the delay's. The other iterations each get a delay program of
  `delay_iters * mean * MEASURE_EVERY / (MEASURE_EVERY - 1)`, the same delay per iteration on
  average, and are not waited for. A measured iteration starts only once the device has run
  everything dispatched to it before (`DelayProgram.drain`): else its time would include the
  queued delays of earlier iterations, the mean would grow with the delay and the delay with
  the mean (without bound in tests/test_straggler.py; in training runs the dispatch-ahead limit
  bounds it). On a CPU the delay program, calibrated while the other fake devices idle, also
  runs slower while they compute on the same cores (3.8x measured), so a device-side straggler
  there is still slowed more than asked; on a GPU the program has its device to itself. Clocks without delay never wait.
  """

  MEASURE_EVERY = 4

  def __init__(self, delay_iters: float = 0.0, mode: str = "host",
               device: jax.Device | None = None):
    if mode not in MODES:
      raise ValueError(f"straggler mode must be one of {MODES}, got {mode!r}")
    if mode == "device" and delay_iters > 0 and device is None:
      raise ValueError("a device-mode straggler needs its device")
    self.delay_iters, self.mode = delay_iters, mode
    self._program = DelayProgram(device) if mode == "device" and delay_iters > 0 else None
    self._start = 0.0
    self._measured = False  # whether the iteration under way is timed
    self._total, self._count, self._iterations = 0.0, 0, 0

  def compile(self) -> None:
    """Compiles and calibrates the delay program (device mode), outside the timed loop."""
    if self._program is not None:
      self._program.calibrate()

  def mean(self) -> float:
    return self._total / self._count if self._count else 0.0

  def start_iteration(self, idle: Callable[[float], Any] = time.sleep) -> None:
    """Slows the straggler (idling, or dispatching the delay program) and marks the start."""
    delay = self.delay_iters * self.mean()
    self._measured = self.delay_iters > 0
    if self._program is not None:
      self._measured = self._iterations % self.MEASURE_EVERY == 0
      if self._measured:
        self._program.drain()  # the device idle: only this iteration is timed
      elif delay > 0:
        self._program(delay * self.MEASURE_EVERY / (self.MEASURE_EVERY - 1))
    elif delay > 0:
      idle(delay)
    self._iterations += 1
    self._start = time.perf_counter()

  def end_iteration(self, last_outputs: Any) -> None:
    """Marks the end of an iteration whose work ends with `last_outputs`."""
    if not self._measured:
      return
    jax.block_until_ready(last_outputs)
    self._total += time.perf_counter() - self._start
    self._count += 1

  def get_state(self) -> list[float]:
    return [self._total, self._count, self._iterations]

  def set_state(self, state: Sequence[float]) -> None:
    self._total, self._count = float(state[0]), int(state[1])
    self._iterations = int(state[2]) if len(state) > 2 else self._count
