"""The LayUp runtime: Algorithm 1's bookkeeping in the serial mode, its threads' behaviour."""

import gc
import threading
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from layup_jax import pushsum, straggler
from layup_jax.data import EvalSet, digits
from layup_jax.evaluation import Evaluator
from layup_jax import transfer
from layup_jax.algorithms.periodic import PeriodicAveragingRuntime
from layup_jax.runtime import WorkerError, local_update
from tests.helpers import make_layup_runtime, mlp_model


def _perturb_replicas(runtime, scale=0.5):
  """Gives every replica different parameters, as after some local steps."""
  for i, replica in enumerate(runtime.replicas):
    rng = np.random.default_rng(100 + i)
    noise = lambda p, rng=rng, device=replica.device: jax.device_put(
        scale * rng.normal(size=p.shape).astype(np.float32), device)
    replica.params = [jax.tree.map(lambda p, noise=noise: p + noise(p), stage)
                      for stage in replica.params]


def _mass(runtime):
  """sum_i w_i x_i, the quantity a push-sum send conserves."""
  weights = jnp.asarray(runtime.weights.values)
  params = jax.device_put([r.params for r in runtime.replicas], jax.devices()[0])
  return pushsum.consensus(params, weights)


def test_replicas_are_committed_one_pytree_per_stage_to_their_devices():
  runtime = make_layup_runtime(4)
  for replica, device in zip(runtime.replicas, jax.devices()[:4]):
    assert len(replica.params) == len(replica.opt_state) == runtime.num_stages == 3
    chex.assert_tree_is_on_device((replica.params, replica.state, replica.opt_state),
                                  device=device)
  assert runtime.weights.values == [0.25] * 4


def test_packed_stages_train_exactly_as_pytree_stages():
  # One flat vector per stage is a storage format: the same scripted iterations (local steps,
  # sends, merges, BatchNorm statistics) give the same models as per-stage pytrees.
  packed, plain = make_layup_runtime(4), make_layup_runtime(4, pack_stages=False)
  assert all(p.ndim == 1 for r in packed.replicas for p in r.params)
  script = [(0, 1), (1, 2), (2, 0), (3, 0), (0, 3), (1, 0), (2, 1), (3, 2)] * 2
  for device, peer in script:
    assert packed.iterate_serial(device, peer) == pytest.approx(
        plain.iterate_serial(device, peer), rel=1e-6)
  for i in range(4):
    chex.assert_trees_all_close(packed.stage_params(i), plain.stage_params(i), rtol=1e-5,
                                atol=1e-6)
    chex.assert_trees_all_close(packed.stage_state(i), plain.stage_state(i), rtol=1e-5,
                                atol=1e-6)
  assert packed.weights.values == plain.weights.values


def test_scripted_peer_sequence_keeps_the_weight_sum_at_one():
  runtime = make_layup_runtime(4)
  script = [(0, 1), (1, 2), (2, 0), (3, 0), (0, 3), (1, 0), (2, 1), (3, 2)]
  expected = pushsum.PushSumWeights(4)
  for device, peer in script:
    runtime.iterate_serial(device, peer)
    expected.receive(peer, expected.send(device))
    assert runtime.weight_sum() == pytest.approx(1.0, abs=1e-12)
  assert runtime.weights.values == expected.values


def test_with_learning_rate_zero_gossip_alone_reaches_consensus_and_keeps_the_average():
  runtime = make_layup_runtime(8, learning_rate=0.0)
  _perturb_replicas(runtime)
  start = _mass(runtime)
  params = lambda: [r.params for r in runtime.replicas]
  first_distance = float(pushsum.consensus_distance(
      jax.device_put(params(), jax.devices()[0]), start))
  assert first_distance > 1e-2
  rng = np.random.default_rng(0)
  for _ in range(60):
    for device in rng.permutation(8):
      runtime.iterate_serial(int(device), runtime._pick_peer(int(device)))
  center = _mass(runtime)
  distance = pushsum.consensus_distance(jax.device_put(params(), jax.devices()[0]), center)
  assert float(distance) < 1e-6
  chex.assert_trees_all_close(center, start, atol=1e-5)


@pytest.mark.parametrize("bn_policy", ["mix", "local"])
def test_batchnorm_policy_decides_whether_statistics_travel(bn_policy):
  runtime = make_layup_runtime(2, learning_rate=0.0, bn_policy=bn_policy)
  runtime.iterate_serial(1, None)  # device 1's statistics now differ from device 0's
  receiver_before = jax.device_get(runtime.stage_state(0)[0])
  share = runtime.weights.receiver_share(0, runtime.weights.values[1] / 2)
  runtime.iterate_serial(1, 0)
  sender_after = jax.device_get(runtime.stage_state(1)[0])
  received = jax.device_get(runtime.stage_state(0)[0])
  if bn_policy == "mix":
    want = jax.tree.map(lambda r, s: share * r + (1 - share) * s, receiver_before, sender_after)
  else:
    want = receiver_before
  chex.assert_trees_all_close(received, want, atol=1e-6)
  assert not np.allclose(receiver_before["batch_stats"]["BatchNorm_0"]["mean"],
                         sender_after["batch_stats"]["BatchNorm_0"]["mean"])


