"""FLOPs per iteration from XLA's cost analysis, and model FLOPs utilization (MFU).

XLA counts the FLOPs of a lowered or compiled program (`cost_analysis()`); the staged step's
count is the sum over its stage functions and per-stage optimizer updates. XLA leaves out work
done in library calls (cuDNN convolutions, some cuBLAS GEMMs), so on GPUs the count, and the
MFU computed from it, can be low; `scripts/bench_step.py` prints a 6NT estimate beside it for
GPT-2. Peaks are dense bf16 vendor figures by `device_kind`; CPUs have none, so no MFU there.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from layup_jax.models import staged
from layup_jax.runtime import programs, staged_pass

PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA H100": 989e12,
              "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12,
              "NVIDIA A100 80GB PCIe": 312e12}


def peak_flops(device: jax.Device) -> float | None:
  """The device's peak FLOP/s, or None when the table does not know its kind."""
  return PEAK_FLOPS.get(device.device_kind)


def flops_of(lowered_or_compiled: Any) -> float:
  """XLA's FLOP count of a `jax.stages.Lowered` or `Compiled` program."""
  analysis = lowered_or_compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax returns one dict per computation
    analysis = analysis[0]
  return float((analysis or {}).get("flops", 0.0))


def lowered(fn, *args) -> Any:
  return fn.lower(*args)


def compiled(fn, *args) -> Any:
  return fn.lower(*args).compile()


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
                                  state_packings=store.state_packings)
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
