"""What one staged iteration costs a device: XLA's FLOPs and scratch memory of its programs.

Replays one iteration's stage functions and per-stage updates on their arguments' shapes
(nothing runs) and sums what `layup_jax.measure.flops` reads of each: the model's FLOPs for MFU
(without the backward's recomputation) and the largest scratch memory of any one program.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from layup_jax.measure.flops import compiled, flops_of, lowered
from layup_jax.models import staged
from layup_jax.runtime import programs, staged_pass


def staged_calls(model: staged.StagedModel, steps: programs.StageSteps, update: Callable, params,
                 state, opt_state, batch, key, iteration, visit: Callable) -> None:
  """Calls `visit(fn, *args)` for every jitted function of one staged iteration on one device
  (stage forwards, loss, backwards, tie functions, per-stage updates `update(params,
  opt_state, grads, step)`) with its arguments.

  Traces the staged pass once on the given arrays to get each function's arguments: each
  function's output is its shape (`jax.eval_shape`), so nothing is compiled or run here (a first
  run would otherwise compile every stage function a second time, without its remat).
  """
  def visited(fn):
    def call(*args):
      visit(fn, *args)
      return jax.eval_shape(fn, *args)
    return call

  visited_steps = programs.StageSteps(
      forward=tuple(map(visited, steps.forward)), loss=visited(steps.loss),
      backward=tuple(map(visited, steps.backward)),
      add_tied={s: visited(f) for s, f in steps.add_tied.items()},
      read_tied={s: visited(f) for s, f in steps.read_tied.items()})
  _, grads, _ = staged_pass.staged_value_and_grad(model, visited_steps, params, state, batch.inputs,
                                             batch.targets, key, iteration)
  for s, stage_grads in enumerate(grads):
    visit(update, params[s], opt_state[s], stage_grads, iteration)  # the step: an int32 too


def replica_calls(model: staged.StagedModel, store: Any, example: Any,
                  steps: programs.StageSteps | None = None) -> tuple:
  """`staged_calls`'s arguments (without `visit`) that replay one iteration of the replica
  store's device 0 on `example` (a Batch), with the store's stage functions or `steps`; the
  replica's state is not changed."""
  replica = store.replicas[0]
  inputs, targets = jax.device_put((example.inputs, example.targets), replica.device)
  return (model, steps or store.steps, store.update, replica.params, list(replica.state),
          replica.opt_state, type(example)(inputs, targets),
          jax.random.key(0),  # uncommitted, as the store's keys are made: no new program
          jax.device_put(np.int32(0), replica.device))


def replica_flops(model: staged.StagedModel, store: Any, example: Any,
                  analyse: Callable = lowered) -> float:
  """XLA's FLOPs of one iteration of the replica store's device 0 (stage functions and updates;
  no gossip): the model's FLOPs, counted without the backward's recomputation (`remat`), as
  MFU counts them; `analyse` is `lowered` (no compilation) or `compiled`."""
  steps = programs.make_stage_steps(model, packings=store.packings,
                                    state_packings=store.state_packings,
                                    by_halves=store.by_halves)
  return staged_flops(*replica_calls(model, store, example, steps), analyse=analyse)


def staged_flops(model: staged.StagedModel, steps: programs.StageSteps, update: Callable, params,
                 state, opt_state, batch, key, iteration, analyse: Callable = lowered) -> float:
  """FLOPs of one staged iteration on one device: every stage function's cost, summed;
  `analyse` is `lowered` (cheap: no compilation) or `compiled` (XLA's optimized program)."""
  total = [0.0]

  def count(fn, *args):
    total[0] += flops_of(analyse(fn, *args))

  staged_calls(model, steps, update, params, state, opt_state, batch, key, iteration, count)
  return total[0]


def staged_temp_bytes(model: staged.StagedModel, steps: programs.StageSteps, update: Callable,
                      params, state, opt_state, batch, key, iteration) -> int:
  """The largest scratch memory (XLA's `temp_size_in_bytes`) of any function of a staged
  iteration: what a device needs beyond its live arrays while that function runs."""
  largest = [0]

  def measure(fn, *args):
    largest[0] = max(largest[0], compiled(fn, *args).memory_analysis().temp_size_in_bytes)

  staged_calls(model, steps, update, params, state, opt_state, batch, key, iteration, measure)
  return largest[0]
