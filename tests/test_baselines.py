"""Each baseline's defining property, on CPU fake devices (paper Section 5's comparisons)."""

import itertools
import json

import chex
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from layup_jax import collectives, runner
from layup_jax.algorithms.gossip import ADPSGD, GoSGD
from layup_jax.algorithms.periodic import make_exchange, sync_step
from layup_jax.stages import StagedModel
from tests.helpers import Hidden, make_layup_runtime, plain_mlp

PEERS = [1, 3, 0, 2, 2, 0, 3, 1]  # scripted peer of each serial iteration


def _leaves(runtime, device):
  return jax.tree.leaves(jax.device_get(runtime.stage_params(device)))


class _Whole(nn.Module):
  """The plain MLP's stages as one stage: same maths, parameters nested one level deeper."""

  @nn.compact
  def __call__(self, x):
    for features in (16, 16):
      x = Hidden(features)(x)
    return nn.Dense(10)(x)


def _as_whole(stages):
  """The staged MLP's per-stage params as the one-stage `_Whole` tree."""
  inner = [stage["Dense_0"] for stage in stages]
  return {"Hidden_0": {"Dense_0": inner[0]}, "Hidden_1": {"Dense_0": inner[1]},
          "Dense_0": inner[2]}


def test_gosgd_equals_layup_with_the_whole_model_as_one_stage():
  # Unpacked stages (`pack_stages=False`), to rearrange the stage pytrees into one.
  staged = make_layup_runtime(4, model=plain_mlp(), exchange=GoSGD, pack_stages=False)
  whole = make_layup_runtime(4, model=StagedModel([_Whole()]), pack_stages=False)
  for a, b in zip(staged.replicas, whole.replicas):  # the same initial values
    b.params[0] = _as_whole(a.params)
    b.opt_state[0] = jax.jit(optax.sgd(0.05, momentum=0.9).init)(b.params[0])
  for step, peer in enumerate(PEERS):
    i = step % 4
    staged.iterate_serial(i, peer if peer != i else (i + 1) % 4)
    whole.iterate_serial(i, peer if peer != i else (i + 1) % 4)
  for device in range(4):
    got = jax.tree.leaves(jax.device_get(_as_whole(staged.replicas[device].params)))
    for x, y in zip(got, _leaves(whole, device)):
      np.testing.assert_allclose(x, y, atol=1e-6)
  # Its three stages travel together, so their push-sum weights move as the one stage's.
  assert staged.store.weights.values == [row * 3 for row in whole.store.weights.values]


def test_adpsgd_keeps_the_sum_of_models_under_learning_rate_zero_while_mixing():
  runtime = make_layup_runtime(8, learning_rate=0.0, exchange=ADPSGD)
  # Distinct models per device, so averaging has something to do.
  for i, replica in enumerate(runtime.replicas):
    replica.params = [jax.tree.map(lambda a, i=i: a * (1.0 + 0.1 * i), p) for p in replica.params]
  total = lambda: [sum(np.asarray(x) for x in leaves) for leaves in
                   zip(*(jax.tree.leaves(jax.device_get(r.params)) for r in runtime.replicas))]
  spread = lambda: float(np.std([np.concatenate([x.ravel() for x in _leaves(runtime, d)])
                                 for d in range(8)], axis=0).max())
  before, spread_before = total(), spread()
  runtime.compile()
  runtime.run_until(8 * 30, lambda _: None)
  runtime.close()
  for x, y in zip(before, total()):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
  assert spread() < 0.2 * spread_before


def _fixed_batches(num_devices):
  """Device d trains on the same batch every iteration: its own 8 digits."""
  from layup_jax.data import digits
  from layup_jax.data.pipeline import Batch

  train, _ = digits.load_digits(0.2)
  return [Batch(train.inputs[8 * d:8 * d + 8], train.targets[8 * d:8 * d + 8])
          for d in range(num_devices)]


def _gradient(model, runtime, device, batch, params):
  """The loss gradient of `params` (a list of stage pytrees) on `batch`: what device computes."""
  state = runtime.stage_state(device)
  return jax.grad(lambda p: model.loss(p, state, batch.inputs, batch.targets,
                                       jax.random.key(0), 0)[0])(params)


def test_adpsgd_averages_with_the_peer_before_applying_its_own_gradient():
  """Lian et al. 2018, Algorithm 1: gradient on the local model, average with the peer, then
  the gradient applied to the average, so none of it reaches the peer."""
  batches, model = _fixed_batches(2), plain_mlp((8,))
  runtime = make_layup_runtime(2, model=model, tx=optax.sgd(0.1), exchange=ADPSGD,
                               train_batches=[itertools.repeat(b) for b in batches])
  runtime.replicas[1].params = [jax.tree.map(lambda a: 1.5 * a, p)
                                for p in runtime.replicas[1].params]
  x0, x1 = (jax.device_get(runtime.stage_params(d)) for d in range(2))
  g0 = _gradient(model, runtime, 0, batches[0], x0)
  runtime.iterate_serial(0, peer=1)
  average = jax.tree.map(lambda a, b: (a + b) / 2, x0, x1)
  chex.assert_trees_all_close(jax.device_get(runtime.stage_params(0)),
                              jax.tree.map(lambda a, g: a - 0.1 * g, average, g0), atol=1e-6)
  chex.assert_trees_all_close(jax.device_get(runtime.stage_params(1)), average, atol=1e-6)