def _test_loss(runtime, evaluator):
  return evaluator.evaluate(runtime.snapshot())["loss"]


def test_threaded_layup_lowers_the_test_loss_and_stops_cleanly():
  runtime = make_layup_runtime(8, learning_rate=0.05)
  _, test = digits.load_digits(0.2)
  evaluator = Evaluator(mlp_model(), EvalSet(test, 360), jax.devices()[0])
  before = _test_loss(runtime, evaluator)
  runtime.compile()
  progress = []
  runtime.run_until(8 * 40, progress.append)
  after = _test_loss(runtime, evaluator)
  assert runtime.iterations_done() == 320 and progress[-1] == 320
  assert after < 0.5 * before
  # Racing updaters may lose a store on a weight (lock-free, as in the paper): rare and small.
  assert abs(runtime.weight_sum() - 1.0) < 0.05
  runtime.close()
  assert not [t for t in threading.enumerate() if t.name.startswith("layup-")]


def _ddp_runtime(num_devices):
  import optax

  from layup_jax.algorithms.ddp import DDPRuntime
  from layup_jax.data.pipeline import Batch, TrainIterator

  train, _ = digits.load_digits(0.2)
  model = mlp_model()
  params, state = model.init(jax.random.key(0), train.inputs[:8])
  iterators = [TrainIterator(train, num_devices, i, 8, 0) for i in range(num_devices)]
  return DDPRuntime(model, optax.sgd(0.05), jax.devices()[:num_devices], iterators, params,
                    state, Batch(train.inputs[:8], train.targets[:8]), seed=0)


@pytest.mark.parametrize("algorithm", ["layup", "ddp"])
def test_no_compilation_happens_inside_the_training_loop(algorithm):
  compiles = []

  def on_duration(name, *_, **__):
    if "backend_compile" in name:
      compiles.append(name)

  runtime = make_layup_runtime(4) if algorithm == "layup" else _ddp_runtime(4)
  runtime.compile()
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    runtime.run_until(4 * 10, lambda _: None)
    runtime.close()
    assert compiles == []
    # The listener does see compilations: a function never seen before compiles once.
    jax.jit(lambda x: x * 2.0 + 1.0)(jax.device_put(jnp.ones(7), jax.devices()[0]))
    assert compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)


def test_an_exception_in_an_updater_thread_surfaces_with_its_device_and_stage():
  runtime = make_layup_runtime(4)
  runtime.compile()
  update = runtime._update

  def failing_update(*args):
    if threading.current_thread().name == "layup-updater-2":
      raise FloatingPointError("injected")
    return update(*args)

  runtime._update = failing_update
  with pytest.raises(WorkerError, match=r"updater thread of device 2 failed at stage 2: "
                                        r"FloatingPointError: injected"):
    runtime.run_until(4 * 50, lambda _: None)
  assert not [t for t in threading.enumerate() if t.name.startswith("layup-") and t.is_alive()]


@pytest.mark.parametrize("mode", ["host", "device"])
def test_a_straggler_does_fewer_iterations_than_the_others(mode):
  # host: its compute thread idles; device: a delay program keeps its device busy.
  runtime = make_layup_runtime(4, straggler_device=0, straggler_delay_iters=3.0,
                               straggler_mode=mode)
  runtime.compile()
  runtime.run_until(4 * 60, lambda _: None)
  runtime.close()
  iterations = [r.iteration for r in runtime.replicas]
  assert sum(iterations) == 240
  assert iterations[0] < 0.6 * min(iterations[1:])


def test_without_gossip_each_device_trains_alone():
  # layup.gossip=False, the ablation that times communication: no sends, weights untouched,
  # and a device's model is what it would be had the other devices never run.
  together = make_layup_runtime(4, gossip=False)
  alone = make_layup_runtime(4, gossip=False)
  for _ in range(3):
    for i in range(4):
      together.iterate_serial(i)
    alone.iterate_serial(1)
  assert together.weights.values == [0.25] * 4
  chex.assert_trees_all_equal(together.replicas[1].params, alone.replicas[1].params)
  assert not np.allclose(jax.tree.leaves(together.replicas[0].params)[0],
                         jax.tree.leaves(together.replicas[1].params)[0])


