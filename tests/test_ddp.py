"""DDP over a mesh of M devices is one synchronous step on the concatenated batch."""

import functools

import chex
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from layup_jax import models
from layup_jax.algorithms import ddp
from layup_jax.data import digits


def test_ddp_step_on_eight_devices_equals_one_device_step_on_the_concatenated_batch(tiny_config):
  model = models.make_model(tiny_config.model)
  train, _ = digits.load_digits(0.2)
  images, labels = train.inputs[:64], train.targets[:64]  # 8 devices x 8 samples
  params, state = model.init(jax.random.key(0), images[:8])
  tx = optax.sgd(0.1, momentum=0.9)
  opt_state = tx.init(params)
  key, iteration = jax.random.key(1), np.int32(0)
  step = functools.partial(ddp.train_step, model, tx)

  one = jax.devices()[0]
  want = jax.jit(step)(*jax.device_put(
      (params, state, opt_state, images, labels, key, iteration), one))

  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  replicated = NamedSharding(mesh, PartitionSpec())
  sharded = NamedSharding(mesh, PartitionSpec("data"))
  args = (*jax.device_put((params, state, opt_state), replicated),
          *jax.device_put((images, labels), sharded), *jax.device_put((key, iteration), replicated))
  got = jax.jit(step, out_shardings=replicated)(*args)

  assert got[0][0]["Conv_0"]["kernel"].sharding.is_fully_replicated
  assert len(got[0][0]["Conv_0"]["kernel"].sharding.device_set) == 8
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), atol=1e-5, rtol=1e-4)
  # The step did something: parameters moved.
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), jax.device_get(got[0]), params)
  assert max(jax.tree.leaves(moved)) > 1e-3
