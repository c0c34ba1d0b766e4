"""One forward and backward pass of a staged model, dispatched stage by stage (paper
Algorithm 1, compute side): `staged_pass` calls a device's `StageOps` per stage and hands each
stage's result on as its backward is dispatched. The runtime's ops are atomic writes of the
device's replica (runtime/replicas.py `DeviceStages`); `FixedStages` runs the same pass on
given params (the reference the tests compare with `jax.grad`).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from layup_jax.models.staged import StagedModel, stage_key
from layup_jax.runtime.programs import StageSteps

PyTree = Any


class StageOps(Protocol):
  """One device's stage programs as `staged_pass` dispatches them: the runtime's replica store
  makes each an atomic read-dispatch-store of the device's replica (`DeviceStages` in
  layup_jax/runtime/replicas.py); `FixedStages` runs them on given params."""

  def read(self, s: int) -> PyTree:
    """Stage s's params as they are now."""

  def forward(self, s: int, x: PyTree, key: jax.Array, iteration: jax.Array) -> tuple:
    """Stage s's forward (its new BatchNorm state stored): `(y, vjp)`."""

  def forward_chain(self, x: PyTree, keys: Sequence[jax.Array], iteration: jax.Array) -> tuple:
    """Every stage's forward before the loss stage in one program (`StageSteps.forward_chain`;
    the new BatchNorm states stored): `(each stage's input, the last one's output, vjps)`."""

  def loss(self, x: PyTree, labels: jax.Array, key: jax.Array, iteration: jax.Array) -> tuple:
    """The loss stage: `(loss, its gradient or its updated params, dx)`."""

  def backward(self, s: int, vjp: PyTree, x: PyTree, dy: PyTree,
               tied_grad: PyTree | None) -> tuple:
    """Stage s's backward (with a tie owner's `tied_grad` added): `(its gradient or its
    updated params, dx)`."""


def staged_pass(model: StagedModel, steps: StageSteps, ops: StageOps, x: jax.Array,
                labels: jax.Array, stage_keys: Sequence[jax.Array], iteration: jax.Array,
                emit: Callable[[int, PyTree], None],
                on_stage: Callable[[int], None] = lambda stage_idx: None):
  """One forward and backward pass, dispatched stage by stage (paper Algorithm 1, compute side).

  Each stage's params are read when its forward and its backward are dispatched, so each uses
  the freshest ones (the paper's "backward pass on different weights", Section 6.1). `emit(s,
  out)` is called as soon as stage s's backward is dispatched, last stage first, with what
  `ops` returned for it (its gradient, or its updated params where `ops` applies the local
  update in the backward's program); `stage_keys[s]` is `stage_key(key, s)`. Returns `(loss,
  stage 0's out)`.
  """
  last = model.num_stages - 1
  vjps, inputs = [], []

  def stage_input(s: int, x: PyTree) -> PyTree:
    if s in steps.read_tied:  # packed params: the tied array is cut out on the device
      return x, steps.read_tied[s](ops.read(model.tie_of(s).owner))
    return model.stage_input(s, x, ops.read)

  if steps.forward_chain is not None:  # one program; its stages' inputs kept as in the loop
    on_stage(0)
    inputs, x, vjps = ops.forward_chain(x, stage_keys[:last], iteration)
  for s in range(len(vjps), last):
    on_stage(s)
    x_in = stage_input(s, x)
    x, vjp = ops.forward(s, x_in, stage_keys[s], iteration)
    vjps.append(vjp)
    inputs.append(x_in)  # given to its backward again: the residuals hold no copy
  on_stage(last)
  loss, out, dx = ops.loss(stage_input(last, x), labels, stage_keys[last], iteration)
  tied_grads = {}
  for s in reversed(range(last + 1)):
    if s < last:
      on_stage(s)
      out, dx = ops.backward(s, vjps[s], inputs[s], dx, tied_grads.pop(s, None))
      vjps[s] = inputs[s] = None  # drop the residuals as soon as they are used
    tie = model.tie_of(s)
    if tie is not None:
      dx, tied_grads[tie.owner] = dx
    emit(s, out)
  return loss, out


@dataclasses.dataclass
class FixedStages:
  """`StageOps` on given per-stage params (never changed) and states (replaced as the
  forwards compute new ones): gradients, no updates."""

  steps: StageSteps
  params: Sequence[PyTree]
  states: list[PyTree]

  def read(self, s):
    return self.params[s]

  def forward(self, s, x, key, iteration):
    y, self.states[s], vjp = self.steps.forward[s](self.params[s], self.states[s], x, key,
                                                   iteration)
    return y, vjp

  def forward_chain(self, x, keys, iteration):
    last = len(self.params) - 1
    inputs, y, self.states[:last], vjps = chain_forwards(self.steps, self.params[:last],
                                                         self.states[:last], x, keys, iteration)
    return inputs, y, vjps

  def loss(self, x, labels, key, iteration):
    last = len(self.params) - 1
    value, self.states[last], grads, dx = self.steps.loss(self.params[last], self.states[last],
                                                          x, labels, key, iteration)
    return value, grads, dx

  def backward(self, s, vjp, x, dy, tied_grad):
    return backward_grads(self.steps, s, vjp, self.params[s], x, dy, tied_grad)


def chain_forwards(steps: StageSteps, params: Sequence[PyTree], states: Sequence[PyTree], x,
                   keys: Sequence[jax.Array], iteration) -> tuple[list, PyTree, list, list]:
  """`steps.forward_chain` on the stages before the loss stage: (each stage's input, stage 0's
  being `x`; the last one's output; the new states; the vjps), as lists."""
  inputs, y, new_states, vjps = steps.forward_chain(tuple(params), tuple(states), x,
                                                    tuple(keys), iteration)
  return [x, *inputs], y, list(new_states), list(vjps)


def backward_grads(steps: StageSteps, s: int, vjp, params: PyTree, x, dy, tied_grad):
  """Stage s's backward without an update: (its gradient, with a tied parameter's gradient
  from another stage added, and the gradient of its input)."""
  grads, dx = steps.backward[s](vjp, (params, x), dy)
  if tied_grad is not None:
    grads = steps.add_tied[s](grads, tied_grad)
  return grads, dx


def staged_value_and_grad(model: StagedModel, steps: StageSteps, params, state, x, labels, key,
                          iteration):
  """One staged forward and backward pass on fixed params, on the calling thread.

  Returns `(loss, grads per stage, new state per stage)`: the reference that tests compare with
  `jax.grad` of the composed model.
  """
  grads, ops = [None] * model.num_stages, FixedStages(steps, params, list(state))
  keys = [stage_key(key, s) for s in range(model.num_stages)]
  loss, _ = staged_pass(model, steps, ops, x, labels, keys, iteration, grads.__setitem__)
  return loss, grads, ops.states
