"""The survivors of a lost process train its share of the samples (layup_jax/runtime/pace.py):
each step of the run then costs them devices / live devices iterations, the run's count (hooks,
schedule, records) stays in its own steps, and a rejoin brings the rate back."""

from fractions import Fraction

import pytest

from layup_jax.runtime.pace import Pace
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
