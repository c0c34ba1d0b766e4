"""The paper's models as staged Flax models: counts, gradients, LayUp and DDP steps, tying."""


import chex
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from layup_jax import defaults, models
from layup_jax.algorithms.ddp import DDPRuntime
from layup_jax.algorithms.layup import LayUp
from layup_jax.data.pipeline import Batch
from layup_jax.models import __main__ as summary
from layup_jax.models import staged
from layup_jax.runtime import programs, staged_pass
from layup_jax.runtime.engine import AsyncRuntime
from layup_jax.runtime.options import RuntimeOptions

PUBLISHED = {"resnet18": 11.69e6, "resnet50": 25.56e6, "gpt2": 124e6, "gpt2-medium": 355e6,
             "gpt2-large": 774e6, "gpt2-xl": 1558e6}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name):
  counts = summary.parameter_counts(summary.summary_config(name, "imagenet", 1000))
  assert sum(counts) == pytest.approx(PUBLISHED[name], rel=0.005)


def tiny(name: str, **overrides):
  """A config.model small enough for CPU tests, and a batch generator for it."""
  config = defaults.get_config().model
  config.name = name
  # A stage per block, as before LayUp's default became per layer: the cases that need per-layer
  # stages name it (a ResNet-50 per layer compiles about 50 stage programs per test).
  config.update({"variant": "cifar", "num_classes": 5, "size": "tiny", "vocab_size": 48, "max_len": 16,
                     "hidden_size": 16, "num_layers": 2, "dropout": 0.0, "granularity": "per_block"})
  config.update(overrides)
  return config


def batch_for(config, batch_size: int, seed: int) -> Batch:
  rng = np.random.default_rng(seed)
  if config.name in ("resnet18", "resnet50"):
    size = 64 if config.variant == "imagenet" else 16  # both end at 2x2 before the head
    inputs = rng.normal(size=(batch_size, size, size, 3)).astype(np.float32)
    return Batch(inputs, rng.integers(0, config.num_classes, batch_size).astype(np.int32))
  tokens = rng.integers(0, config.vocab_size, (batch_size, 9)).astype(np.int32)
  if config.name == "gpt2":
    return Batch(tokens[:, :-1], tokens[:, 1:])
  return Batch(tokens[:, :-1], rng.integers(0, config.num_classes, batch_size).astype(np.int32))


MODELS = [
    tiny("resnet18", variant="imagenet", granularity="per_layer"),
    tiny("resnet50"),
    tiny("gpt2", dropout=0.1),
    tiny("gpt2", granularity="per_layer", dropout=0.1),
    tiny("gpt2", dtype="bfloat16"),
    tiny("lstm"),
]
IDS = ["resnet18-imagenet-per_layer", "resnet50", "gpt2-tiny",
       "gpt2-tiny-per_layer", "gpt2-tiny-bf16", "lstm"]


@pytest.mark.parametrize("config", MODELS, ids=IDS)
def test_staged_gradients_equal_jax_grad(config):
  model = models.make_model(config)
  batch = batch_for(config, 4, 0)
  params, state = model.init(jax.random.key(0), batch.inputs)
  key, iteration = jax.random.key(1), np.int32(2)
  loss, grads, _ = staged_pass.staged_value_and_grad(
      model, programs.make_stage_steps(model), params, state, batch.inputs, batch.targets, key,
      iteration)
  (want_loss, _), want = jax.value_and_grad(model.loss, has_aux=True)(
      params, state, batch.inputs, batch.targets, key, iteration)
  tolerance = 2e-2 if config.dtype == "bfloat16" else 1e-4
  assert float(loss) == pytest.approx(float(want_loss), rel=tolerance)
  chex.assert_trees_all_close(grads, want, atol=tolerance, rtol=tolerance)


def _iterators(config, num_devices):
  def endless(device):
    step = 0
    while True:
      yield batch_for(config, 4, 1000 * device + step)
      step += 1
  return [endless(i) for i in range(num_devices)]


@pytest.mark.parametrize("config", [tiny("resnet18"), MODELS[2], MODELS[5]],
                         ids=["resnet18", "gpt2-tiny", "lstm"])
