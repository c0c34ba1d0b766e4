"""Optax optimizers and learning-rate schedules from `config.optimizer`.

The learning rate is a function of the run's *global* step, which every update is given as the
extra argument `step` (`replicas.local_update`; DDP's step), not of the optimizer's own count.
Under LayUp each device counts its own iterations: with a straggler the fast devices would run
past the schedule's end and train their last updates at learning rate 0 (cosine and linear
decay end at 0), while the straggler stopped early in its schedule. The global step, the
iterations started by all devices divided by the device count when an update's iteration
began, is what a synchronous run's step would be at that point of the run: every device
follows one schedule in run time, which ends with the run.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax


def warmup_steps(config: ml_collections.ConfigDict, steps_per_epoch: int,
                 num_steps: int = 0) -> int:
  """`warmup_steps`, else `warmup_epochs` of each device's shard, else `warmup_fraction` of the
  run's `num_steps` (a warm-up that scales with the run's length)."""
  return (config.warmup_steps or round(config.warmup_epochs * steps_per_epoch)
          or round(config.get("warmup_fraction", 0.0) * num_steps))


def make_schedule(config: ml_collections.ConfigDict, num_steps: int,
                  steps_per_epoch: int = 0) -> optax.Schedule:
  """Linear warm-up from `warmup_init_lr` to `learning_rate`, then constant, cosine or linear decay.

  Evaluated at the run's global step (module docstring).
  """
  peak, warmup = config.learning_rate, warmup_steps(config, steps_per_epoch, num_steps)
  decay_steps = max(num_steps - warmup, 1)
  main = {
      "constant": optax.constant_schedule(peak),
      "cosine": optax.cosine_decay_schedule(peak, decay_steps),
      "linear": optax.linear_schedule(peak, 0.0, decay_steps),
  }[config.schedule]
  if warmup == 0:
    return main
  ramp = optax.linear_schedule(config.warmup_init_lr, peak, warmup)
  return optax.join_schedules([ramp, main], [warmup])


def scale_by_schedule_at_step(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
  """`-schedule(step) * updates`, with `step` the global step passed to `update`; the
  step-driven form of `optax.scale_by_learning_rate(schedule)`."""

  def update(updates, state, params=None, *, step: jax.Array, **extra_args):
    del params, extra_args
    learning_rate = schedule(step)
    return jax.tree.map(lambda u: (-learning_rate * u).astype(u.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


class ScaleByAdamOfMeanState(NamedTuple):
  """Adam's state and an EMA (Adam's `b2`) of this device's gradient noise per coordinate."""
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  noise: optax.Updates


def scale_by_adam_of_mean(b1: float, b2: float, eps: float,
                          mean_of: float) -> optax.GradientTransformationExtraArgs:
  """Adam whose step is normalized by an estimate of the second moment of the mean of
  `mean_of` devices' gradients rather than of this device's own: `m / (sqrt(d) + eps)` with
  `d = max(v - (1 - 1/n) s, v / n)`, `m`, `v` Adam's bias-corrected moments, `s` the
  bias-corrected EMA of the gradient's noise variance and `n = mean_of` (1: Adam itself).

  Why: DDP's Adam sees the mean of its M devices' gradients, whose noise variance is 1/M of one
  device's; a replica that averages its model with others' (LayUp, the gossip and periodic
  baselines) sees its own gradient, so where noise dominates a coordinate its Adam steps up to
  sqrt(M) times shorter than DDP's at the same learning rate (with SGD the average step is
  DDP's). The noise is measured, not guessed: `update` takes `noise=`, `(g_a - g_b)^2 / 4` per
  coordinate from the gradients `g_a`, `g_b` of the two halves of the batch, an unbiased
  estimate of the batch gradient's variance (runtime/programs.py `halves_sum_and_noise`).
  `v - m^2` is no such estimate: early in training most of it is the movement every replica
  shares (docs/records/language_model.md). The floor `v / n` keeps the step at most sqrt(n)
  times Adam's own where the estimate overshoots."""
  if mean_of <= 1:
    return optax.with_extra_args_support(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))

  def init(params):
    zeros = lambda: optax.tree.zeros_like(params)
    return ScaleByAdamOfMeanState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros())

  def update(updates, state, params=None, *, noise=None, **extra_args):
    del params, extra_args
    if noise is None:
      raise ValueError("optimizer.adam_mean_of > 1 needs the noise of each gradient, measured "
                       "from its batch's halves; this update was given none")
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    ema = optax.tree.update_moment(noise, state.noise, b2, 1)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    noise_hat = optax.tree.bias_correction(ema, b2, count)

    def step(m, v, s):
      d = jnp.maximum(v - (1 - 1 / mean_of) * s, v / mean_of)
      return (m / (jnp.sqrt(d) + eps)).astype(m.dtype)

    return (jax.tree.map(step, mu_hat, nu_hat, noise_hat),
            ScaleByAdamOfMeanState(count, mu, nu, ema))

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(config: ml_collections.ConfigDict, num_steps: int,
                   steps_per_epoch: int = 0) -> optax.GradientTransformationExtraArgs:
  """SGD with momentum, Adam or AdamW as Optax composes them (`optax.sgd`, `optax.adam`,
  `optax.adamw`), the last scaling driven by the global step; `update` needs `step=`."""
  learning_rate = scale_by_schedule_at_step(make_schedule(config, num_steps, steps_per_epoch))
  if config.name == "sgd":
    momentum = (optax.trace(decay=config.momentum, nesterov=config.nesterov) if config.momentum
                else optax.identity())
    return optax.chain(optax.add_decayed_weights(config.weight_decay), momentum, learning_rate)
  adam = scale_by_adam_of_mean(config.b1, config.b2, config.eps, config.get("adam_mean_of", 1))
  if config.name == "adam":
    return optax.chain(optax.add_decayed_weights(config.weight_decay), adam, learning_rate)
  return optax.chain(adam, optax.add_decayed_weights(config.weight_decay), learning_rate)


OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
