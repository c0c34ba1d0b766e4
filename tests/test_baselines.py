"""Each baseline's defining property, on CPU fake devices (paper Section 5's comparisons)."""

import itertools
import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from layup_jax.algorithms import collectives
from layup_jax.algorithms.gossip import ADPSGD, GoSGD
from layup_jax.algorithms.outer import CO2Outer, OptaxOuter, SlowMo
from layup_jax.algorithms.periodic import make_exchange, sync_step
from layup_jax.models.staged import StagedModel
from layup_jax.run import runner
from tests.helpers import Hidden, make_layup_runtime, plain_mlp

PEERS = [1, 3, 0, 2, 2, 0, 3, 1]  # scripted peer of each serial iteration


def _leaves(runtime, device):
  return jax.tree.leaves(jax.device_get(runtime.store.stage_params(device)))


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
  # One scripted peer per iteration (`layup.fanout=1`): GoSGD sends the whole model to one.
  staged = make_layup_runtime(4, model=plain_mlp(), exchange=GoSGD, pack_stages=False, fanout=1)
  whole = make_layup_runtime(4, model=StagedModel([_Whole()]), pack_stages=False, fanout=1)
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
  state = runtime.store.stage_state(device)
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
  x0, x1 = (jax.device_get(runtime.store.stage_params(d)) for d in range(2))
  g0 = _gradient(model, runtime, 0, batches[0], x0)
  runtime.iterate_serial(0, peer=1)
  average = jax.tree.map(lambda a, b: (a + b) / 2, x0, x1)
  chex.assert_trees_all_close(jax.device_get(runtime.store.stage_params(0)),
                              jax.tree.map(lambda a, g: a - 0.1 * g, average, g0), atol=1e-6)
  chex.assert_trees_all_close(jax.device_get(runtime.store.stage_params(1)), average, atol=1e-6)


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
  return jax.tree.leaves(jax.device_get(ddp.stats.snapshot().params[0]))


@pytest.mark.parametrize("threaded", [False, True], ids=["serial", "threaded"])
@pytest.mark.parametrize("outer", [None, SlowMo(1.0, 0.0)], ids=["local_sgd", "slowmo"])
def test_periodic_averaging_every_step_equals_ddp(outer, threaded):
  """Local SGD with tau=1, and SlowMo with tau=1, slow lr 1 and slow momentum 0, are DDP: the
  mean of M SGD-with-momentum steps from one model is one step with the mean gradient. It holds
  with the threads too: every device's step of a period starts from the same model, whatever
  order the threads run in."""
  runtime = make_layup_runtime(4, model=plain_mlp(), exchange=make_exchange(
      tau=1, out_freq=1, outer=outer, lag=0, learning_rate=lambda step: 0.05))
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


SHAPES = {"w": (3, 2), "b": (2,)}


def _outer_trajectory(outer, learning_rates, seed=0):
  """The anchors of `sync_step` with an outer step at every boundary, from random models on 2
  devices; returns (initial anchor, per boundary the devices' models, anchors after each)."""
  mesh = collectives.DeviceMesh(jax.devices()[:2])
  rng = np.random.default_rng(seed)
  draw = lambda: {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  anchor = draw()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), anchor)
  step = jax.jit(lambda p, a, o, lr: sync_step(
      p, {}, a, a, a, o, lr, like_params=like, like_state={}, num_devices=2, outer=outer,
      outer_now=True, lagged=False, mix_state=True)[1:3], out_shardings=(mesh.replicated,) * 2)
  current, state = mesh.replicate(anchor), mesh.replicate(outer.init(anchor))
  models, anchors = [], []
  for lr in learning_rates:
    models.append([draw() for _ in range(2)])
    stacked = mesh.stack([jax.device_put(m, d) for m, d in zip(models[-1], mesh.devices)])
    current, state = step(stacked, current, state, jnp.float32(lr))
    anchors.append(jax.device_get(current))
  return anchor, models, anchors


def test_diloco_takes_one_nesterov_step_on_the_pseudo_gradient_per_average():
  """Douillard et al. 2023, Algorithm 1: Delta = theta - mean_i theta_i; OuterOpt = Nesterov."""
  outer = OptaxOuter(optax.sgd(0.7, momentum=0.9, nesterov=True))
  anchor, models, anchors = _outer_trajectory(outer, [1.0] * 3)
  velocity = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
  for boundary, got in zip(models, anchors):
    for k in SHAPES:  # Nesterov in Optax: v <- mu v + g; x <- x - lr (g + mu v)
      grad = anchor[k] - np.mean([m[k] for m in boundary], axis=0)
      velocity[k] = 0.9 * velocity[k] + grad
      anchor[k] = anchor[k] - 0.7 * (grad + 0.9 * velocity[k])
      np.testing.assert_allclose(got[k], anchor[k], rtol=1e-5, atol=1e-6)


