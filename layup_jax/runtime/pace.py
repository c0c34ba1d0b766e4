"""How many of this process's device iterations make a step of the run.

A run is planned in steps: a step is one iteration of each of its `num_devices` devices, and
every hook (evaluations, checkpoints, the end), the learning-rate schedule and the records count
in them. While every device trains, this process's devices do its share of a step, one iteration
each. When an elastic run loses a process, its devices' share of the remaining samples would go
untrained: the run would end on fewer samples than planned, and a run that lost a sixth of its
devices at 40 % ended about as far below an uninterrupted one as a run on 5/6 of the samples
(docs/records/elastic.md). With `distributed.survivors_train_lost_share`, the live devices take
that share over: from then on each step of the run costs each of them `num_devices / live`
iterations, its schedule stretched over them, until a rejoin brings the rate back.

The run's count of iterations ("nominal": the steps reached times this process's devices) and
this process's own ("actual") are then related piecewise linearly; `Pace` holds that relation.
Without a loss it is the identity.

Across uneven hosts a gossip run shares each interval between consistent points by speed
(`distributed.share_by_speed`, `rate_by_speed`): a process whose devices ran twice as fast in the
last interval takes twice the iterations per device in the next, so that every process reaches
the next evaluation or checkpoint at about the same time and a fast host does not wait there for
a slow one. The run's samples stay as planned; only who trains them moves. Then a rate may be
below 1.
"""

import math
import statistics
from fractions import Fraction

# Speeds within this share of each other count as equal (a measured rate's noise moves nothing).
SPEED_DEAD_BAND = 0.1
# A process's reported speed is bounded to this factor of the median's either side: the reports
# come from other processes and are not trusted to move the shares further.
SPEED_BOUND = 8.0


def rate_by_speed(reports: list, devices: dict[int, int], me: int,
                  planned_devices: int) -> Fraction | None:
  """This process's rate (actual iterations per nominal one) for the next interval: the run's
  `planned_devices` iterations per step, shared among the live processes (`devices`: each one's
  device count) in proportion to each one's devices times their speed (iterations per second per
  device in the last interval), from `reports` (`{"process": k, "speed": s}`, one per process,
  as gathered). A report that is not of that form, or names a process not live, is ignored;
  a live process without one counts at the median speed; speeds within `SPEED_DEAD_BAND` of each
  other count as equal. None (keep the present rate) when this process measured nothing."""
  speeds = {}
  for report in reports:
    if not isinstance(report, dict):
      continue
    process, speed = report.get("process"), report.get("speed")
    if (type(process) is int and process in devices and type(speed) in (int, float)
        and math.isfinite(speed) and speed > 0):
      speeds[process] = float(speed)
  if me not in speeds:
    return None
  median = statistics.median(speeds.values())
  speeds = {k: min(max(speeds.get(k, median), median / SPEED_BOUND), median * SPEED_BOUND)
            for k in devices}
  if max(speeds.values()) <= (1 + SPEED_DEAD_BAND) * min(speeds.values()):
    speeds = dict.fromkeys(speeds, 1.0)
  total = sum(speeds[k] * n for k, n in devices.items())
  return Fraction(planned_devices * speeds[me] / total).limit_denominator(64)


class Pace:
  """A piecewise-linear map between the run's (nominal) iteration count and this process's
  actual one, each piece starting at a whole round (one iteration of each of this process's
  devices) and costing `rate` actual iterations per nominal one (above 1 where this process
  trains a lost one's share or is faster than the others, below where it is slower)."""

  def __init__(self, per_round: int, nominal: int = 0):
    self.per_round = per_round
    # (actual start, nominal start, rate); replaced whole, never changed in place: the
    # watchdog's thread sets a rate while the dispatcher reads steps.
    self._pieces: tuple[tuple[int, Fraction, Fraction], ...] = (
        (nominal, Fraction(nominal), Fraction(1)),)

  @property
  def rate(self) -> Fraction:
    return self._pieces[-1][2]

  def nominal(self, actual: int) -> int:
    """The run's iteration count when this process has done `actual` iterations (its step:
    this over `per_round`)."""
    if self._identity():  # no loss: the identity (the dispatcher asks every iteration)
      return actual
    return math.floor(self._exact_nominal(actual))

  def actual(self, nominal: int) -> int:
    """This process's iterations for the run to count `nominal` (at least that; a whole
    number of rounds past a piece's start)."""
    if self._identity():
      return nominal
    a0, m0, rate = self._piece(1, nominal)
    if rate == 1:
      return a0 + math.ceil(nominal - m0)
    return a0 + self.per_round * math.ceil((nominal - m0) * rate / self.per_round)

  def set_rate(self, rate: Fraction, started: int, nominal: int | None = None) -> None:
    """From the first whole round at or after `started` (this process's iterations begun),
    each nominal iteration costs `rate` actual ones. `nominal`: the run's count there, where a
    consistent point knows it (else read from the present map)."""
    rate = Fraction(rate)
    if rate == self.rate:
      return
    at = -(-started // self.per_round) * self.per_round
    start = Fraction(nominal) if nominal is not None else self._exact_nominal(at)
    self._pieces = (*(p for p in self._pieces if p[0] < at), (at, start, rate))

  def _identity(self) -> bool:
    """One piece at rate 1: the identity. (One piece at another rate is no identity: a rate
    set where the map starts, as at a rejoin while another process is still lost.)"""
    return len(self._pieces) == 1 and self._pieces[0][2] == 1

  def _piece(self, key: int, value) -> tuple[int, Fraction, Fraction]:
    """The last piece starting at or before `value` (of the actual count: `key` 0, of the
    nominal: 1); the first piece for anything before it."""
    return next((p for p in reversed(self._pieces) if p[key] <= value), self._pieces[0])

  def _exact_nominal(self, actual: int) -> Fraction:
    a0, m0, rate = self._piece(0, actual)
    return m0 + Fraction(actual - a0) / rate
