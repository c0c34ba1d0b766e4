"""Chained per-stage VJPs equal `jax.grad` of the composed model, BatchNorm in train mode too."""

import functools

import chex
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from layup_jax import models
from layup_jax.data import digits
from layup_jax.models import staged
from layup_jax.runtime import packing, programs, staged_pass
from tests.helpers import DenseBN, FlatDense, mlp_model


def _digits_batch(size=16):
  train, _ = digits.load_digits(0.2)
  return train.inputs[:size], train.targets[:size]


@pytest.mark.parametrize("remat", sorted(programs.REMAT_POLICIES))
@pytest.mark.parametrize("model_name", ["resnet", "mlp"])
def test_staged_gradients_equal_jax_grad_of_the_composed_model(tiny_config, model_name, remat):
  model = models.make_model(tiny_config.model) if model_name == "resnet" else mlp_model()
  images, labels = _digits_batch()
  params, state = model.init(jax.random.key(0), images)
  key, iteration = jax.random.key(1), np.int32(3)

  loss, grads, new_state = staged_pass.staged_value_and_grad(
      model, programs.make_stage_steps(model, remat=remat), params, state, images, labels, key,
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


class _ReadsTied(nn.Module):
  """A middle stage that multiplies by the transpose of stage 0's kernel (a tie inside the
  forwards, as GPT-2's head is at the end)."""

  @nn.compact
  def __call__(self, inputs, train: bool):
    x, kernel = inputs
    return nn.relu(nn.BatchNorm(use_running_average=not train)(x @ kernel.T))


def _tied_mlp() -> staged.StagedModel:
  return staged.StagedModel([DenseBN(16), _ReadsTied(), DenseBN(8), FlatDense(10)],
                            ties=(staged.Tie(0, 1, ("Dense_0", "kernel")),))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("model_name", ["resnet", "tied"])
def test_the_forwards_as_one_program_give_the_stage_by_stage_gradients(tiny_config, model_name,
                                                                       packed):
  model = models.make_model(tiny_config.model) if model_name == "resnet" else _tied_mlp()
  images, labels = _digits_batch()
  params, state = model.init(jax.random.key(0), images)
  if packed:
    packings = [packing.StagePacking.of(p) for p in params]
    layouts = [packing.StagePacking.of(st) if jax.tree.leaves(st) else None for st in state]
    params = [k.pack(p) for k, p in zip(packings, params)]
    state = [k.pack(st) if k else st for k, st in zip(layouts, state)]
  options = {"packings": packings, "state_packings": layouts} if packed else {}
  key, iteration = jax.random.key(1), np.int32(3)
  by_stage, chained = (
      staged_pass.staged_value_and_grad(
          model, programs.make_stage_steps(model, chain_forwards=chain, **options), params, state,
          images, labels, key, iteration)
      for chain in (False, True))
  assert float(chained[0]) == pytest.approx(float(by_stage[0]), rel=1e-6)
  chex.assert_trees_all_close(chained[1:], by_stage[1:], atol=1e-6, rtol=1e-5)
  if not packed:  # and both are the composed model's gradient, the tie's two parts summed
    (_, _), want = jax.value_and_grad(model.loss, has_aux=True)(params, state, images, labels,
                                                                key, iteration)
    chex.assert_trees_all_close(chained[1], want, atol=1e-5, rtol=1e-4)
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), chained[2][0], state[0])
  assert max(jax.tree.leaves(moved)) > 1e-3  # the statistics the chain stored moved


def test_one_stage_model_has_no_input_gradient():
  model = staged.StagedModel([mlp_model().modules[-1]])
  images, labels = _digits_batch(8)
  params, state = model.init(jax.random.key(0), images)
  steps = programs.make_stage_steps(model)
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
    steps, x, total = programs.make_stage_steps(model, remat=remat), images, 0
    for s in range(model.num_stages - 1):
      x, _, vjp = steps.forward[s](params[s], state[s], x, jax.random.key(1), 0)
      total += sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
    kept[remat] = total
  assert kept["dots"] < 0.4 * kept["none"]


def _tiny_gpt2():
  return models.gpt2.gpt2("tiny", vocab_size=32, max_len=8)


def _tokens():
  tokens = np.random.default_rng(0).integers(0, 32, (4, 9)).astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("model_name", ["resnet", "gpt2"])
