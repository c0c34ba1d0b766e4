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


def make_optimizer(config: ml_collections.ConfigDict, num_steps: int,
                   steps_per_epoch: int = 0) -> optax.GradientTransformationExtraArgs:
  """SGD with momentum, Adam or AdamW as Optax composes them (`optax.sgd`, `optax.adam`,
  `optax.adamw`), the last scaling driven by the global step; `update` needs `step=`."""
  learning_rate = scale_by_schedule_at_step(make_schedule(config, num_steps, steps_per_epoch))
  if config.name == "sgd":
    momentum = (optax.trace(decay=config.momentum, nesterov=config.nesterov) if config.momentum
                else optax.identity())
    return optax.chain(optax.add_decayed_weights(config.weight_decay), momentum, learning_rate)
  adam = optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)
  if config.name == "adam":
    return optax.chain(optax.add_decayed_weights(config.weight_decay), adam, learning_rate)
  return optax.chain(adam, optax.add_decayed_weights(config.weight_decay), learning_rate)


OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
