"""The straggler's clock (paper Section 5.4): a device slowed by a multiple of its own time.

On a simulated device: its programs run in dispatch order in virtual time, and the host's
clock advances by the host's own work and by waiting for outputs. The clock's steps are tasks
(`layup_jax.runtime.scheduler`), driven here with the simulated device's waits. Timings on the CPU these
tests share with others are not reproducible (under the multi-process tests beside them a
cycle's slowdown over a period timed before it ranged 1.55x to 6.9x in 25 runs);
`scripts/bench_straggler.py --mode device` measures the clock on real devices.
"""

import itertools
import statistics

import pytest

from layup_jax.runtime import scheduler, straggler

CALIBRATED = 1e-5  # seconds per unit of the delay program, as calibrated on an idle device
HOST, WORK = 0.9e-3, 1e-3  # an iteration's host dispatch and device work, in seconds


class _Output:
  def __init__(self, ready: float):
    self.ready = ready


class SimulatedDevice:
  """Runs programs in dispatch order; `now` is the host's clock."""

  def __init__(self):
    self.now, self.busy_until = 0.0, 0.0
    self.delay_slowdown = 1.0  # the delay program's time per unit over its calibration
    self.waits = 0

  def host(self, seconds: float) -> None:
    self.now += seconds

  def run(self, seconds: float) -> _Output:
    self.busy_until = max(self.now, self.busy_until) + seconds
    return _Output(self.busy_until)

  def wait(self, output: _Output) -> None:
    self.waits += 1
    self.now = max(self.now, output.ready)

  def iteration(self) -> _Output:
    self.host(HOST)
    return self.run(WORK)


class SimulatedDelayProgram:
  def __init__(self, device: SimulatedDevice):
    self.device, self.seconds_per_unit, self.units_dispatched = device, None, 0

  def calibrate(self) -> None:
    self.seconds_per_unit = CALIBRATED

  def __call__(self, seconds: float) -> _Output:
    units = max(1, round(seconds / self.seconds_per_unit))
    self.units_dispatched += units
    return self.device.run(units * CALIBRATED * self.device.delay_slowdown)

  def drain(self) -> _Output:
    return self.device.run(0.0)


@pytest.fixture
def device(monkeypatch) -> SimulatedDevice:
  simulated = SimulatedDevice()
  monkeypatch.setattr(straggler, "DelayProgram", lambda _: SimulatedDelayProgram(simulated))
  monkeypatch.setattr(straggler.IterationClock, "now", staticmethod(lambda: simulated.now))
  return simulated


def _clock(delay: float, mode: str = "device") -> straggler.IterationClock:
  clock = straggler.IterationClock(delay, mode, device="device 0")
  clock.compile()
  return clock


def _cycle_seconds(clock, device: SimulatedDevice, cycles: int, on_cycle=None) -> list[float]:
  """Runs `cycles` cycles of the clock's iterations; each cycle's seconds per iteration."""
  starts = []
  for n in range(cycles * clock.MEASURE_EVERY):
    scheduler.drive(clock.start_iteration(), wait=device.wait, sleep=device.host)
    if n % clock.MEASURE_EVERY == 0:
      starts.append(device.now)
      if on_cycle is not None:
        on_cycle(len(starts) - 1)
    scheduler.drive(clock.end_iteration(device.iteration()), wait=device.wait)
  return [(b - a) / clock.MEASURE_EVERY for a, b in itertools.pairwise(starts)]


def test_a_device_side_stragglers_iteration_time_is_its_period_not_its_latency(device):
  """The host dispatches an iteration in 0.9 of its device work: one iteration from an idle
  device takes both in series (its latency, 1.9 ms), iterations dispatched back to back come
  one device time apart (their period, 1 ms). The clock times 8 iterations from an idle device
  (the first dispatch before the device starts included) and slows each by 2 of those: the
  cycles take 3x that, where slowing by the latency would give 1 + 2 x 1.9."""
  clock = _clock(2.0)
  seconds = _cycle_seconds(clock, device, cycles=16)
  assert clock.mean() == pytest.approx((HOST + 8 * WORK) / 8)
  assert statistics.median(seconds[-8:]) == pytest.approx(3 * clock.mean(), rel=0.03)


def test_a_device_side_straggler_is_slowed_as_asked_when_its_delay_program_runs_slower_than_calibrated(
    device):
  """On a CPU the delay program is calibrated while the other fake devices idle and ran 3.8x
  slower beside them. The clock re-measures it each cycle: 4x slower from the start, the
  cycles still take (1 + delay) x the mean, where trusting the calibration gives about
  (1 + 4 x delay) x."""
  device.delay_slowdown = 4.0
  clock = _clock(2.0)
  seconds = _cycle_seconds(clock, device, cycles=16)
  assert statistics.median(seconds[-8:]) == pytest.approx(3 * clock.mean(), rel=0.03)
  assert seconds[3] > 6 * clock.mean()  # the first delayed cycle, on the calibration alone


def test_the_clock_follows_its_delay_program_slowing_down_midway(device):
  """The load changes after 10 cycles (the delay program 3.8x slower from then on): within the
  median of 5 re-measurements the cycles are back at (1 + delay) x the mean."""
  clock = _clock(1.0)
  slow_from_cycle_10 = lambda c: setattr(device, "delay_slowdown", 3.8 if c >= 10 else 1.0)
  seconds = _cycle_seconds(clock, device, cycles=24, on_cycle=slow_from_cycle_10)
  assert statistics.median(seconds[4:10]) == pytest.approx(2 * clock.mean(), rel=0.03)
  assert seconds[10] > 3 * clock.mean()  # the change's first cycle
  assert statistics.median(seconds[-8:]) == pytest.approx(2 * clock.mean(), rel=0.03)


def test_a_host_side_straggler_idles_delay_times_its_mean_iteration(device):
  """Host side, the clock waits for every iteration's outputs (its latency) and idles `delay`
  times their mean before each."""
  clock = _clock(4.0, mode="host")
  seconds = _cycle_seconds(clock, device, cycles=8)
  assert clock.mean() == pytest.approx(HOST + WORK)
  assert statistics.median(seconds[1:]) == pytest.approx(5 * (HOST + WORK))


def test_a_clock_without_delay_never_waits_for_the_device(device):
  for mode in straggler.MODES:
    clock = _clock(0.0, mode)
    seconds = _cycle_seconds(clock, device, cycles=4)
    assert device.waits == 0 and clock.mean() == 0.0
    assert seconds == pytest.approx([HOST] * 3)  # the host's own pace, the device behind it


def test_a_straggling_process_slows_each_of_its_devices_and_no_other_processes():
  """`straggler.process`: a slow host across processes is every device of one process; the
  other processes' devices keep their pace (`straggler.device` names one device instead)."""
  from layup_jax.runtime.options import RuntimeOptions
  slow_host = RuntimeOptions.of(straggler_process=1, straggler_delay_iters=1.0)
  assert [slow_host.delay_of(i, process_index=1) for i in range(4)] == [1.0] * 4
  assert [slow_host.delay_of(i, process_index=p) for p in (0, 2) for i in range(4)] == [0.0] * 8
  one_device = RuntimeOptions.of(straggler_device=2, straggler_delay_iters=3.0)
  assert [one_device.delay_of(i) for i in range(4)] == [0.0, 0.0, 3.0, 0.0]
