"""Staging a model: an ordered list of Flax modules becomes per-stage pure functions.

A stage is `(params, state, x, rng, train) -> (y, new_state)`; `state` holds mutable collections
such as BatchNorm's `batch_stats`. The last stage is the loss head: its module's output and the
labels go through `loss_fn`. LayUp dispatches one jitted forward per stage that returns the
activation *and* the stage's VJP (so the backward pass never recomputes the forward), then one
jitted VJP per stage in reverse order, handing each stage's gradient to the updater as it appears.
"""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy of integer labels."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def _accepts_train(module: nn.Module) -> bool:
  return "train" in inspect.signature(type(module).__call__).parameters


def stage_rng(key: jax.Array, iteration: jax.Array, stage_idx: int) -> jax.Array:
  """The dropout key of one stage in one iteration, the same in staged and fused steps."""
  return jax.random.fold_in(jax.random.fold_in(key, iteration), stage_idx)


@dataclasses.dataclass(frozen=True)
class StagedModel:
  """A model as an ordered list of stages; the last one feeds `loss_fn`.

  Each module is called as `module(x, train=train)` (or `module(x)` when its `__call__` takes
  no `train`); dropout reads the `"dropout"` rng stream.
  """

  modules: tuple[nn.Module, ...]
  loss_fn: LossFn = softmax_cross_entropy

  def __post_init__(self):
    if not self.modules:
      raise ValueError("a StagedModel needs at least one module")
    object.__setattr__(self, "modules", tuple(self.modules))

  @property
  def num_stages(self) -> int:
    return len(self.modules)

  def init(self, rng: jax.Array, x: jax.Array) -> tuple[list[PyTree], list[PyTree]]:
    """Per-stage params and state, built by passing an example batch through the stages."""
    params, state = [], []
    for stage_idx, module in enumerate(self.modules):
      init_rng, dropout_rng = jax.random.split(jax.random.fold_in(rng, stage_idx))
      kwargs = {"train": False} if _accepts_train(module) else {}
      x, variables = module.init_with_output(
          {"params": init_rng, "dropout": dropout_rng}, x, **kwargs
      )
      variables = dict(variables)
      params.append(variables.pop("params", {}))
      state.append(variables)
    return params, state

  def apply_stage(
      self, stage_idx: int, params: PyTree, state: PyTree, x: PyTree, rng: jax.Array, train: bool
  ) -> tuple[PyTree, PyTree]:
    """The stage as a pure function: `(params, state, x, rng, train) -> (y, new_state)`."""
    module = self.modules[stage_idx]
    kwargs = {"train": train} if _accepts_train(module) else {}
    variables = {"params": params, **state}
    if train and state:
      y, new_state = module.apply(
          variables, x, rngs={"dropout": rng}, mutable=list(state), **kwargs
      )
      return y, dict(new_state)
    return module.apply(variables, x, rngs={"dropout": rng}, **kwargs), state

  def loss_stage(
      self, params: PyTree, state: PyTree, x: PyTree, labels: jax.Array, rng: jax.Array
  ) -> tuple[jax.Array, PyTree]:
    """The loss head in train mode: `(loss, new_state)`."""
    logits, new_state = self.apply_stage(self.num_stages - 1, params, state, x, rng, True)
    return self.loss_fn(logits, labels), new_state

  def apply(
      self,
      params: Sequence[PyTree],
      state: Sequence[PyTree],
      x: jax.Array,
      key: jax.Array,
      iteration: jax.Array,
      train: bool,
  ) -> tuple[jax.Array, list[PyTree]]:
    """All stages composed: `(logits, new_state)`. The fused reference for the staged step."""
    new_state = []
    for stage_idx in range(self.num_stages):
      rng = stage_rng(key, iteration, stage_idx)
      x, stage_state = self.apply_stage(stage_idx, params[stage_idx], state[stage_idx], x, rng, train)
      new_state.append(stage_state)
    return x, new_state

  def loss(self, params, state, x, labels, key, iteration) -> tuple[jax.Array, list[PyTree]]:
    """Training loss of the composed model: `(loss, new_state)`."""
    logits, new_state = self.apply(params, state, x, key, iteration, train=True)
    return self.loss_fn(logits, labels), new_state


@dataclasses.dataclass(frozen=True)
class StageSteps:
  """The jitted per-stage functions of one model; jit caches one executable per device.

  forward[s] (s < L-1): (params, state, x, key, iteration) -> (y, new_state, vjp)
  loss:                 (params, state, x, labels, key, iteration)
                        -> (loss, new_state, grads, dx)   (dx is None for a one-stage model)
  backward[s]:          (vjp, dy) -> (grads, dx); stage 0 returns (grads, None) so that XLA
                        drops the unused input gradient.
  """

  forward: tuple[Callable, ...]
  loss: Callable
  backward: tuple[Callable, ...]


def make_stage_steps(model: StagedModel) -> StageSteps:
  last = model.num_stages - 1

  def make_forward(stage_idx):
    def forward(params, state, x, key, iteration):
      rng = stage_rng(key, iteration, stage_idx)
      y, vjp, new_state = jax.vjp(
          lambda p, h: model.apply_stage(stage_idx, p, state, h, rng, True), params, x,
          has_aux=True,
      )
      return y, new_state, vjp

    return jax.jit(forward)

  def make_backward(stage_idx):
    def backward(vjp, dy):
      grads, dx = vjp(dy)
      return grads, (None if stage_idx == 0 else dx)

    return jax.jit(backward)

  def loss(params, state, x, labels, key, iteration):
    rng = stage_rng(key, iteration, last)
    argnums = (0,) if last == 0 else (0, 1)
    (value, new_state), grads = jax.value_and_grad(
        lambda p, h: model.loss_stage(p, state, h, labels, rng), argnums=argnums, has_aux=True
    )(params, x)
    return value, new_state, grads[0], (grads[1] if last > 0 else None)

  return StageSteps(
      forward=tuple(make_forward(s) for s in range(last)),
      loss=jax.jit(loss),
      backward=tuple(make_backward(s) for s in range(last)),
  )


def staged_value_and_grad(steps: StageSteps, params, state, x, labels, key, iteration):
  """One forward and backward pass through the stage functions, on the calling thread.

  Returns `(loss, grads per stage, new state per stage)`. The runtime interleaves the same calls
  with its updater; this serial form is the reference that tests compare with `jax.grad`.
  """
  num_stages = len(params)
  vjps, new_state = [], list(state)
  for stage_idx in range(num_stages - 1):
    x, new_state[stage_idx], vjp = steps.forward[stage_idx](
        params[stage_idx], state[stage_idx], x, key, iteration
    )
    vjps.append(vjp)
  loss, new_state[-1], last_grads, dx = steps.loss(
      params[-1], state[-1], x, labels, key, iteration
  )
  grads = [None] * num_stages
  grads[-1] = last_grads
  for stage_idx in reversed(range(num_stages - 1)):
    grads[stage_idx], dx = steps.backward[stage_idx](vjps[stage_idx], dx)
  return loss, grads, new_state