def test_one_scalar_per_iteration_names_the_first_non_finite_gradient():
  # The updater chains one int32 through an iteration's updates and the host reads only it:
  # -(n + 1) after n finite gradients, else the position of the first non-finite one.
  tx = optax.sgd(0.1)
  params = jnp.ones(3)
  good, bad = jnp.ones(3), jnp.array([1.0, np.nan, 1.0])
  positions = []
  for iteration in ([good, good, bad, good, bad], [good, good, good], [bad, good]):
    so_far = jnp.int32(-1)
    for grads in iteration:
      _, _, so_far = local_update(tx, params, tx.init(params), grads, so_far)
    positions.append(int(so_far))
  assert positions == [2, -4, 0]


def test_an_updater_keeps_at_most_max_sends_in_flight_merges_not_yet_landed():
  runtime = make_layup_runtime(4, max_sends_in_flight=1)
  runtime.compile()
  send, most = runtime._send_stage, [0]

  def counted_send(i, *args):
    landed = send(i, *args)
    most[0] = max(most[0], len(runtime._sends_in_flight[i]))
    return landed

  runtime._send_stage = counted_send
  runtime.run_until(4 * 20, lambda _: None)
  runtime.close()
  assert most[0] == 1  # every send waited for the previous one to land
  assert runtime.weight_sum() == pytest.approx(1.0, abs=0.05)


def _live_bytes(device) -> int:
  gc.collect()
  return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and a.devices() == {device})


@pytest.mark.parametrize("max_sends_in_flight", [0, 2])
def test_once_updates_have_landed_a_device_holds_its_replica_and_nothing_received(
    max_sends_in_flight):
  # No receive buffers: a received stage lives only until its merge; what a sender keeps to
  # wait on its merges (with a bound) pins no version of a peer's stage.
  devices = jax.devices()[:4]
  before = [_live_bytes(d) for d in devices]
  runtime = make_layup_runtime(4, max_sends_in_flight=max_sends_in_flight)
  runtime.compile()
  runtime.run_until(4 * 30, lambda _: None)
  jax.block_until_ready([(r.params, r.opt_state, r.state) for r in runtime.replicas])
  for i, replica in enumerate(runtime.replicas):
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(
        (replica.params, replica.opt_state, replica.state, replica.stage_keys)))
    smallest_stage = min(sum(leaf.nbytes for leaf in jax.tree.leaves(p)) for p in replica.params)
    extra = _live_bytes(devices[i]) - before[i] - held
    assert extra < smallest_stage, (i, extra, smallest_stage)
  runtime.close()


def test_a_stage_sent_to_a_peer_arrives_as_an_exact_copy_on_that_device():
  # The runtime's transfer (jax's internal one where it checks out, else jax.device_put).
  source, target = jax.devices()[0], jax.devices()[3]
  tree = (jax.device_put(np.arange(5, dtype=np.float32), source),
          jax.device_put(np.ones((2, 3), jnp.bfloat16), source),
          np.arange(4, dtype=np.int32), np.int32(3))
  for to_device in (transfer.implementation(), transfer._public):
    copied = to_device(tree, target)
    assert all(leaf.devices() == {target} for leaf in copied)
    assert [leaf.dtype for leaf in copied] == [np.float32, jnp.bfloat16, np.int32, np.int32]
    chex.assert_trees_all_equal(jax.device_get(copied), jax.device_get(tree))


@pytest.mark.parametrize("runtime_class", [None, PeriodicAveragingRuntime],
                         ids=["layup", "local_sgd"])
def test_run_until_returns_with_every_iterations_loss_recorded(runtime_class):
  # A consistent point includes the compute threads' bookkeeping: with two iterations
  # dispatched ahead, the last loss of each device is read before run_until returns (and a
  # device waiting at an averaging boundary reads its losses before it waits).
  kwargs = {"tau": 3, "out_freq": 3, "outer_tx": None, "lag": 0} if runtime_class else {}
  runtime = make_layup_runtime(4, max_dispatch_ahead=2, runtime_class=runtime_class, **kwargs)
  runtime.compile()
  for steps in (5, 9):
    runtime.run_until(4 * steps, lambda _: None)
    assert sum(len(losses) for losses in runtime._losses) == 4 * steps
  runtime.close()


def test_a_delay_program_keeps_its_device_busy_without_blocking_the_caller():
  device = jax.devices()[5]
  program = straggler.DelayProgram(device)
  program.calibrate()
  start = time.perf_counter()
  done = program(1.0)
  dispatched = time.perf_counter() - start
  assert not done.is_ready() and dispatched < 0.5  # asynchronous: the caller goes on
  independent = jax.device_put(np.ones(3), device) + 1.0  # queued behind it on that device
  jax.block_until_ready(independent)
  assert done.is_ready()  # the device ran its programs in order
  assert time.perf_counter() - start > 0.5  # and the delay was real device time
