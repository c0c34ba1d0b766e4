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


def scale_by_adam_of_mean(b1: float, b2: float, eps: float,
                          mean_of: float) -> optax.GradientTransformation:
  """Adam whose step is normalized by the second moment of the mean of `mean_of` devices'
  gradients rather than of this device's own: `m / (sqrt(m^2 + (v - m^2) / n) + eps)`, with
  `m`, `v` Adam's bias-corrected moments and `n = mean_of` (1: Adam itself).

  Why: DDP's Adam sees the mean of its M devices' gradients, whose noise variance is 1/M of one
  device's; a replica that averages its model with others' (LayUp, the gossip and periodic
  baselines) sees its own gradient, so where noise dominates a coordinate its Adam steps
  sqrt(M) times shorter, and the average of the replicas' steps is that much shorter than DDP's
  step at the same learning rate (with SGD the average step is DDP's). `v - m^2` estimates a
  coordinate's noise variance and `m^2` its squared mean: the step is Adam's where the mean
  dominates and DDP's where the noise does. The state is Adam's (`ScaleByAdamState`)."""
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  if mean_of <= 1:
    return adam

  def update(updates, state, params=None):
    _, state = adam.update(updates, state, params)
    mu_hat = optax.tree.bias_correction(state.mu, b1, state.count)
    nu_hat = optax.tree.bias_correction(state.nu, b2, state.count)

    def step(m, v):
      noise = jnp.maximum(v - m * m, 0.0)
      return (m / (jnp.sqrt(m * m + noise / mean_of) + eps)).astype(m.dtype)

    return jax.tree.map(step, mu_hat, nu_hat), state

  return optax.GradientTransformation(adam.init, update)


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
