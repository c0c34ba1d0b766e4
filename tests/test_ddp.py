"""DDP over a mesh of M devices: the mean of the devices' gradients in one synchronous step, with
BatchNorm as PyTorch's DDP has it (per-replica statistics, rank 0's buffers) or synchronized."""

import functools

import chex
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from layup_jax import models
from layup_jax.algorithms import ddp
from layup_jax.data import digits
from layup_jax.data.pipeline import Batch
from layup_jax.models.staged import StagedModel
from tests.helpers import DenseBN, FlatDense


def test_ddp_step_with_global_batch_norm_equals_one_device_step_on_the_concatenated_batch(
    tiny_config):
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


def _bn_runtime(batches, batch_norm):
  """DDP on 2 devices of a Dense-BatchNorm-ReLU stage and a linear head, plain SGD 0.1;
  `batches[d]` are device d's batches, in order."""
  model = StagedModel([DenseBN(4), FlatDense(3)])
  params, state = jax.device_get(model.init(jax.random.key(0), batches[0][0].inputs))
  runtime = ddp.DDPRuntime(model, optax.sgd(0.1), jax.devices()[:2],
                           [iter(b) for b in batches], params, state, batches[0][0], seed=0,
                           batch_norm=batch_norm)
  runtime.compile()
  return model, params, state, runtime


def _pre_norm(params, inputs):
  """The BatchNorm layer's input, by hand: x W + b."""
  dense = jax.device_get(params[0]["Dense_0"])
  return inputs.reshape(len(inputs), -1) @ dense["kernel"] + dense["bias"]


def test_ddp_batch_norm_is_pytorch_ddp_per_replica_statistics_and_rank0_buffers():
  rng = np.random.default_rng(0)
  batches = [[Batch(rng.normal(size=(8, 5)).astype(np.float32) + 2.0 * d + step,
                    rng.integers(0, 3, size=8).astype(np.int32)) for step in range(2)]
             for d in range(2)]  # the devices' batches differ in mean: their statistics differ
  model, params, state, runtime = _bn_runtime(batches, "replica")
  runtime.run_until(2, lambda _: None)
  after_one = jax.device_get((runtime.params, runtime.state))

  # Gradient: the mean of each replica's gradient, each normalized with its own batch alone.
  def replica_grad(d):
    batch = batches[d][0]
    return jax.grad(lambda p: model.loss(p, state, batch.inputs, batch.targets,
                                         jax.random.key(0), 0)[0])(params)
  mean_grad = jax.tree.map(lambda a, b: (a + b) / 2, replica_grad(0), replica_grad(1))
  want = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean_grad)
  chex.assert_trees_all_close(after_one[0], jax.device_get(want), atol=1e-6)
  # Running statistics: rank 0's, from device 0's batch only (momentum 0.9, starting at 0).
  mean_0 = _pre_norm(params, batches[0][0].inputs).mean(axis=0)
  np.testing.assert_allclose(after_one[1][0]["batch_stats"]["BatchNorm_0"]["mean"], 0.1 * mean_0, rtol=1e-5)

  runtime.run_until(4, lambda _: None)  # step 2: rank 0's buffers again, updated by its batch
  mean_1 = _pre_norm(after_one[0], batches[0][1].inputs).mean(axis=0)
  np.testing.assert_allclose(jax.device_get(runtime.state)[0]["batch_stats"]["BatchNorm_0"]["mean"],
                             0.9 * 0.1 * mean_0 + 0.1 * mean_1, rtol=1e-5)

  # The synchronized form differs: statistics of the global batch, one gradient over it.
  model, _, _, synced = _bn_runtime(batches, "global")
  synced.run_until(2, lambda _: None)
  both = np.concatenate([batches[0][0].inputs, batches[1][0].inputs])
  np.testing.assert_allclose(jax.device_get(synced.state)[0]["batch_stats"]["BatchNorm_0"]["mean"],
                             0.1 * _pre_norm(params, both).mean(axis=0), rtol=1e-5)
  gap = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), jax.device_get(synced.params),
                     after_one[0])
  assert max(jax.tree.leaves(gap)) > 1e-3