def test_slowmo_scales_the_pseudo_gradient_by_one_over_the_current_learning_rate():
  """fairscale's SlowMoDistributedDataParallel: m <- beta m + (old - avg) / lr;
  old <- old - alpha lr m, with lr the base optimizer's at each step: here it decays."""
  learning_rates = [0.1, 0.05, 0.02]
  anchor, models, anchors = _outer_trajectory(SlowMo(0.8, 0.5), learning_rates)
  folded = dict(anchor)  # the form with lr folded into m: equal only for a constant lr
  momentum = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
  folded_momentum = dict(momentum)
  for lr, boundary, got in zip(learning_rates, models, anchors):
    for k in SHAPES:
      average = np.mean([m[k] for m in boundary], axis=0)
      momentum[k] = 0.5 * momentum[k] + (anchor[k] - average) / lr
      anchor[k] = anchor[k] - 0.8 * lr * momentum[k]
      folded_momentum[k] = 0.5 * folded_momentum[k] + (folded[k] - average)
      folded[k] = folded[k] - 0.8 * folded_momentum[k]
      np.testing.assert_allclose(got[k], anchor[k], rtol=1e-5, atol=1e-5)
  assert max(float(np.abs(anchor[k] - folded[k]).max()) for k in SHAPES) > 1e-2


_CO2_LR, _CO2_ALPHA, _CO2_BETA, _CO2_CLIP = 0.1, 0.5, 0.5, 0.02


def _co2_by_hand(**exchange):
  """CO2 on 2 devices, tau = out_freq = 2, plain SGD, each device on its own 2 fixed batches;
  with the reference pieces: `flat` (a replica's stages as one vector), `local_period(start,
  device)` (tau SGD steps from a flat model, by reference) and the initial model, flat."""
  model = plain_mlp((4,))
  batches = [_fixed_batches(8)[2 * d:2 * d + 2] for d in range(2)]  # 2 batches per device
  runtime = make_layup_runtime(2, model=model, tx=optax.sgd(_CO2_LR), train_batches=[
      itertools.cycle(b) for b in batches], exchange=make_exchange(
          tau=2, out_freq=2, lag=1, outer=CO2Outer(_CO2_ALPHA, _CO2_BETA, _CO2_CLIP),
          **exchange))
  tree = jax.device_get(runtime.store.stage_params(0))
  leaves, treedef = jax.tree.flatten(tree)
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  unflat = lambda v: jax.tree.unflatten(treedef, [
      part.reshape(x.shape) for part, x in zip(np.split(v, np.cumsum(
          [x.size for x in leaves])[:-1]), leaves)])
  state = runtime.store.stage_state(0)

  def local_period(start, device):
    params = unflat(start)
    for batch in batches[device]:
      grads = jax.grad(lambda p, b=batch: model.loss(p, state, b.inputs, b.targets,
                                                      jax.random.key(0), 0)[0])(params)
      params = jax.tree.map(lambda p, g: p - _CO2_LR * g, params, grads)
    return flat(params)

  return runtime, flat, local_period, flat(tree)


def _co2_outer_step(anchor, momentum, consensus):
  """CO2's outer step by reference: (new anchor, new momentum, whether the clip acted)."""
  raw = _CO2_BETA * momentum + (anchor - consensus)
  momentum = np.clip(raw, -_CO2_CLIP, _CO2_CLIP)
  return anchor - _CO2_ALPHA * momentum, momentum, bool(np.any(np.abs(raw) > _CO2_CLIP))


@pytest.mark.parametrize("penalty", [1.0, 4.0])
def test_co2_outer_step_divides_the_pseudo_gradient_by_the_gap_penalty(penalty):
  # The released code's staleness-gap penalty (co2.py: m <- beta m + (old - new) / penalty, then
  # the clip and old <- old - alpha m); 1 leaves the outer step as it was.
  anchor, average = np.array([0.01, -0.02, 0.005]), np.zeros(3)  # mostly inside the clip
  momentum = np.array([0.004, -0.002, 0.0])
  outer = CO2Outer(_CO2_ALPHA, _CO2_BETA, _CO2_CLIP, penalty)
  got_anchor, got_momentum = outer.step(anchor, average, momentum, 0.1)
  want_momentum = np.clip(_CO2_BETA * momentum + (anchor - average) / penalty, -_CO2_CLIP,
                          _CO2_CLIP)
  np.testing.assert_allclose(got_momentum, want_momentum, rtol=1e-6)
  np.testing.assert_allclose(got_anchor, anchor - _CO2_ALPHA * want_momentum, rtol=1e-6)


