"""What every training algorithm exposes to the runner, and the pieces they share."""

from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections
import optax

from layup_jax import models
from layup_jax.data.pipeline import Batch
from layup_jax.models.staged import StagedModel
from layup_jax.runtime.engine import AsyncRuntime
from layup_jax.runtime.options import RuntimeOptions
from layup_jax.runtime.stats import RunStats

PyTree = Any


class Checkpoint(Protocol):
  """What resumes a runtime, at a consistent point."""

  arrays_stay_valid: bool  # False: training donates (deletes) arrays a state_dict references

  def state_dict(self) -> tuple[PyTree, dict[str, Any]]:
    """(device arrays, JSON-able metadata) that resume the runtime."""

  def restore_template(self, meta: dict[str, Any]) -> PyTree:
    """Shapes, dtypes and target devices of the arrays saved with `meta`, for Orbax."""

  def load_state_dict(self, arrays: PyTree, meta: dict[str, Any]) -> None:
    """Continues from `state_dict()`'s output, remapped if it was saved on other devices."""


class Runtime(Protocol):
  """A training algorithm as the runner drives it.

  Progress is counted in device iterations: one iteration is one device's forward and backward
  pass on its own batch, so a synchronous step over M devices is M iterations. What a run
  reports (models, losses, weights, latencies) is read from `stats` (layup_jax/runtime/stats.py).
  """

  num_devices: int  # the devices whose iterations `run_until` and `iterations_done` count
  stats: RunStats
  checkpoint: Checkpoint

  def compile(self) -> None:
    """Compiles every function the training loop calls, on every device."""

  def run_until(self, iterations: int, on_progress: Callable[[int], None],
                should_stop: Callable[[], bool] = lambda: False) -> None:
    """Trains until `iterations` are done in total, then returns at a consistent point.

    When `should_stop()` turns true it returns early, at the next consistent point whose
    iteration count is a whole number of steps (a multiple of the number of devices).
    """

  def iterations_done(self) -> int: ...

  def own_iterations(self) -> int:
    """This process's iterations done: `iterations_done` but after an elastic run lost a
    process, whose share of the samples this process's devices then train too
    (layup_jax/runtime/pace.py)."""

  def flops_per_iteration(self) -> float:
    """XLA's FLOP count of one device's iteration."""

  def close(self) -> None:
    """Stops and joins whatever the runtime started; safe to call twice."""


def asynchronous_runtime(config: ml_collections.ConfigDict, model: StagedModel,
                         tx: optax.GradientTransformation, devices, dataset,
                         make_exchange: Callable) -> AsyncRuntime:
  """An algorithm on the asynchronous runtime: its `Exchange` (`make_exchange(links)`) on
  replicas that all start from the run's initial model."""
  params, state = init_model(config, model, dataset.example_batch)
  return AsyncRuntime(model, tx, devices, dataset.train, params, state, dataset.example_batch,
                      make_exchange, RuntimeOptions.from_config(config))


def init_model(config: ml_collections.ConfigDict, model: StagedModel, example_batch: Batch):
  """Per-stage params and state from the run's seed (or `config.model.pretrained` weights).

  Every replica starts from these. The stages' initializers run as one jitted program: op by
  op, each initializer and layer compiled its own small programs (the digits' ResNet: 10 s to
  6 s, the same values), and a process other than 0 never finds those in the persistent
  compilation cache (docs/records/elastic.md), so every start and every rejoin paid them.
  """
  params, state = jax.jit(model.init)(jax.random.key(config.seed), example_batch.inputs)
  if config.model.pretrained:
    params = models.load_pretrained(config.model, model, example_batch.inputs)
  return params, state