def test_grouped_stages_compute_the_ungrouped_model(tiny_config, model_name):
  # GPT-2's tied embedding: the head (the tie's consumer) must start a group, and the owner's
  # array moves under its group's `parts_0`.
  if model_name == "gpt2":
    model, (inputs, labels), per_group = _tiny_gpt2(), _tokens(), 2
  else:
    model, (inputs, labels), per_group = models.make_model(tiny_config.model), _digits_batch(), 3
  grouped = staged.group_stages(model, per_group)
  assert grouped.num_stages == -(-model.num_stages // per_group) + (model_name == "gpt2")
  params, state = model.init(jax.random.key(0), inputs)
  members, start = [], 0
  for module in grouped.modules:
    members.append(list(range(start, start + len(module.parts))))
    start += len(module.parts)
  nest = lambda per_stage: [{f"parts_{k}": per_stage[s] for k, s in enumerate(group)}
                            for group in members]
  nest_state = lambda per_stage: [
      {c: {f"parts_{k}": per_stage[s][c] for k, s in enumerate(group) if c in per_stage[s]}
       for c in {c for s in group for c in per_stage[s]}} for group in members]
  key, iteration = jax.random.key(1), np.int32(3)
  loss, grads, _ = staged_pass.staged_value_and_grad(
      grouped, programs.make_stage_steps(grouped), nest(params), nest_state(state), inputs, labels,
      key, iteration)
  (want_loss, _), want = jax.value_and_grad(model.loss, has_aux=True)(
      params, state, inputs, labels, key, iteration)
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
  chex.assert_trees_all_close(grads, nest(want), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_name,packed", [("resnet", False), ("gpt2", True)])
def test_gradients_by_halves_are_each_halfs_own_and_sum_to_the_batchs(tiny_config, model_name,
                                                                      packed):
  # What an Adam that measures its gradient's noise is given (optimizer.adam_mean_of): each half
  # of the batch's own gradient (over 2), GPT-2's tied embedding's two parts included, BatchNorm
  # normalizing each half by its own statistics; without BatchNorm the halves' sum is the
  # batch's gradient.
  if model_name == "gpt2":
    model, (inputs, labels) = _tiny_gpt2(), _tokens()
  else:
    model, (inputs, labels) = models.make_model(tiny_config.model), _digits_batch()
  params, state = model.init(jax.random.key(0), inputs)
  options = {}
  if packed:
    options["packings"] = [packing.StagePacking.of(p) for p in params]
    params = [k.pack(p) for k, p in zip(options["packings"], params)]
  key, iteration, n = jax.random.key(1), np.int32(3), len(inputs) // 2
  grads_of = lambda steps, x, y: staged_pass.staged_value_and_grad(
      model, steps, params, state, x, y, key, iteration)
  plain, by_halves = (programs.make_stage_steps(model, by_halves=h, **options)
                      for h in (False, True))
  loss, grads, new_state = grads_of(by_halves, inputs, labels)
  for half, part in ((0, slice(None, n)), (1, slice(n, None))):
    half_loss, want, _ = grads_of(plain, inputs[part], labels[part])
    chex.assert_trees_all_close(jax.tree.map(lambda g: 2 * g[half], grads), want, atol=1e-6,
                                rtol=1e-5)
  if model_name == "gpt2":  # no statistics: the halves' sum is the batch's gradient
    whole_loss, whole, _ = grads_of(plain, inputs, labels)
    chex.assert_trees_all_close(jax.tree.map(lambda g: g[0] + g[1], grads), whole, atol=1e-6,
                                rtol=1e-5)
    assert float(loss) == pytest.approx(float(whole_loss), rel=1e-6)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_a_fused_backward_and_update_equals_the_backward_then_the_update():
  # Stage 0 owns GPT-2's tied embedding: its update must include the head's part of the gradient.
  model = _tiny_gpt2()
  inputs, labels = _tokens()
  params, state = model.init(jax.random.key(0), inputs)
  tx = optax.adam(0.01)
  steps = programs.make_stage_steps(model, update=functools.partial(programs.local_update, tx))
  key, iteration, step = jax.random.key(1), np.int32(0), np.int32(0)
  keys = [staged.stage_key(key, s) for s in range(model.num_stages)]
  _, grads, _ = staged_pass.staged_value_and_grad(model, steps, params, state, inputs, labels, key,
                                             iteration)
  want = [programs.local_update(tx, p, tx.init(p), g, step)[:2] for p, g in zip(params, grads)]

  class Fused(staged_pass.FixedStages):
    """The loss stage's and every backward's update in their programs, on fixed params."""

    def loss(self, x, labels, key, iteration):
      s = model.num_stages - 1
      value, self.states[s], new, opt, _, dx = steps.loss_update(
          params[s], self.states[s], x, labels, key, iteration, tx.init(params[s]), step,
          np.int32(-1), np.float32(1.0))
      self.updated[s] = (new, opt)
      return value, new, dx

    def backward(self, s, vjp, x, dy, tied_grad):
      new, opt, _, dx = steps.backward_update[s](vjp, (params[s], x), dy, tx.init(params[s]),
                                                step, np.int32(-1), np.float32(1.0), tied_grad)
      self.updated[s] = (new, opt)
      return new, dx

  fused = Fused(steps, params, list(state))
  fused.updated = [None] * model.num_stages
  staged_pass.staged_pass(model, steps, fused, inputs, labels, keys, iteration, lambda s, out: None)
  chex.assert_trees_all_close(fused.updated, want, atol=1e-6, rtol=1e-5)
  tied = ("wte", "embedding")
  moved = np.abs(fused.updated[0][0][tied[0]][tied[1]] - params[0][tied[0]][tied[1]]).max()
  assert moved > 0
