"""Chained per-stage VJPs equal `jax.grad` of the composed model, BatchNorm in train mode too."""

import chex
import jax
import numpy as np
import pytest

from layup_jax import models, stages
from layup_jax.data import digits
from tests.helpers import mlp_model


def _digits_batch(size=16):
  train, _ = digits.load_digits(0.2)
  return train.inputs[:size], train.targets[:size]


@pytest.mark.parametrize("remat", sorted(stages.REMAT_POLICIES))
@pytest.mark.parametrize("model_name", ["resnet", "mlp"])
def test_staged_gradients_equal_jax_grad_of_the_composed_model(tiny_config, model_name, remat):
  model = models.make_model(tiny_config.model) if model_name == "resnet" else mlp_model()
  images, labels = _digits_batch()
  params, state = model.init(jax.random.key(0), images)
  key, iteration = jax.random.key(1), np.int32(3)

  loss, grads, new_state = stages.staged_value_and_grad(
      model, stages.make_stage_steps(model, remat=remat), params, state, images, labels, key,
      iteration
  )
  (want_loss, want_state), want_grads = jax.value_and_grad(model.loss, has_aux=True)(
      params, state, images, labels, key, iteration
  )
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
  chex.assert_trees_all_close(grads, want_grads, atol=1e-5, rtol=1e-4)
  chex.assert_trees_all_close(new_state, want_state, atol=1e-5, rtol=1e-4)
  # The train-mode BatchNorm statistics did move, so the state comparison is not vacuous.
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), new_state[0], state[0])
  assert max(jax.tree.leaves(moved)) > 1e-3


def test_one_stage_model_has_no_input_gradient():
  model = stages.StagedModel([mlp_model().modules[-1]])
  images, labels = _digits_batch(8)
  params, state = model.init(jax.random.key(0), images)
  steps = stages.make_stage_steps(model)
  loss, _, grads, dx = steps.loss(params[0], state[0], images, labels, jax.random.key(0), 0)
  assert dx is None and np.isfinite(float(loss))
  want = jax.grad(lambda p: model.loss(p, state, images, labels, jax.random.key(0), 0)[0])(params)
  chex.assert_trees_all_close(grads, want[0], atol=1e-6)


def test_recomputing_elementwise_work_keeps_a_fraction_of_the_residuals(tiny_config):
  # remat="dots" keeps only convolution outputs for the backward (BatchNorm and ReLU are
  # recomputed), and no residual copies the stage's params or input: they are passed again.
  model = models.make_model(tiny_config.model)
  images, _ = _digits_batch()
  params, state = model.init(jax.random.key(0), images)
  kept = {}
  for remat in ("none", "dots"):
    steps, x, total = stages.make_stage_steps(model, remat=remat), images, 0
    for s in range(model.num_stages - 1):
      x, _, vjp = steps.forward[s](params[s], state[s], x, jax.random.key(1), 0)
      total += sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
    kept[remat] = total
  assert kept["dots"] < 0.4 * kept["none"]