def _run_period(runtime):
  for _ in range(2):
    for d in range(2):
      runtime.iterate_serial(d)


def test_co2_restart_ablation_trajectory_one_period_stale_outer_step():
  """CO2's restart form (`baselines.co2_resume="restart"`, the ablation) on 2 devices, tau =
  out_freq = 2, by hand: at boundary b a device continues from R_{b-1}
  (the all-reduce started at b-1); R_b = A_{b-1} - alpha clip(m_b), m_b = beta m_{b-1} +
  (A_{b-1} - C_b), with C_b = R_{b-1} + mean_i y_b^i - R_{b-2} the consensus of the progress
  of period b (which started from R_{b-2}); clip is elementwise on the outer momentum."""
  queried = []
  runtime, flat, local_period, initial = _co2_by_hand(
      learning_rate=lambda step: queried.append(step) or 1.0)
  results = {-1: initial, 0: initial}  # R_{-1} = R_0 = the initial model
  anchor, momentum, clipped_any = initial, np.zeros_like(initial), False
  for b in range(1, 5):
    start = results[b - 2]  # period b started from R_{b-2}
    ys = [local_period(start, d) for d in range(2)]
    _run_period(runtime)
    consensus = results[b - 1] + np.mean(ys, axis=0) - start
    anchor, momentum, clipped = _co2_outer_step(anchor, momentum, consensus)
    clipped_any |= clipped
    results[b] = anchor
    for d in range(2):  # each device continues from R_{b-1}
      np.testing.assert_allclose(flat(jax.device_get(runtime.store.stage_params(d))),
                                 results[b - 1], atol=2e-6)
  assert clipped_any and not np.allclose(results[3], results[2])
  assert queried == [1, 3, 5, 7]  # the learning rate of each period's last step


def test_co2_trajectory_each_device_corrected_by_the_stale_result():
  """CO2 on 2 devices, tau = out_freq = 2, by hand: period b runs from each device's own model
  c_{b-1}^i to y_b^i while the all-reduce of boundary b-1 runs; at boundary b the device adds
  its correction R_{b-1} - c_{b-1}^i, so c_b^i = y_b^i + R_{b-1} - c_{b-1}^i; the consensus C_b
  = mean_i c_b^i, and R_b = A_{b-1} - alpha clip(m_b), m_b = beta m_{b-1} + (A_{b-1} - C_b),
  clipped elementwise."""
  runtime, flat, local_period, initial = _co2_by_hand(correct_stale=True)
  anchor, momentum, clipped_any = initial, np.zeros_like(initial), False
  models = [initial] * 2  # c_0^i: the initial model
  corrections = [np.zeros_like(initial)] * 2  # R_0 - c_0^i
  for _ in range(1, 5):
    ys = [local_period(models[d], d) for d in range(2)]
    _run_period(runtime)
    models = [ys[d] + corrections[d] for d in range(2)]  # c_b^i
    for d in range(2):
      np.testing.assert_allclose(flat(jax.device_get(runtime.store.stage_params(d))),
                                 models[d], atol=2e-6)
    anchor, momentum, clipped = _co2_outer_step(anchor, momentum, np.mean(models, axis=0))
    clipped_any |= clipped
    corrections = [anchor - models[d] for d in range(2)]  # R_b - c_b^i
  assert clipped_any and not np.allclose(models[0], models[1])


@pytest.mark.parametrize("algorithm", ["gosgd", "adpsgd", "local_sgd", "slowmo", "co2", "diloco"])
def test_every_baseline_trains_the_digits_task(algorithm, tiny_config, tmp_path):
  tiny_config.algorithm, tiny_config.num_devices = algorithm, 4
  tiny_config.model.widths = (8,)
  tiny_config.num_steps, tiny_config.eval_every = 60, 0
  tiny_config.optimizer.learning_rate = 0.2
  tiny_config.baselines.tau, tiny_config.baselines.out_freq = 4, 8
  if algorithm == "diloco":
    tiny_config.optimizer.name, tiny_config.optimizer.learning_rate = "adamw", 1e-2
    tiny_config.baselines.out_freq = 4  # one outer step per average
  summary = runner.run(tiny_config, tmp_path)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  first, last = (r for r in rows
                 if r["split"] == "test" and r["step"] in (0, tiny_config.num_steps))
  assert last["loss"] < 0.9 * first["loss"] and last["accuracy"] > 2 * first["accuracy"], rows
  assert summary["weight_sum_min"] == pytest.approx(1.0, abs=1e-12)
  assert summary["weight_sum_max"] == pytest.approx(1.0, abs=1e-12)



