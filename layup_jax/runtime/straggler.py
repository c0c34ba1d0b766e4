"""Straggler injection (paper Section 5.4): one device slowed by a multiple of its own iteration time.

`straggler.mode` says where the slowness is:
  host:   the device's compute thread idles `delay_iters` x its mean iteration time before each
          iteration. The host is slow; the device idles with it.
  device: before its iterations the compute thread dispatches a program that keeps the device
          busy for `delay_iters` x its mean iteration time, and goes on dispatching. The device
          is slow (thermal throttling, a GPU shared with another job) while its host thread is
          not (`IterationClock` says how the iteration time is measured). A device runs
          its programs in the order they were dispatched, so the straggler's own iteration
          waits for the delay program; any other device that is handed work depending on the
          straggler's unfinished programs waits too, which is what this mode exposes.
On a CPU the fake devices share the host's cores, so the delay program also takes a core from
the other devices; on a GPU it occupies only the straggler.
"""

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from layup_jax.runtime.scheduler import Ready, Sleep, Task

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
    self.units_dispatched = 0  # by `__call__`, for a clock that re-measures the unit's time

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
    self.units_dispatched += units
    return self._busy(self._x, np.int32(units))

  def drain(self) -> jax.Array:
    """An array that is ready once the device has run everything dispatched to it before this
    call: a device runs its programs in dispatch order, so a one-unit program's result marks
    the queue's end (an iteration's own outputs cannot: later steps donate them)."""
    return self._busy(self._x, np.int32(1))


class IterationClock:
  """Measures a straggler's iteration time and slows it by `delay_iters` times that time.

  Host mode measures every iteration, from its start to its last outputs being computed (the
  clock waits for them: with asynchronous dispatch the time, and the delay with it, would
  otherwise shrink towards the dispatch time alone), and idles the mean before each.

  Device mode cannot wait on every iteration: that would stall the host, and the device would
  no longer be the slow part. Its iteration time is its pipelined period: after `WARMUP`
  iterations, `WINDOW` iterations run without delay from an idle device
  (`DelayProgram.drain`) to the last one's outputs, dispatched as usual, and their time over
  `WINDOW` is the mean (timing one iteration from an idle device gave its latency, host
  dispatch and device work in series: 1.8x the period of DDP's step on the digits, which
  over-delayed it). Then, in every cycle of `MEASURE_EVERY` iterations, all but the first get
  a delay program of `delay_iters * mean * MEASURE_EVERY / (MEASURE_EVERY - 1)`, and the first
  starts from an idle device. The delay program's time per unit is calibrated while the other
  devices idle; on a CPU, where fake devices share the host's cores, it ran 3.8x slower while
  they computed. So each cycle re-measures it: the cycle's time less `MEASURE_EVERY` means is
  what its delay programs took (the drain waited for them), and the median of the last
  `_OBSERVATIONS` such times per unit, kept within [1/4, 16] x the calibration, replaces it.
  This holds a cycle near `(1 + delay_iters)` periods whatever the load (the drain's break of
  the pipeline included); the median drops a cycle stretched by something else (an
  evaluation). Clocks without delay never wait.
  """

  MEASURE_EVERY = 4
  WARMUP = 4
  WINDOW = 8
  _OBSERVATIONS = 5
  # The host's clock (tests put a simulated device's here, with a simulated `DelayProgram`, and
  # drive the clock's tasks with that device's waits: timings on a shared CPU are not
  # reproducible).
  now: Callable[[], float] = staticmethod(time.perf_counter)

  def __init__(self, delay_iters: float = 0.0, mode: str = "host",
               device: jax.Device | None = None):
    if mode not in MODES:
      raise ValueError(f"straggler mode must be one of {MODES}, got {mode!r}")
    if mode == "device" and delay_iters > 0 and device is None:
      raise ValueError("a device-mode straggler needs its device")
    self.delay_iters, self.mode = delay_iters, mode
    self._program = DelayProgram(device) if mode == "device" and delay_iters > 0 else None
    self._start = 0.0
    self._measured = False  # whether the iteration under way ends a timed span
    self._total, self._count, self._iterations = 0.0, 0, 0
    self._window_first: int | None = None  # the timed window's first iteration (device mode)
    self._cycle_start: float | None = None  # the last cycle's start (device mode)
    self._cycle_units = 0  # the delay program's units dispatched before it
    self._calibrated: float | None = None
    self._unit_times: collections.deque = collections.deque(maxlen=self._OBSERVATIONS)

  def compile(self) -> None:
    """Compiles and calibrates the delay program (device mode), outside the timed loop."""
    if self._program is not None:
      self._program.calibrate()

  def mean(self) -> float:
    return self._total / self._count if self._count else 0.0

  def start_iteration(self) -> Task:
    """Slows the straggler (idling, or dispatching the delay program) and marks the start; a
    task (`layup_jax.runtime.scheduler`): host mode yields its idling, device mode the drain."""
    if self._program is not None:
      yield from self._start_on_device(self._iterations)
    else:
      self._measured = self.delay_iters > 0
      if self._measured and self._count:
        yield Sleep(self.delay_iters * self.mean(), self.now)
      self._start = self.now()
    self._iterations += 1

  def _start_on_device(self, n: int) -> Task:
    self._measured = False
    if not self._count:  # the mean is not known yet: no delay
      if self._window_first is None and n >= self.WARMUP:  # the timed window begins
        yield Ready(self._program.drain())
        self._window_first, self._start = n, self.now()
      self._measured = self._window_first is not None and n == self._window_first + self.WINDOW - 1
    elif n % self.MEASURE_EVERY == 0:
      yield Ready(self._program.drain())
      self._remeasure_unit(self.now())
    else:
      self._program(self.delay_iters * self.mean() * self.MEASURE_EVERY
                    / (self.MEASURE_EVERY - 1))

  def _remeasure_unit(self, now: float) -> None:
    """Sets the delay program's time per unit from the cycle that ends at `now` (after a
    drain): its time less its iterations' own is what its delay programs took."""
    program = self._program
    units = program.units_dispatched - self._cycle_units
    if self._cycle_start is not None and units > 0:
      if self._calibrated is None:
        self._calibrated = program.seconds_per_unit
      delay = (now - self._cycle_start) - self.MEASURE_EVERY * self.mean()
      per_unit = min(max(delay / units, self._calibrated / 4), 16 * self._calibrated)
      self._unit_times.append(per_unit)
      program.seconds_per_unit = statistics.median(self._unit_times)
    self._cycle_start, self._cycle_units = now, program.units_dispatched

  def end_iteration(self, last_outputs: Any) -> Task:
    """Marks the end of an iteration whose work ends with `last_outputs` (a task: it waits
    for them where the iteration is timed)."""
    if not self._measured:
      return
    yield Ready(last_outputs)
    if self._program is not None:  # the window's end: its time over its iterations
      self._total, self._count = self.now() - self._start, self.WINDOW
    else:
      self._total += self.now() - self._start
      self._count += 1

  def get_state(self) -> list[float]:
    return [self._total, self._count, self._iterations]

  def set_state(self, state: Sequence[float]) -> None:
    self._total, self._count = float(state[0]), int(state[1])
    self._iterations = int(state[2]) if len(state) > 2 else self._count