def test_one_layup_and_one_ddp_step_on_two_devices(config):
  """Each kind of the paper's models (a ResNet, a transformer, an LSTM) takes LayUp iterations
  (gossip between two devices; the weights stay exact) and DDP steps. Two devices, not more: each
  device compiles every stage's programs, which is most of this test's time. ResNet-50 differs
  from ResNet-18 only in its blocks, whose staged gradients `test_staged_gradients_equal_jax_grad`
  checks; its steps here took 68 s of CI's time."""
  model = models.make_model(config)
  example = batch_for(config, 4, 0)
  params, state = model.init(jax.random.key(0), example.inputs)
  devices = jax.devices()[:2]
  tx = optax.sgd(0.1)

  layup = AsyncRuntime(model, tx, devices, _iterators(config, 2), params, state, example, LayUp,
                       RuntimeOptions.of())
  layup.compile()
  layup.run_until(4, lambda _: None)
  layup.close()
  assert layup.iterations_done() == 4 and np.isfinite(layup.stats.train_loss())
  assert layup.stats.weight_sums() == pytest.approx([1.0] * model.num_stages, abs=1e-12)
  moved = [not np.allclose(a, b) for a, b in zip(
      jax.tree.leaves(jax.device_get(layup.store.stage_params(0))), jax.tree.leaves(params))]
  assert any(moved)

  ddp = DDPRuntime(model, tx, devices, _iterators(config, 2), params, state, example, seed=0)
  ddp.compile()
  ddp.run_until(4, lambda _: None)
  assert ddp.iterations_done() == 4 and np.isfinite(ddp.stats.train_loss())


def test_tied_embedding_gets_both_stages_gradients_and_stays_one_array():
  config = tiny("gpt2")
  model = models.make_model(config)
  batch = batch_for(config, 4, 0)
  params, state = model.init(jax.random.key(0), batch.inputs)
  key, iteration = jax.random.key(1), np.int32(0)
  wte_shape = (config.vocab_size, 64)

  _, grads, _ = staged_pass.staged_value_and_grad(
      model, programs.make_stage_steps(model), params, state, batch.inputs, batch.targets, key,
      iteration)

  def loss_with(embedding_wte, head_wte):
    """The loss with the two uses of wte given separately."""
    first = [{**params[0], "wte": {"embedding": embedding_wte}}, *params[1:]]
    x = batch.inputs
    for s in range(model.num_stages - 1):
      x, _ = model.apply_stage(s, first[s], state[s], x, staged.stage_rng(key, iteration, s), True)
    logits, _ = model.apply_stage(model.num_stages - 1, params[-1], state[-1], (x, head_wte),
                                  staged.stage_rng(key, iteration, model.num_stages - 1), True)
    return model.loss_fn(logits, batch.targets)

  wte = params[0]["wte"]["embedding"]
  from_embedding, from_head = jax.grad(loss_with, argnums=(0, 1))(wte, wte)
  assert float(np.abs(from_embedding).max()) > 1e-4 and float(np.abs(from_head).max()) > 1e-4
  chex.assert_trees_all_close(grads[0]["wte"]["embedding"], from_embedding + from_head,
                              atol=1e-6, rtol=1e-5)

  # After LayUp iterations each replica holds the matrix once, in stage 0, with stages stored
  # packed (the consumer cuts it out of stage 0's vector) or as pytrees, and both agree.
  runtimes = [AsyncRuntime(model, optax.sgd(0.1), jax.devices()[:2], _iterators(config, 2),
                           params, state, batch, LayUp, RuntimeOptions.of(pack_stages=pack))
              for pack in (True, False)]
  for runtime in runtimes:
    runtime.iterate_serial(0, 1)
    runtime.iterate_serial(1, 0)
    for i in range(2):
      stage_params = runtime.store.stage_params(i)
      shapes = [leaf.shape for stage in stage_params for leaf in jax.tree.leaves(stage)]
      assert shapes.count(wte_shape) == 1
      assert stage_params[0]["wte"]["embedding"].shape == wte_shape
    assert runtime.stats.weight_sums() == pytest.approx([1.0] * model.num_stages, abs=1e-12)
  for i in range(2):
    chex.assert_trees_all_close(runtimes[0].store.stage_params(i), runtimes[1].store.stage_params(i),
                                atol=1e-6, rtol=1e-5)


