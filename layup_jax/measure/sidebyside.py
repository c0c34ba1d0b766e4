"""Timing alternatives side by side, for the benchmarks in `scripts/`.

On a shared machine the speed of the moment drifts by more than most effects measured, so each
side of a comparison is timed in short blocks, the sides taking turns (the order reversed every
round, so that no side always follows the same one), and a ratio is the median of the per-round
ratios rather than a ratio of medians taken at different moments.
"""

import statistics
import time
from collections.abc import Callable


def interleaved(blocks: dict[str, Callable[[], float]], rounds: int,
                per_unit: dict[str, float]) -> dict[str, list[float]]:
  """Runs each side's block once per round, after one warm-up block each; a block returns its
  seconds. Returns each side's seconds per unit (`per_unit[side]` units per block), per round."""
  for block in blocks.values():
    block()
  times: dict[str, list[float]] = {side: [] for side in blocks}
  for r in range(rounds):
    for side in (list(blocks) if r % 2 == 0 else list(blocks)[::-1]):
      times[side].append(blocks[side]() / per_unit[side])
  return times


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
  """The median of the per-round ratios."""
  return statistics.median(a / b for a, b in zip(numerators, denominators))


def threaded_block(runtime, iterations: int) -> float:
  """Seconds for `iterations` more iterations of a runtime's threads (all devices together)."""
  start = time.perf_counter()
  runtime.run_until(runtime.iterations_done() + iterations, lambda done: None)
  return time.perf_counter() - start


def serial_block(step: Callable[[], object], iterations: int) -> float:
  """Seconds for `iterations` calls of `step` on the calling thread."""
  start = time.perf_counter()
  for _ in range(iterations):
    step()
  return time.perf_counter() - start
