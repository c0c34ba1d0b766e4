"""Optax optimizers and learning-rate schedules from `config.optimizer`."""

import ml_collections
import optax


def warmup_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
  """`warmup_steps`, or `warmup_epochs` of each device's shard when `warmup_steps` is 0."""
  return config.warmup_steps or round(config.warmup_epochs * steps_per_epoch)


def make_schedule(config: ml_collections.ConfigDict, num_steps: int,
                  steps_per_epoch: int = 0) -> optax.Schedule:
  """Linear warm-up from `warmup_init_lr` to `learning_rate`, then constant, cosine or linear decay.

  Under LayUp each device counts its own local steps, so the schedule advances per device.
  """
  peak, warmup = config.learning_rate, warmup_steps(config, steps_per_epoch)
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


def make_optimizer(config: ml_collections.ConfigDict, num_steps: int,
                   steps_per_epoch: int = 0) -> optax.GradientTransformation:
  schedule = make_schedule(config, num_steps, steps_per_epoch)
  if config.name == "sgd":
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay),
        optax.sgd(schedule, momentum=config.momentum or None, nesterov=config.nesterov),
    )
  if config.name == "adam":
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay),
        optax.adam(schedule, b1=config.b1, b2=config.b2, eps=config.eps),
    )
  return optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                     weight_decay=config.weight_decay)


OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
