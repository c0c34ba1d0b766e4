"""Outer optimizers: the step an anchor model takes from the devices' average (SlowMo, CO2,
DiLoCo's Nesterov SGD), each `init` and `step` on pytrees, pure and jitted by the caller
(algorithms/periodic.py). The pseudo-gradient is `anchor - average`."""

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class OuterStep(Protocol):
  """An outer optimizer: the anchor's step from the consensus of the devices' models."""

  def init(self, params: PyTree) -> PyTree: ...

  def step(self, anchor: PyTree, average: PyTree, state: PyTree,
           learning_rate: jax.Array) -> tuple[PyTree, PyTree]:
    """`(new anchor, new state)`; `learning_rate` is the base optimizer's at the boundary."""


def _zeros(params: PyTree) -> PyTree:
  return jax.tree.map(jnp.zeros_like, params)


@dataclasses.dataclass(frozen=True)
class SlowMo:
  """fairscale's SlowMoDistributedDataParallel (Wang et al. 2020, Algorithm 1): the slow
  momentum buffer holds the pseudo-gradient divided by the base learning rate, and the slow step
  multiplies it back, so a decaying learning rate decays the slow step with it.
  At a learning rate of 0 the pseudo-gradient is left out (fairscale would divide by 0)."""

  slow_lr: float
  slow_momentum: float

  def init(self, params):
    return _zeros(params)

  def step(self, anchor, average, momentum, learning_rate):
    live = learning_rate > 0
    scale = jnp.where(live, 1.0 / jnp.where(live, learning_rate, 1.0), 0.0)
    momentum = jax.tree.map(lambda m, a, x: self.slow_momentum * m + scale * (a - x),
                            momentum, anchor, average)
    anchor = jax.tree.map(lambda a, m: a - self.slow_lr * learning_rate * m, anchor, momentum)
    return anchor, momentum


@dataclasses.dataclass(frozen=True)
class CO2Outer:
  """The CO2 fork's outer step (co2.py, `_perform_local_optimization`): momentum
  `m <- outer_momentum m + (old - average) / gap_penalty`, clipped elementwise to [-clip, clip]
  (clip 0: none), then `old <- old - outer_lr m`. No learning-rate scaling, unlike SlowMo.
  `gap_penalty` is the released code's staleness-gap penalty, a constant divisor of the
  pseudo-gradient (co2.py's `co2_gap_penalty`, fairseq-CO2's `--co2-gap-penalty`, default 1 in
  both). The fork's `_co2_clip` calls `torch.clamp` on the momentum buffer and discards the
  result, so its clip (off by default there) changes nothing; here it clips, as Sun et al.
  describe and at the LayUp paper's threshold 1.0."""

  slow_lr: float
  slow_momentum: float
  clip: float
  gap_penalty: float = 1.0

  def init(self, params):
    return _zeros(params)

  def step(self, anchor, average, momentum, learning_rate):
    del learning_rate

    def update(m, a, x):
      m = self.slow_momentum * m + (a - x) / self.gap_penalty
      return jnp.clip(m, -self.clip, self.clip) if self.clip else m

    momentum = jax.tree.map(update, momentum, anchor, average)
    anchor = jax.tree.map(lambda a, m: a - self.slow_lr * m, anchor, momentum)
    return anchor, momentum


@dataclasses.dataclass(frozen=True)
class OptaxOuter:
  """An Optax optimizer on the pseudo-gradient `anchor - average` (DiLoCo: Nesterov SGD)."""

  tx: optax.GradientTransformation

  def init(self, params):
    return self.tx.init(params)

  def step(self, anchor, average, state, learning_rate):
    del learning_rate
    pseudo_grad = jax.tree.map(lambda a, x: a - x, anchor, average)
    updates, state = self.tx.update(pseudo_grad, state, anchor)
    return optax.apply_updates(anchor, updates), state