def _ddp_params(model, steps, tx):
  from layup_jax.algorithms.ddp import DDPRuntime
  from layup_jax.data import TrainIterator, digits
  from layup_jax.data.pipeline import Batch

  train, _ = digits.load_digits(0.2)
  params, state = model.init(jax.random.key(0), train.inputs[:8])
  iterators = [TrainIterator(train, 4, i, 8, 0) for i in range(4)]
  ddp = DDPRuntime(model, tx, jax.devices()[:4], iterators, params, state,
                   Batch(train.inputs[:8], train.targets[:8]), seed=0)
  ddp.compile()
  ddp.run_until(4 * steps, lambda _: None)
  return jax.tree.leaves(jax.device_get(ddp.snapshot().params[0]))


@pytest.mark.parametrize("threaded", [False, True], ids=["serial", "threaded"])
@pytest.mark.parametrize("outer_tx", [None, optax.sgd(1.0)], ids=["local_sgd", "slowmo"])
def test_periodic_averaging_every_step_equals_ddp(outer_tx, threaded):
  """Local SGD with tau=1, and SlowMo with tau=1, slow lr 1 and slow momentum 0, are DDP: the
  mean of M SGD-with-momentum steps from one model is one step with the mean gradient. It holds
  with the threads too: every device's step of a period starts from the same model, whatever
  order the threads run in."""
  runtime = make_layup_runtime(4, model=plain_mlp(), exchange=make_exchange(
      tau=1, out_freq=1, outer_tx=outer_tx, lag=0))
  if threaded:
    runtime.compile()
    runtime.run_until(4 * 5, lambda _: None)
    runtime.close()
  else:
    for _ in range(5):
      for i in range(4):
        runtime.iterate_serial(i)
  want = _ddp_params(plain_mlp(), 5, optax.sgd(0.05, momentum=0.9))
  for device in range(4):
    for got, expected in zip(_leaves(runtime, device), want):
      np.testing.assert_allclose(got, expected, atol=2e-6)


def test_diloco_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
  mesh = collectives.DeviceMesh(jax.devices()[:4])
  rng = np.random.default_rng(0)
  shapes = {"w": (3, 2), "b": (2,)}
  anchor = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), anchor)
  step = jax.jit(lambda p, a, o: sync_step(p, {}, a, o, like_params=like, like_state={},
                                           num_devices=4, outer_tx=outer_tx, outer=True)[:2],
                 out_shardings=(mesh.replicated,) * 2)
  state, hand_anchor = mesh.replicate(outer_tx.init(anchor)), dict(anchor)
  velocity = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
  current = mesh.replicate(anchor)
  for _ in range(3):
    models = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
              for _ in range(4)]
    stacked = mesh.stack([jax.device_put(m, d) for m, d in zip(models, mesh.devices)])
    current, state = step(stacked, current, state)
    for k in shapes:  # Nesterov: v <- mu v + g; x <- x - lr (g + mu v)
      grad = hand_anchor[k] - np.mean([m[k] for m in models], axis=0)
      velocity[k] = 0.9 * velocity[k] + grad
      hand_anchor[k] = hand_anchor[k] - 0.7 * (grad + 0.9 * velocity[k])
    for k in shapes:
      np.testing.assert_allclose(np.asarray(current[k]), hand_anchor[k], rtol=1e-5, atol=1e-6)


def test_co2_uses_the_average_of_exactly_one_period_before():
  def periodic(lag):
    return make_layup_runtime(4, model=plain_mlp(), exchange=make_exchange(
        tau=2, out_freq=2, lag=lag,
        outer_tx=optax.chain(optax.clip_by_global_norm(1e9), optax.sgd(1.0))))
  co2, synchronous = periodic(1), periodic(0)
  initial = _leaves(co2, 0)

  def period(runtime):
    for _ in range(2):
      for i in range(4):
        runtime.iterate_serial(i)

  period(co2)
  period(synchronous)
  for device in range(4):  # boundary 1: no average is ready yet, CO2 restarts from the anchor
    for got, want in zip(_leaves(co2, device), initial):
      np.testing.assert_array_equal(got, want)
  average_1 = _leaves(synchronous, 0)  # the boundary-1 average of the same local models
  period(co2)
  for device in range(4):  # boundary 2: the average of boundary 1
    for got, want in zip(_leaves(co2, device), average_1):
      np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["gosgd", "adpsgd", "local_sgd", "slowmo", "co2", "diloco"])
def test_every_baseline_trains_the_digits_task(algorithm, tiny_config, tmp_path):
  tiny_config.algorithm, tiny_config.num_devices = algorithm, 4
  tiny_config.model.widths = (8,)
  tiny_config.num_steps, tiny_config.eval_every = 60, 0
  tiny_config.optimizer.learning_rate = 0.2
  tiny_config.baselines.tau, tiny_config.baselines.out_freq = 4, 8
  if algorithm == "diloco":
    tiny_config.optimizer.name, tiny_config.optimizer.learning_rate = "adamw", 1e-2
  summary = runner.run(tiny_config, tmp_path)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  first, last = (r for r in rows if r["split"] == "test" and r["step"] in (0, 60))
  assert last["loss"] < 0.9 * first["loss"] and last["accuracy"] > 2 * first["accuracy"], rows
  assert summary["weight_sum_min"] == pytest.approx(1.0, abs=1e-12)
  assert summary["weight_sum_max"] == pytest.approx(1.0, abs=1e-12)

