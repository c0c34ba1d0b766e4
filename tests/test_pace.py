"""The survivors of a lost process train its share of the samples (layup_jax/runtime/pace.py):
each step of the run then costs them devices / live devices iterations, the run's count (hooks,
schedule, records) stays in its own steps, and a rejoin brings the rate back. Across uneven
hosts the processes share the steps by their speed, the run's samples as planned."""

from fractions import Fraction

import pytest

from layup_jax.runtime.pace import SPEED_BOUND, Pace, rate_by_speed
from tests.helpers import make_layup_runtime


def test_without_a_loss_the_runs_count_is_this_processs():
  pace = Pace(per_round=2)
  assert [pace.actual(n) for n in range(9)] == list(range(9))
  assert [pace.nominal(n) for n in range(9)] == list(range(9))


@pytest.mark.parametrize("per_round, total, live", [(2, 6, 4), (4, 8, 7), (1, 8, 5), (3, 9, 3)])
def test_after_a_loss_each_step_costs_devices_over_live_iterations(per_round, total, live):
  pace = Pace(per_round)
  lost_at = 10 * per_round + 1  # mid-round: the change starts at the next whole round
  pace.set_rate(Fraction(total, live), started=lost_at)
  start = 11 * per_round
  for step in range(11, 60):
    actual = pace.actual(step * per_round)
    # every whole step of the run is reached exactly (hooks fire at their steps) ...
    assert pace.nominal(actual) // per_round == step
    # ... on the live devices' share of its samples, rounded up to a whole round
    owed = (step - 11) * per_round * Fraction(total, live)
    assert owed <= actual - start < owed + per_round
  steps = [pace.nominal(a) // per_round for a in range(0, 60 * per_round)]
  assert steps == sorted(steps)  # the schedule's step never goes back
  assert [pace.actual(n) for n in range(start + 1)] == list(range(start + 1))  # nothing before


def test_a_rejoin_at_a_consistent_point_restores_one_iteration_per_step_there():
  pace = Pace(per_round=2)
  pace.set_rate(Fraction(3, 2), started=20)
  at_rejoin = pace.actual(2 * 30)  # the consistent point at step 30
  pace.set_rate(Fraction(1), started=at_rejoin, nominal=2 * 30)
  assert pace.nominal(at_rejoin) == 60
  assert [pace.actual(60 + k) - at_rejoin for k in range(0, 20, 2)] == list(range(0, 20, 2))
  assert pace.actual(2 * 25) == 20 + 46  # a step before it keeps its cost: 30 x 1.5, a round up


def test_the_runtime_trains_the_stretched_steps_and_counts_the_runs():
  """A process of 4 devices that finds a sixth of the run's devices lost after step 10 trains
  steps 10 to 20 on 6/5 of its iterations; the run's count says step 20."""
  runtime = make_layup_runtime(4)
  try:
    runtime.compile()
    runtime.run_until(4 * 10, lambda _: None)
    runtime.pace.set_rate(Fraction(6, 5), runtime.iterations_started())
    progress = []
    runtime.run_until(4 * 20, progress.append)
    assert runtime.iterations_done() // 4 == 20 and progress[-1] // 4 == 20
    assert sum(runtime.stats.iterations_per_device()) == runtime.own_iterations() == 40 + 48
  finally:
    runtime.close()


def _report(process, speed):
  return {"process": process, "speed": speed}


def test_uneven_hosts_share_the_steps_by_their_speed_and_the_runs_samples_stay_planned():
  """A host twice as fast takes twice the iterations per device, a host half as fast half as
  many; over the live processes the shares add up to the run's planned iterations."""
  devices = {0: 4, 1: 4}
  reports = [_report(0, 20.0), _report(1, 10.0)]
  rates = {k: rate_by_speed(reports, devices, k, planned_devices=8) for k in devices}
  assert rates == {0: Fraction(4, 3), 1: Fraction(2, 3)}
  assert sum(rates[k] * n for k, n in devices.items()) == 8
  # a step's iterations per process follow: 4 x 4/3 + 4 x 2/3 = 8 per step
  pace = Pace(per_round=4)
  pace.set_rate(rates[1], started=40, nominal=40)
  assert pace.actual(40 + 4 * 30) == 40 + 4 * 20  # 30 steps: 20 rounds of the slow host's
  assert pace.nominal(40 + 4 * 20) // 4 == 10 + 30


def test_nearly_equal_speeds_keep_one_iteration_per_step_and_a_loss_share_stays_the_survivors():
  devices = {0: 2, 1: 2, 2: 2}
  near = [_report(0, 10.0), _report(1, 10.5), _report(2, 10.9)]
  assert {rate_by_speed(near, devices, k, 6) for k in devices} == {Fraction(1)}
  # process 2 lost: the survivors share its devices' part (6 planned over 4 live devices)
  survivors = {0: 2, 1: 2}
  assert {rate_by_speed(near[:2], survivors, k, 6) for k in survivors} == {Fraction(3, 2)}


@pytest.mark.parametrize("bad", [
    None, "fast", [1], {"process": 1}, {"process": 1, "speed": float("nan")},
    {"process": 1, "speed": -3.0}, {"process": 1, "speed": True}, {"process": "1", "speed": 9.0},
    {"process": 7, "speed": 9.0}])
def test_a_malformed_speed_report_moves_no_share(bad):
  """What another process reports is checked: a report of the wrong form, or naming a process
  that is not live, counts as none (that process at the median speed)."""
  devices = {0: 2, 1: 2}
  assert rate_by_speed([_report(0, 10.0), bad], devices, 0, 4) == 1
  assert rate_by_speed([_report(0, 10.0), bad], devices, 1, 4) is None  # 1 measured nothing


def test_a_speed_report_far_from_the_others_is_bounded():
  """A process claiming 1000x the others' speed takes at most `SPEED_BOUND` times theirs."""
  devices = {0: 2, 1: 2, 2: 2}
  reports = [_report(0, 10.0), _report(1, 10.0), _report(2, 10_000.0)]
  bound = Fraction(SPEED_BOUND)
  assert rate_by_speed(reports, devices, 2, 6) == 6 * bound / (2 * (2 + bound))
  assert rate_by_speed(reports, devices, 0, 6) == Fraction(6) / (2 * (2 + bound))


def test_a_rate_set_where_the_map_starts_is_kept_as_at_a_rejoin_while_another_is_lost():
  """A process rejoins at step 1680 (its map starts there) while another is still lost, so
  its devices take 6 / 4 iterations per step at once: the run's count follows that rate (it
  was read as one iteration per step, and fell back when a later loss added a piece; found by
  the churn drill: a rejoined process then ended its run as stopped, at a step short of the
  next evaluation)."""
  pace = Pace(per_round=2, nominal=3360)
  pace.set_rate(Fraction(6, 4), started=3360, nominal=3360)
  assert pace.actual(3360 + 2 * 60) == 3360 + 180  # 60 steps: 90 rounds of 2 devices
  assert pace.nominal(3360 + 180) == 3360 + 120
  before = pace.nominal(3360 + 80)
  pace.set_rate(Fraction(3), started=3360 + 80)  # the next loss: 6 / 2
  assert pace.nominal(3360 + 80) == before  # the count never falls back
  assert pace.nominal(3360 + 86) // 2 >= before // 2
