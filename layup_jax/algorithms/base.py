"""What every training algorithm exposes to the runner, and the pieces they share."""

from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections

from layup_jax import models
from layup_jax.data.pipeline import Batch
from layup_jax.snapshot import Snapshot
from layup_jax.stages import StagedModel

PyTree = Any


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

  num_devices: int  # the devices whose iterations `run_until` and `iterations_done` count

  def iterations_done(self) -> int: ...

  def collect(self) -> None:
    """Makes the accessors below (snapshot, losses, weights, counts) cover the whole run where
    this process holds part of it (a collective: every process calls it at the same
    consistent point); else nothing."""

  def snapshot(self) -> Snapshot: ...

  def train_loss(self) -> float:
    """Mean training loss since the previous call (NaN if none was recorded)."""

  def weight_sums(self) -> list[float]:
    """Per stage, the sum over devices of the push-sum weights (1 while none is lost)."""

  def iterations_per_device(self) -> list[int]:
    """Iterations each device has done (a straggler does fewer under LayUp)."""

  def flops_per_iteration(self) -> float:
    """XLA's FLOP count of one device's iteration."""

  def stage_latencies(self) -> list[list[float]] | None:
    """Per stage, the update latencies (s) sampled since the previous call; None if not timed."""

  def remote_send_latencies(self) -> list[float]:
    """Seconds from offer to merge of each send to another process's device since the previous
    call (none in one process, or without gossip)."""

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
