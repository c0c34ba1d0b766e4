"""Optax optimizers and learning-rate schedules from `config.optimizer`."""

import ml_collections
import optax


def make_schedule(config: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """Linear warm-up from `warmup_init_lr` to `learning_rate`, then constant, cosine or linear decay.

  Under LayUp each device counts its own local steps, so the schedule advances per device.
  """
  peak, warmup = config.learning_rate, config.warmup_steps
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


def make_optimizer(config: ml_collections.ConfigDict,
                   num_steps: int) -> optax.GradientTransformation:
  schedule = make_schedule(config, num_steps)
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