def test_identical_blocks_share_one_jitted_function():
  model = models.make_model(tiny("gpt2", dropout=0.1))
  steps = programs.make_stage_steps(model)  # embedding, 2 equal blocks, head
  assert steps.forward[1] is steps.forward[2]
  assert steps.forward[0] is not steps.forward[1]
  # Per layer (LayUp's default): embedding, attn, mlp, attn, mlp, head; equal layers share one.
  per_layer = programs.make_stage_steps(
      models.make_model(tiny("gpt2", dropout=0.1, granularity="per_layer")))
  assert per_layer.forward[1] is per_layer.forward[3] and per_layer.forward[2] is per_layer.forward[4]
  assert per_layer.forward[1] is not per_layer.forward[2]
  # Dropout still differs between the two blocks: each stage has its own key.
  keys = [staged.stage_key(jax.random.key(0), s) for s in range(model.num_stages)]
  assert not np.array_equal(jax.random.key_data(keys[1]), jax.random.key_data(keys[2]))


class _NNXBlock(nnx.Module):
  def __init__(self, features_in: int, features: int, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(features_in, features, rngs=rngs)
    self.norm = nnx.BatchNorm(features, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, train: bool):
    x = self.norm(self.dense(x.reshape(x.shape[0], -1)), use_running_average=not train)
    return self.drop(nnx.relu(x), deterministic=not train)


def test_an_nnx_stage_is_a_stage_with_its_batch_statistics_as_state_and_train_passed():
  """`nnx.bridge.to_linen(Class, ...)` as a stage: its Params are the stage's params, its
  BatchStats its state; training mode reaches it (dropout and the statistics' update act only
  then), and its staged gradients are jax.grad's of the composed model."""
  model = staged.StagedModel([nnx.bridge.to_linen(_NNXBlock, 12, 16),
                              nnx.bridge.to_linen(_NNXBlock, 16, 8)])
  x = np.random.default_rng(0).normal(size=(6, 3, 4)).astype(np.float32)
  labels = np.arange(6, dtype=np.int32) % 8
  params, state = model.init(jax.random.key(0), x)
  assert set(params[0]) == {"dense", "norm"} and set(state[0]) == {"batch_stats"}
  key = jax.random.key(1)
  y_eval, after_eval = model.apply(params, state, x, key, np.int32(0), train=False)
  y_train, after_train = model.apply(params, state, x, key, np.int32(0), train=True)
  chex.assert_trees_all_equal(after_eval, state)
  assert not np.allclose(after_train[0]["batch_stats"]["norm"]["mean"],
                         state[0]["batch_stats"]["norm"]["mean"])
  assert float(np.mean(np.asarray(y_train) == 0)) > float(np.mean(np.asarray(y_eval) == 0))
  loss, grads, _ = staged_pass.staged_value_and_grad(
      model, programs.make_stage_steps(model), params, state, x, labels, key, np.int32(2))
  (want_loss, _), want = jax.value_and_grad(model.loss, has_aux=True)(
      params, state, x, labels, key, np.int32(2))
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
  chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)


def test_a_models_own_metrics_are_kept_in_order_and_may_not_take_the_evaluations_names():
  dense = staged.StagedModel([nn.Dense(2)], metrics={"b": len, "a": len})
  assert [name for name, _ in dense.metrics] == ["b", "a"]
  assert staged.group_stages(staged.StagedModel([nn.Dense(2)] * 2, metrics={"m": len}),
                             2).metrics == (("m", len),)
  for taken in ("loss", "accuracy", "device0_loss", "running_statistics_accuracy"):
    with pytest.raises(ValueError, match="taken"):
      staged.StagedModel([nn.Dense(2)], metrics={taken: len})
