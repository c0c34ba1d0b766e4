"""What every training algorithm exposes to the runner, and the pieces they share."""

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np

from layup_jax import models
from layup_jax.data.pipeline import Batch
from layup_jax.stages import StagedModel

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """References to every replica's model at a consistent point, for evaluation.

  `weights` average the parameters (push-sum weights; a single 1.0 for a replicated model) and
  `state_weights` the BatchNorm statistics, which depend on the BatchNorm policy.
  """

  params: list[list[PyTree]]  # [replica][stage]
  state: list[list[PyTree]]
  weights: list[float]
  state_weights: list[float]


class Runtime(Protocol):
  """A training algorithm as the runner drives it.

  Progress is counted in device iterations: one iteration is one device's forward and backward
  pass on its own batch, so a synchronous step over M devices is M iterations.
  """

  donates_buffers: bool  # whether training donates (deletes) arrays a state_dict references

  def compile(self) -> None:
    """Compiles every function the training loop calls, on every device."""

  def run_until(self, iterations: int, on_progress: Callable[[int], None],
                should_stop: Callable[[], bool] = lambda: False) -> None:
    """Trains until `iterations` are done in total, then returns at a consistent point.

    When `should_stop()` turns true it returns early, at the next consistent point whose
    iteration count is a whole number of steps (a multiple of the number of devices).
    """

  def iterations_done(self) -> int: ...

  def snapshot(self) -> Snapshot: ...

  def train_loss(self) -> float:
    """Mean training loss since the previous call (NaN if none was recorded)."""

  def weight_sum(self) -> float: ...

  def iterations_per_device(self) -> list[int]:
    """Iterations each device has done (a straggler does fewer under LayUp)."""

  def flops_per_iteration(self) -> float:
    """XLA's FLOP count of one device's iteration."""

  def stage_latencies(self) -> list[list[float]] | None:
    """Per stage, the update latencies (s) sampled since the previous call; None if not timed."""

  def skipped_steps(self) -> int:
    """Iterations whose update was skipped for a non-finite gradient (`faults.nonfinite`)."""

  def state_dict(self) -> tuple[PyTree, dict[str, Any]]:
    """(device arrays, JSON-able metadata) that resume the runtime; at a consistent point."""

  def load_state_dict(self, arrays: PyTree, meta: dict[str, Any]) -> None:
    """Continues from `state_dict()`'s output, remapped if it was saved on other devices."""

  def restore_template(self, meta: dict[str, Any]) -> PyTree:
    """Shapes, dtypes and target devices of the arrays saved with `meta`, for Orbax."""

  def close(self) -> None:
    """Stops and joins whatever the runtime started; safe to call twice."""


def init_model(config: ml_collections.ConfigDict, model: StagedModel, example_batch: Batch):
  """Per-stage params and state from the run's seed (or `config.model.pretrained` weights).

  Every replica starts from these.
  """
  params, state = model.init(jax.random.key(config.seed), example_batch.inputs)
  if config.model.pretrained:
    params = models.load_pretrained(config.model, model, example_batch.inputs)
  return params, state


def runtime_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The `LayUpRuntime` keyword arguments that LayUp and the baselines on its runtime all take
  from the config."""
  return {
      "seed": config.seed,
      "max_dispatch_ahead": config.layup.max_dispatch_ahead,
      "straggler_device": config.straggler.device,
      "straggler_delay_iters": config.straggler.delay_iters,
      "nonfinite_policy": config.faults.nonfinite,
      "pack_stages": config.layup.pack_stages,
      "remat": config.layup.remat,
  }


class IterationClock:
  """Idles a straggler `delay_iters` times its mean iteration time before each iteration.

  Paper Section 5.4: the idle time is a multiple of the time one forward and one backward pass
  take. A straggler's clock therefore waits, at the end of each iteration, for that iteration's
  last outputs (the backward pass's end) before reading the time: with asynchronous dispatch
  the device would otherwise drain its queue during the idling and the measured time, and with
  it the delay, would shrink towards the dispatch time alone. Clocks without delay never wait.
  """

  def __init__(self, delay_iters: float):
    self.delay_iters = delay_iters
    self._start = 0.0
    self._total, self._count = 0.0, 0

  def mean(self) -> float:
    return self._total / self._count if self._count else 0.0

  def start_iteration(self, idle: Callable[[float], Any] = time.sleep) -> None:
    """Idles (when a straggler) and marks the start of an iteration."""
    delay = self.delay_iters * self.mean()
    if delay > 0:
      idle(delay)
    self._start = time.perf_counter()

  def get_state(self) -> list[float]:
    return [self._total, self._count]

  def set_state(self, state: Sequence[float]) -> None:
    self._total, self._count = float(state[0]), int(state[1])

  def end_iteration(self, last_outputs: Any) -> None:
    """Marks the end of an iteration whose work ends with `last_outputs`."""
    if self.delay_iters > 0:
      jax.block_until_ready(last_outputs)
      self._total += time.perf_counter() - self._start
      self._count += 1


def mean_or_nan(values: Sequence[float]) -> float:
  return float(np.mean(values)) if len(values) else float("nan")