@pytest.mark.parametrize("lag", [0, 1], ids=["local_sgd", "co2_lag"])
@pytest.mark.parametrize("bn_policy", ["mix", "local"])
def test_periodic_baselines_follow_the_bn_policy_at_a_boundary(bn_policy, lag):
  """`layup.bn_policy` for the periodic baselines: "mix" averages the BatchNorm running
  statistics with the parameters at each boundary; "local" keeps each device's own (under
  CO2's lag too, whose first reset is to the initial model: not to its statistics)."""
  runtime = make_layup_runtime(4, exchange=make_exchange(tau=2, out_freq=2, outer=None, lag=lag),
                               bn_policy=bn_policy)
  initial = jax.device_get(runtime.store.stage_state(0))
  for _ in range(2):  # one period: every device reaches boundary 1
    for i in range(4):
      runtime.iterate_serial(i)
  states = [jax.tree.leaves(jax.device_get(runtime.store.stage_state(i))) for i in range(4)]
  params = [_leaves(runtime, i) for i in range(4)]
  for i in range(1, 4):
    for a, b in zip(params[0], params[i]):
      np.testing.assert_array_equal(a, b)  # the models were reset to one result
  differs = [any(not np.allclose(a, b) for a, b in zip(states[0], s)) for s in states[1:]]
  if bn_policy == "mix":
    assert not any(differs)
  else:
    assert all(differs)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(initial), states[0]))


class _Quadratic(nn.Module):
  """One stage whose output is its parameter vector w, for every example of the batch."""

  size: int

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones, (self.size,))
    return jnp.broadcast_to(w, (x.shape[0], self.size))


def _consensus_distances(resume: str | None, periods: int = 10):
  """Two devices, each on its own noise-free quadratic 0.5 sum_k h_k (w_k - o_k)^2 (optima o
  = +-0.5, curvatures h 0.3 / 0.5 / 1), 12 heavy-ball steps per period (lr 0.1, momentum
  0.9), inner momenta kept local: at each boundary, the mean of the two models (`resume`: CO2
  "correct" or "restart"; None: Local SGD), and its distance from the minimum of the mean
  objective (w = 0)."""
  from layup_jax.data.pipeline import Batch

  curvatures = jnp.array([0.3, 0.5, 1.0])
  model = StagedModel([_Quadratic(3)], loss_fn=lambda out, target: 0.5 * jnp.mean(
      jnp.sum(curvatures * (out - target) ** 2, axis=-1)))
  batches = [Batch(np.zeros((2, 1), np.float32), np.full((2, 3), o, np.float32))
             for o in (0.5, -0.5)]
  runtime = make_layup_runtime(2, model=model, tx=optax.sgd(0.1, momentum=0.9),
                               train_batches=[itertools.repeat(b) for b in batches],
                               exchange=make_exchange(tau=12, out_freq=12, outer=None,
                                                      lag=int(resume is not None),
                                                      correct_stale=resume == "correct"))
  means = []
  for _ in range(periods):
    for _ in range(12):
      for d in range(2):
        runtime.iterate_serial(d)
    means.append(np.mean([_leaves(runtime, d)[0] for d in range(2)], axis=0))
  return np.array(means), np.array([np.abs(m).max() for m in means])


def test_co2_corrected_by_the_stale_result_contracts_where_restarting_from_it_grows():
  """The stability claim behind CO2's form: a device that takes the one-period-stale result
  R_{b-1} by *correcting* its own model (x <- x + R_{b-1} - c_{b-1}^i) keeps its own latest
  progress, and on a quadratic the consensus follows synchronous Local SGD's exactly; one
  that *restarts* from R_{b-1} (the earlier form) drops it while its momentum carries on, and
  the consensus moves away from the minimum period after period."""
  local_means, _ = _consensus_distances(None)
  corrected_means, corrected = _consensus_distances("correct")
  _, restarted = _consensus_distances("restart")
  np.testing.assert_allclose(corrected_means, local_means, atol=1e-5)
  growth = lambda d: np.exp(np.mean(np.log(d[4:] / d[3:-1])))  # per period, geometric mean
  assert growth(corrected) < 0.7 and corrected[-1] < 1e-2 * corrected[1], corrected
  assert growth(restarted) > 1.1 and restarted[-1] > restarted[1], restarted
