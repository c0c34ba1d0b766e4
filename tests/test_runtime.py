"""The asynchronous runtime: Algorithm 1's invariants in the serial mode and, as it really runs,
with its threads: no write lost, exact push-sum per stage, no device waiting on another's work."""

import collections
import dataclasses
import gc
import itertools
import os
import threading

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from layup_jax import defaults, optim
from layup_jax.algorithms.gossip import ADPSGD, GoSGD
from layup_jax.algorithms.periodic import make_exchange
from layup_jax.data import EvalSet, digits
from layup_jax.models.staged import StagedModel
from layup_jax.pushsum import consensus, mixing
from layup_jax.run.evaluation import Evaluator
from layup_jax.runtime import scheduler as threads
from layup_jax.runtime import straggler, transfer
from layup_jax.runtime.engine import WorkerError
from layup_jax.runtime.options import RuntimeOptions
from layup_jax.runtime.programs import local_update
from layup_jax.runtime.replicas import ReplicaStore
from tests.helpers import backend_compilations, make_layup_runtime, mlp_model

EXCHANGES = {"layup": None, "gosgd": GoSGD, "adpsgd": ADPSGD}


def _perturb_replicas(runtime, scale=0.5):
  """Gives every replica different parameters, as after some local steps, through the
  runtime's own state_dict and load_state_dict."""
  arrays, meta = runtime.checkpoint.state_dict()
  for i, replica in enumerate(arrays["replicas"]):
    rng = np.random.default_rng(100 + i)
    replica["params"] = [jax.tree.map(lambda p, rng=rng: np.asarray(p) + scale * rng.normal(
        size=p.shape).astype(np.float32), stage) for stage in replica["params"]]
  runtime.checkpoint.load_state_dict(arrays, meta)


def _host_params(runtime):
  return [jax.device_get(list(r.params)) for r in runtime.replicas]


def _average(runtime):
  """The push-sum average, stage by stage: sum_i w_{i,s} x_{i,s} / sum_i w_{i,s}."""
  return consensus.consensus(_host_params(runtime), np.asarray(runtime.store.weights.values))


def _relative_distance(a, b) -> float:
  return float(optax.tree.norm(optax.tree.sub(a, b)) / optax.tree.norm(b))


def test_replicas_are_committed_one_array_per_stage_to_their_devices():
  runtime = make_layup_runtime(4)
  for replica, device in zip(runtime.replicas, jax.devices()[:4]):
    assert len(replica.params) == len(replica.opt_state) == runtime.num_stages == 3
    chex.assert_tree_is_on_device((replica.params, replica.state, replica.opt_state),
                                  device=device)
  assert runtime.store.weights.values == [[0.25] * 3] * 4


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
    chex.assert_trees_all_close(packed.store.stage_params(i), plain.store.stage_params(i), rtol=1e-5,
                                atol=1e-6)
    chex.assert_trees_all_close(packed.store.stage_state(i), plain.store.stage_state(i), rtol=1e-5,
                                atol=1e-6)
  assert packed.store.weights.values == plain.store.weights.values


@pytest.mark.parametrize("push_sum", ["per_stage", "per_model"])
def test_scripted_peer_sequence_moves_the_weights_as_push_sum_and_keeps_their_sums(push_sum):
  runtime = make_layup_runtime(4, push_sum=push_sum, fanout=1)  # one scripted peer a send
  script = [(0, 1), (1, 2), (2, 0), (3, 0), (0, 3), (1, 0), (2, 1), (3, 2)]
  expected = mixing.PushSumWeights(4, 1)  # every stage moves as one weight would
  for device, peer in script:
    runtime.iterate_serial(device, peer)
    expected.add(peer, 0, expected.halve(device, 0))
    assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  assert runtime.store.weights.values == [row * 3 for row in expected.values]


@pytest.mark.parametrize("algorithm", ["layup", "gosgd"])
def test_with_learning_rate_zero_serial_gossip_reaches_consensus_and_keeps_the_average(
    algorithm):
  runtime = make_layup_runtime(8, learning_rate=0.0, exchange=EXCHANGES[algorithm])
  _perturb_replicas(runtime)
  start = _average(runtime)
  assert float(consensus.consensus_distance(_host_params(runtime), start)) > 1e-2
  rng = np.random.default_rng(0)
  for _ in range(60):
    for device in rng.permutation(8):
      runtime.iterate_serial(int(device))
  center = _average(runtime)
  assert float(consensus.consensus_distance(_host_params(runtime), center)) < 1e-6
  assert _relative_distance(center, start) < 1e-6


def test_serial_iterations_keep_no_array_of_earlier_iterations_alive():
  # Every merge is counted until it is seen computed (the congestion check); seen computed, it
  # is dropped. The serial mode never asks for the count, so the store must drop them itself,
  # or every merge a run ever made stays alive on its device.
  runtime = make_layup_runtime(4)

  def live_after(rounds: int) -> int:
    for _ in range(rounds):
      for device in range(4):
        runtime.iterate_serial(device)
    jax.block_until_ready(runtime.store.stage_params(0))
    gc.collect()
    return len(jax.live_arrays())

  first = live_after(5)
  assert live_after(25) <= first + 4 * runtime.num_stages  # 100 iterations later, not 100 more


@pytest.mark.parametrize("algorithm", ["layup", "gosgd"])
def test_threaded_gossip_keeps_the_push_sum_average_of_every_stage(algorithm):
  # Learning rate 0, distinct replicas, 8 devices x 300 iterations with their threads: only
  # gossip moves the replicas, and push-sum must keep each stage's weighted average.
  runtime = make_layup_runtime(8, learning_rate=0.0, exchange=EXCHANGES[algorithm])
  _perturb_replicas(runtime)
  start = _average(runtime)
  spread = float(consensus.consensus_distance(_host_params(runtime), start))
  runtime.compile()
  runtime.run_until(8 * 300, lambda _: None)
  runtime.close()
  assert min(runtime.stats.iterations_per_device()) > 0 and runtime.iterations_done() == 2400
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  center = _average(runtime)
  assert _relative_distance(center, start) < 1e-5
  assert float(consensus.consensus_distance(_host_params(runtime), center)) < 1e-3 * spread


def test_with_two_peers_a_stage_keeps_a_quarter_and_its_average_under_threads():
  # layup.fanout=2 (beyond the paper): each stage goes to two distinct peers per iteration, the
  # first taking half of what the stage holds and the second half of the rest.
  runtime = make_layup_runtime(4, fanout=2)
  w = 0.25  # each device's share of each stage's weight at the start
  runtime.iterate_serial(0, 1)
  weights = np.asarray(runtime.store.weights.values)  # (devices, stages)
  assert weights[0] == pytest.approx([w / 4] * 3) and weights[1] == pytest.approx([1.5 * w] * 3)
  other = [k for k in (2, 3) if weights[k][0] != w]
  assert len(other) == 1 and weights[other[0]] == pytest.approx([1.25 * w] * 3)
  runtime.close()

  runtime = make_layup_runtime(8, learning_rate=0.0, fanout=2)
  _perturb_replicas(runtime)
  start = _average(runtime)
  runtime.compile()
  runtime.run_until(8 * 200, lambda _: None)
  runtime.close()
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  assert _relative_distance(_average(runtime), start) < 1e-5


class _Lineage:
  """Counts writes of a stage that replace a version other than the one they were computed
  from: a write computed from version v, stored after another thread stored v', loses v'.

  Wraps the store's programs that write params (the fused loss and backward updates, with and
  without a received stage mixed in, and the merge) to remember which params each new version
  was computed from, and each replica's params list to check, at every store, that the version
  it replaces is that one."""

  def __init__(self, store):
    self.derived = {}  # id(new params) -> (new params, the params they were computed from)
    self.writes = self.overwritten = 0
    self.calls = collections.Counter()
    self.lock = threading.Lock()

    def traced(name, fn, new_at, old_of):
      def call(*args):
        out = fn(*args)
        new, old = (out if new_at is None else out[new_at]), old_of(args)
        if isinstance(new, tuple):  # a merge of (params, state)
          new, old = new[0], old[0]
        with self.lock:
          self.derived[id(new)] = (new, old)
          self.calls[name] += 1
        return out
      return call

    steps = store.steps
    store.steps = dataclasses.replace(
        steps,
        backward_update=tuple(traced("update", f, 0, lambda a: a[1][0])
                              for f in steps.backward_update),
        backward_update_mix=tuple(traced("update_mix", f, 0, lambda a: a[1][0])
                                  for f in steps.backward_update_mix),
        loss_update=traced("update", steps.loss_update, 2, lambda a: a[0]),
        loss_update_mix=traced("update_mix", steps.loss_update_mix, 2, lambda a: a[0]))
    store.merge_fn = traced("merge", store.merge_fn, None, lambda a: a[0])
    lineage = self

    class CheckedList(list):
      def __setitem__(self, s, value):
        with lineage.lock:
          source = lineage.derived.pop(id(value), (None, None))[1]
          if source is not None:
            lineage.writes += 1
            lineage.overwritten += source is not self[s]
        super().__setitem__(s, value)

    for replica in store.replicas:
      replica.params = CheckedList(replica.params)


def test_threaded_writes_never_overwrite_a_newer_version_of_a_stage():
  runtime = make_layup_runtime(8)
  runtime.compile()  # (runs each program once on stand-ins: not a write)
  lineage = _Lineage(runtime.store)
  runtime.run_until(8 * 300, lambda _: None)
  runtime.close()
  # Every iteration's local update of every stage was checked (with or without a received
  # stage mixed in), and every merge of a received stage that waited for no program.
  calls = lineage.calls
  assert calls["update"] + calls["update_mix"] == 3 * 2400 and calls["update_mix"] > 0
  assert lineage.writes == sum(calls.values())
  assert lineage.overwritten == 0
  # The count does see a write computed from a version that was replaced meanwhile.
  store = runtime.store
  stale = store.replicas[0].params[1]
  store.replicas[0].params[1] = store.merge_fn(stale, jnp.copy(stale), np.float32(0.5))
  store.replicas[0].params[1] = store.merge_fn(stale, jnp.copy(stale), np.float32(0.5))
  assert lineage.overwritten == 1


def test_a_device_does_not_wait_for_a_slow_peer_that_sends_to_it():
  # Device 0's work is held back by a long program on its device; its iteration is dispatched
  # behind it and it sends to device 1 (its only peer). Device 1's own iterations must complete
  # while device 0's program is still running: nothing of device 0's unfinished work may be
  # queued on device 1. The tasks are stepped on this thread (no timing).
  runtime = make_layup_runtime(2)
  runtime.compile()
  slow = straggler.DelayProgram(runtime.store.device(0))
  slow.calibrate()
  held_back = slow(6.0)
  runtime.grant(4)
  steps = 0
  while runtime.iterations_done() < 2:  # device 0 cannot finish: its sends wait for its work
    runtime.step()
    steps += 1
    assert steps < 10**6
  assert runtime.stats.iterations_per_device()[0] >= 1  # device 0 did dispatch an iteration
  jax.block_until_ready(runtime.store.stage_params(1))
  assert not held_back.is_ready(), "device 1 waited for device 0's unfinished program"
  assert runtime.outboxes[0].sent == 0  # device 0's stages were not computed: none left
  jax.block_until_ready(held_back)
  runtime.run_until(4, lambda _: None)  # device 0's iteration and its sends complete
  runtime.close()
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  assert runtime.outboxes[0].sent >= runtime.num_stages  # then they went to device 1


def test_sends_to_a_device_with_a_full_queue_go_to_another_peer():
  # A device admits 32 programs in flight (XLA's CPU client); dispatching onto a full one
  # blocks the sender. Device 1 is held back by a long program; device 0 keeps sending to it:
  # once 8 of its merges are pending there, device 0's stages go to device 2 instead, and
  # device 0 goes on training while device 1's program still runs.
  from layup_jax.runtime import sends as transport

  runtime = make_layup_runtime(3)
  runtime.compile()
  runtime.outboxes[0].reroute_congested = True  # as the threaded runtime sets it
  slow = straggler.DelayProgram(runtime.store.device(1))
  slow.calibrate()
  held_back = slow(6.0)
  for _ in range(15):  # 45 stages for device 1: more than its queue admits
    runtime.iterate_serial(0, 1)
  assert not held_back.is_ready(), "device 0 waited for device 1's queue"
  assert runtime.store.pending_merges(1) == transport.CONGESTED_AT
  weights = runtime.store.weights.values
  assert all(w > 1 / 3 for w in weights[2]) and all(w > 1 / 3 for w in weights[1])
  jax.block_until_ready(held_back)
  runtime.store.settle()
  assert runtime.store.pending_merges(1) == 0
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)


def test_no_device_trains_at_learning_rate_zero_before_the_run_ends():
  # A straggler on 4 devices, scripted: device 0 takes one iteration in 7 and the fast devices
  # the others, so they do most iterations. The schedule is driven by the run's global step
  # (iterations started by all, over the device count), so every update of the run has a
  # learning rate above 0 and the straggler's last updates are at the end of the schedule too.
  config = defaults.get_config().optimizer
  config.schedule, config.learning_rate = "cosine", 0.05
  num_steps = 30
  tx = optim.make_optimizer(config, num_steps)
  runtime = make_layup_runtime(4, tx=tx)
  steps = {i: [] for i in range(4)}

  def recording(update, step_at):  # every stage's update is in its backward or loss program
    def recorded(*args):
      device = next(iter(jax.tree.leaves(args[:2])[0].devices()))
      steps[jax.devices().index(device)].append(args[step_at])
      return update(*args)
    return recorded

  runtime.compile()
  fns = runtime.store.steps
  runtime.store.steps = dataclasses.replace(
      fns, backward_update=tuple(recording(f, 4) for f in fns.backward_update),
      backward_update_mix=tuple(recording(f, 4) for f in fns.backward_update_mix),
      loss_update=recording(fns.loss_update, 7), loss_update_mix=recording(fns.loss_update_mix, 9))
  fast = itertools.cycle([1, 2, 3])
  order = [0 if k % 7 == 6 else next(fast) for k in range(4 * num_steps)]
  for i in order:
    runtime.iterate_serial(i)
  runtime.close()
  schedule = optim.make_schedule(config, num_steps)
  per_device = {i: [int(s) for s in device_steps] for i, device_steps in steps.items()}
  iterations = runtime.stats.iterations_per_device()
  assert iterations == [order.count(i) for i in range(4)]
  # Counted per device, as an Optax count would, the fast devices went past the schedule's end.
  assert max(iterations) > num_steps
  for i, device_steps in per_device.items():
    assert len(device_steps) == 3 * iterations[i]
    assert min(float(schedule(s)) for s in device_steps) > 0, (i, device_steps)
  assert max(max(s) for s in per_device.values()) == num_steps - 1
  # The straggler's last iteration took the global step of its place in the run; its own
  # count would have ended at iterations[0] - 1.
  last = max(k for k, i in enumerate(order) if i == 0)
  assert max(per_device[0]) == last // 4 > iterations[0] - 1


def test_the_step_driven_optimizers_equal_optax_with_its_own_count():
  params = {"w": jnp.arange(4.0), "b": jnp.ones(2)}
  grads = {"w": jnp.array([0.5, -1.0, 2.0, 0.1]), "b": jnp.array([0.3, -0.2])}
  for name in ("sgd", "adam", "adamw"):
    config = defaults.get_config().optimizer
    config.name, config.warmup_steps = name, 2
    ours, schedule = optim.make_optimizer(config, 10), optim.make_schedule(config, 10)
    theirs = {"sgd": optax.chain(optax.add_decayed_weights(config.weight_decay),
                                 optax.sgd(schedule, momentum=config.momentum)),
              "adam": optax.chain(optax.add_decayed_weights(config.weight_decay),
                                  optax.adam(schedule)),
              "adamw": optax.adamw(schedule, weight_decay=config.weight_decay)}[name]
    p_ours, p_theirs = params, params
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for step in range(5):
      u_ours, s_ours = ours.update(grads, s_ours, p_ours, step=jnp.int32(step))
      u_theirs, s_theirs = theirs.update(grads, s_theirs, p_theirs)
      p_ours, p_theirs = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_theirs,
                                                                                  u_theirs)
    chex.assert_trees_all_close(p_ours, p_theirs, rtol=1e-6)


def test_adam_of_the_mean_is_adam_where_the_halves_agree_and_else_takes_off_their_noise():
  grads = [{"w": jnp.array([0.5, -1.0, 2.0, 0.1])}, {"w": jnp.array([0.3, 1.0, 1.0, -0.1])}]
  noises = [{"w": jnp.array([0.1, 0.5, 0.0, 2.0])}, {"w": jnp.array([0.2, 0.1, 0.0, 1.0])}]
  adam = optax.scale_by_adam(0.9, 0.95, 1e-8)
  ours = optim.scale_by_adam_of_mean(0.9, 0.95, 1e-8, mean_of=8)
  s_adam, s_quiet, s_noisy = adam.init(grads[0]), ours.init(grads[0]), ours.init(grads[0])
  zero = {"w": jnp.zeros(4)}
  for g, n in zip(grads, noises):
    u_adam, s_adam = adam.update(g, s_adam)
    u_quiet, s_quiet = ours.update(g, s_quiet, noise=zero)
    u_noisy, s_noisy = ours.update(g, s_noisy, noise=n)
  chex.assert_trees_all_close(u_quiet, u_adam, rtol=1e-6)  # no noise measured: Adam's step
  m, v = s_adam.mu["w"] / (1 - 0.9**2), s_adam.nu["w"] / (1 - 0.95**2)
  s = (0.95 * 0.05 * noises[0]["w"] + 0.05 * noises[1]["w"]) / (1 - 0.95**2)
  d = jnp.maximum(v - 7 / 8 * s, v / 8)
  chex.assert_trees_all_close(u_noisy["w"], m / (jnp.sqrt(d) + 1e-8), rtol=1e-5)
  assert float(jnp.abs(u_noisy["w"][3])) > 2 * float(jnp.abs(u_adam["w"][3]))  # floored: v / 8
  with pytest.raises(ValueError, match="halves"):
    ours.update(grads[0], ours.init(grads[0]))


def test_replicas_adam_of_the_mean_steps_their_average_nearly_as_far_as_ddps_adam():
  # Eight devices' batches: a gradient of mean 0.1 under noise of 1 in every coordinate, each
  # batch's two halves under noise sqrt(2). DDP's Adam steps on the mean of the eight gradients;
  # each replica's Adam on its own, and the replicas' average moves by the mean of their steps:
  # with Adam's own normalization sqrt(0.135 / 1.01) = 0.37 times as far. Normalized by its
  # estimate of the mean's second moment (its halves' noise taken off), short of DDP's by what
  # the estimate's own noise costs (it is an EMA of about 20 steps).
  rng = np.random.default_rng(0)
  zeros = {"w": jnp.zeros(2000)}
  ddp, plain, of_mean = (optax.scale_by_adam(0.9, 0.95, 1e-8),
                         optax.scale_by_adam(0.9, 0.95, 1e-8),
                         optim.scale_by_adam_of_mean(0.9, 0.95, 1e-8, mean_of=8))
  s_ddp, s_plain, s_mean = ddp.init(zeros), [plain.init(zeros)] * 8, [of_mean.init(zeros)] * 8
  moved = {"ddp": 0.0, "plain": 0.0, "of_mean": 0.0}
  for _ in range(200):
    halves = [0.1 + np.sqrt(2) * rng.normal(size=(2, 2000)) for _ in range(8)]
    g = [{"w": jnp.asarray(h.mean(0), jnp.float32)} for h in halves]
    noise = [{"w": jnp.asarray((h[0] - h[1]) ** 2 / 4, jnp.float32)} for h in halves]
    u, s_ddp = ddp.update(jax.tree.map(lambda *x: sum(x) / 8, *g), s_ddp)
    moved["ddp"] += float(jnp.mean(u["w"]))
    for name, tx, states in (("plain", plain, s_plain), ("of_mean", of_mean, s_mean)):
      steps = []
      for i in range(8):
        u, states[i] = tx.update(g[i], states[i], **({"noise": noise[i]} if name == "of_mean"
                                                     else {}))
        steps.append(u["w"])
      moved[name] += float(jnp.mean(sum(steps) / 8))
  assert moved["plain"] / moved["ddp"] < 0.45
  assert 0.75 < moved["of_mean"] / moved["ddp"] < 1.1


@pytest.mark.parametrize("bn_policy", ["mix", "local"])
def test_batchnorm_policy_decides_whether_statistics_travel(bn_policy):
  runtime = make_layup_runtime(2, learning_rate=0.0, bn_policy=bn_policy)
  runtime.iterate_serial(1, None)  # device 1's statistics now differ from device 0's
  receiver_before = jax.device_get(runtime.store.stage_state(0)[0])
  share = runtime.store.weights.receiver_share(0, 0, runtime.store.weights.values[1][0] / 2)
  runtime.iterate_serial(1, 0)
  sender_after = jax.device_get(runtime.store.stage_state(1)[0])
  received = jax.device_get(runtime.store.stage_state(0)[0])
  if bn_policy == "mix":
    want = jax.tree.map(lambda r, s: share * r + (1 - share) * s, receiver_before, sender_after)
  else:
    want = receiver_before
  chex.assert_trees_all_close(received, want, atol=1e-6)
  assert not np.allclose(receiver_before["batch_stats"]["BatchNorm_0"]["mean"],
                         sender_after["batch_stats"]["BatchNorm_0"]["mean"])


@pytest.mark.parametrize("bn_policy, locks_held", [("mix", 2), ("local", 1)])
def test_a_merge_holds_the_lock_of_everything_it_writes(bn_policy, locks_held):
  """A peer's merge is one atomic write of what it changes: the stage's params (and weight)
  lock, and under "mix" its BatchNorm statistics lock too, held while the merge is dispatched."""
  held = set()

  class RecordingLock:
    def __init__(self):
      self._lock = threading.Lock()

    def __enter__(self):
      self._lock.acquire()
      held.add(self)

    def __exit__(self, *exc):
      held.discard(self)
      self._lock.release()

  model = mlp_model()
  params, state = model.init(jax.random.key(0), np.zeros((2, 64), np.float32))
  store = ReplicaStore(model, optax.sgd(0.1), jax.devices()[:2], params, state,
                       RuntimeOptions.of(bn_policy=bn_policy), lock=RecordingLock)
  during_merge = []
  merge_fn = store.merge_fn
  store.merge_fn = lambda *args: (during_merge.append(len(held)), merge_fn(*args))[1]
  part, amount = store.take(0, 0, halve=True)  # stage 0 has BatchNorm statistics
  store.merge(1, 0, transfer.to_device(part, store.device(1)), amount, add_weight=True)
  assert during_merge == [locks_held]
  assert not held


def _test_loss(runtime, evaluator):
  return evaluator.evaluate(runtime.stats.snapshot())["loss"]


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
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)  # no weight is lost
  runtime.close()
  assert not _layup_threads_alive()


def test_precise_bn_recomputes_the_evaluated_models_statistics_from_training_batches():
  # The running averages move over the statistics batches exactly as training moves them
  # (momentum 0.9, K batches): the evaluated statistics become the evaluated weights' on those
  # inputs whatever training left, so a stale statistic no longer decides the accuracy.
  train, test = digits.load_digits(0.2)
  model = mlp_model()
  params, state = model.init(jax.random.key(0), train.inputs[:8])
  batch = train.inputs[:100]
  stale = jax.tree.map(lambda a: a + 3.0, state)
  evaluator = Evaluator(model, EvalSet(test, 360), jax.devices()[0], [batch] * 20)
  fresh = evaluator.recompute_statistics(params, stale)
  layer = params[0]["Dense_0"]
  features = batch.reshape(len(batch), -1) @ layer["kernel"] + layer["bias"]
  stats = fresh[0]["batch_stats"]["BatchNorm_0"]
  kept = 0.9 ** 20
  np.testing.assert_allclose(stats["mean"], kept * (state[0]["batch_stats"]["BatchNorm_0"][
      "mean"] + 3.0) + (1 - kept) * features.mean(axis=0), rtol=1e-4, atol=1e-4)
  assert Evaluator(model, EvalSet(test, 360), jax.devices()[0]).recompute_statistics(
      params, stale) is stale  # without batches, training's statistics


def test_precise_bn_also_reports_the_running_statistics_accuracy_of_the_same_weights():
  # One run gives both measures: the recomputed statistics' and the training-left statistics'
  # (what a run without precise_bn_batches reports), of the same consensus weights.
  runtime = make_layup_runtime(8, learning_rate=0.05)
  train, test = digits.load_digits(0.2)
  runtime.compile()
  runtime.run_until(8 * 5, lambda _: None)
  snapshot = runtime.stats.snapshot()
  model = mlp_model()
  plain = Evaluator(model, EvalSet(test, 360), jax.devices()[0]).evaluate(snapshot)
  precise = Evaluator(model, EvalSet(test, 360), jax.devices()[0],
                      [train.inputs[:100]] * 20).evaluate(snapshot)
  runtime.close()
  assert "running_statistics_accuracy" not in plain
  assert precise["running_statistics_accuracy"] == plain["accuracy"]
  assert precise["running_statistics_loss"] == pytest.approx(plain["loss"], rel=1e-6)
  assert precise["loss"] != pytest.approx(plain["loss"], rel=1e-3)  # recomputed: other statistics
  assert precise["device0_loss"] == pytest.approx(plain["device0_loss"], rel=1e-6)


def test_precise_bn_batches_are_unaugmented_training_samples_of_one_fixed_shuffle():
  from layup_jax.data.pipeline import ArraySplit
  train = ArraySplit(np.arange(50, dtype=np.float32)[:, None], np.zeros(50, np.int32))
  dataset = dataclasses.replace(_empty_dataset(), train_split=train, num_train=50)
  batches = dataset.statistics_inputs(3, 20, seed=1)
  again = dataset.statistics_inputs(3, 20, seed=1)
  assert [len(b) for b in batches] == [20, 20, 20]
  np.testing.assert_array_equal(np.concatenate(batches), np.concatenate(again))
  first_epoch = np.concatenate(batches)[:50, 0]
  assert sorted(first_epoch) == list(range(50))  # every sample once before any twice
  assert not np.array_equal(np.concatenate(dataset.statistics_inputs(3, 20, seed=2)),
                            np.concatenate(batches))
  assert dataset.statistics_inputs(0, 20, seed=1) == []


def _empty_dataset():
  from layup_jax.data import Dataset
  return Dataset(train=[], test=None, example_batch=None, num_train=0, kind="classification")


def _ddp_runtime(num_devices):
  from layup_jax.algorithms.ddp import DDPRuntime
  from layup_jax.data.pipeline import Batch, TrainIterator

  train, _ = digits.load_digits(0.2)
  model = mlp_model()
  params, state = model.init(jax.random.key(0), train.inputs[:8])
  iterators = [TrainIterator(train, num_devices, i, 8, 0) for i in range(num_devices)]
  return DDPRuntime(model, optax.sgd(0.05), jax.devices()[:num_devices], iterators, params,
                    state, Batch(train.inputs[:8], train.targets[:8]), seed=0)


def test_a_local_step_fused_into_the_backward_is_the_updaters_step():
  # The same scripted iterations and peers, with the local step in the backward's program and
  # with the updater applying the gradient: the same replicas and weights.
  runtimes = [make_layup_runtime(3, fuse_local_step=fused) for fused in (True, False)]
  for runtime in runtimes:
    for i, peer in [(0, 1), (1, 2), (2, 0), (0, 2), (1, None), (2, 1)] * 2:
      runtime.iterate_serial(i, peer)
  (fused, unfused) = runtimes
  assert fused.fuses_local_step and not unfused.fuses_local_step
  for i in range(3):
    chex.assert_trees_all_close(fused.store.stage_params(i), unfused.store.stage_params(i),
                                atol=1e-6, rtol=1e-6)
  assert fused.store.weights.values == unfused.store.weights.values
  moved = jax.tree.leaves(fused.store.stage_params(0))[0] - jax.tree.leaves(
      make_layup_runtime(3).store.stage_params(0))[0]
  assert float(jnp.abs(moved).max()) > 1e-4  # the steps did change the params
  for runtime in runtimes:
    runtime.close()


def test_the_forwards_as_one_program_train_exactly_as_stage_by_stage():
  # `tuning.chain_forwards` is a dispatch choice: the same scripted iterations (local steps,
  # sends mixed in by the backwards, BatchNorm statistics) give the same replicas and weights.
  runtimes = [make_layup_runtime(3, chain_forwards=chain) for chain in (True, False)]
  assert runtimes[0].store.steps.forward_chain is not None
  for runtime in runtimes:
    for i, peer in [(0, 1), (1, 2), (2, 0), (0, 2), (1, None), (2, 1)] * 2:
      runtime.iterate_serial(i, peer)
  (chained, by_stage) = runtimes
  for i in range(3):
    chex.assert_trees_all_close(chained.store.stage_params(i), by_stage.store.stage_params(i),
                                atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(chained.store.stage_state(i), by_stage.store.stage_state(i),
                                atol=1e-6, rtol=1e-6)
  assert chained.store.weights.values == by_stage.store.weights.values
  moved = jax.tree.leaves(chained.store.stage_state(0))[0] - jax.tree.leaves(
      make_layup_runtime(3).store.stage_state(0))[0]
  assert float(jnp.abs(moved).max()) > 1e-4  # the chain stored new statistics
  for runtime in runtimes:
    runtime.close()


@pytest.mark.parametrize("algorithm", ["layup", "layup-chained", "adpsgd", "ddp"])
def test_no_compilation_happens_inside_the_training_loop(algorithm):
  # LayUp's local steps are fused into the backward; AD-PSGD's are not (separate updates).
  from layup_jax.algorithms.gossip import ADPSGD

  runtime = {"layup": lambda: make_layup_runtime(4),
             "layup-chained": lambda: make_layup_runtime(4, chain_forwards=True),
             "adpsgd": lambda: make_layup_runtime(4, exchange=ADPSGD),
             "ddp": lambda: _ddp_runtime(4)}[algorithm]()
  runtime.compile()
  with backend_compilations() as compiles:
    runtime.run_until(4 * 10, lambda _: None)
    runtime.close()
    assert compiles == []
    # The listener does see compilations: a function never seen before compiles once.
    jax.jit(lambda x: x * 2.0 + 1.0)(jax.device_put(jnp.ones(7), jax.devices()[0]))
    assert compiles


def _layup_threads_alive() -> list[str]:
  return [t.name for t in threading.enumerate() if t.name.startswith("layup-")]


def test_an_exception_in_an_updater_task_surfaces_with_its_device_and_stage():
  runtime = make_layup_runtime(4)
  runtime.compile()

  def failing_push(*args, **kwargs):  # device 2's sends, in its updater task
    raise FloatingPointError("injected")

  runtime.outboxes[2].send_halved = failing_push
  with pytest.raises(WorkerError, match=r"updater task of device 2 failed at stage \d: "
                                        r"FloatingPointError: injected"):
    runtime.run_until(4 * 50, lambda _: None)
  assert not _layup_threads_alive()


def test_an_exception_in_a_fused_local_update_surfaces_with_its_device_and_stage():
  # Below the loss stage, a stage's local update is in its backward's program, in the compute
  # task: the first in backward order is stage 1 of the 3-stage model.
  runtime = make_layup_runtime(4)
  runtime.compile()
  device_2 = runtime.store.device(2)

  def failing(backward_update):
    def run(vjp, inputs, *args):
      if inputs[0].devices() == {device_2}:
        raise FloatingPointError("injected")
      return backward_update(vjp, inputs, *args)
    return run

  steps = runtime.store.steps
  runtime.store.steps = dataclasses.replace(
      steps, backward_update=tuple(map(failing, steps.backward_update)),
      backward_update_mix=tuple(map(failing, steps.backward_update_mix)))
  with pytest.raises(WorkerError, match=r"compute task of device 2 failed at stage 1: "
                                        r"FloatingPointError: injected"):
    runtime.run_until(4 * 50, lambda _: None)
  assert not _layup_threads_alive()


@pytest.mark.parametrize("algorithm", ["layup", "gosgd"])
def test_the_other_devices_train_on_while_a_straggling_device_is_busy(algorithm):
  # Device 0's device is held back by a long program (a device-side straggler at its worst):
  # the others take 30 iterations, sending to it and receiving from it, before that program
  # ends. Nothing of theirs waits for device 0's work. (AD-PSGD's pairwise average does, by
  # definition: a device paired with the straggler waits for its model, docs/concepts/runtime.md.)
  # The tasks are stepped on this thread: no timing. How much fewer iterations a straggler
  # takes is its clock's (tests/test_straggler.py) and scripts/bench_straggler.py's.
  runtime = make_layup_runtime(4, exchange=EXCHANGES[algorithm])
  runtime.compile()
  slow = straggler.DelayProgram(runtime.store.device(0))
  slow.calibrate()
  held_back = slow(6.0)
  runtime.grant(4 * 20)
  steps = 0
  while runtime.iterations_done() < 30:
    runtime.step()
    steps += 1
    assert steps < 10**6
  assert not held_back.is_ready(), "the others waited for device 0's unfinished program"
  assert runtime.stats.iterations_per_device()[0] <= 2  # dispatched behind the long program
  assert sum(runtime.outboxes[i].sent for i in (1, 2, 3)) >= 30  # they did gossip
  jax.block_until_ready(held_back)
  runtime.run_until(4 * 20, lambda _: None)
  runtime.close()
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)


def test_without_gossip_each_device_trains_alone():
  # layup.gossip=False, the ablation that times communication: no sends, weights untouched,
  # and a device's model is what it would be had the other devices never run.
  together = make_layup_runtime(4, gossip=False)
  alone = make_layup_runtime(4, gossip=False)
  for _ in range(3):
    for i in range(4):
      together.iterate_serial(i)
    alone.iterate_serial(1)
  assert together.store.weights.values == [[0.25] * 3] * 4
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
      _, _, so_far = local_update(tx, params, tx.init(params), grads, jnp.int32(0), so_far)
    positions.append(int(so_far))
  assert positions == [2, -4, 0]


def test_an_updater_keeps_at_most_max_sends_in_flight_merges_not_yet_landed():
  runtime = make_layup_runtime(4, max_sends_in_flight=1)
  runtime.compile()
  runtime.run_until(4 * 20, lambda _: None)
  runtime.close()
  # Every send waited for the previous one to land, and the bound was reached.
  assert max(outbox.peak_in_flight for outbox in runtime.outboxes) == 1
  assert runtime.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)


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
  # On the jax versions the project supports the internal transfer checks out.
  assert transfer.implementation() is not transfer.public
  for to_device in (transfer.implementation(), transfer.public):
    for sent in (tree, tree[:2]):  # mixed host and device arrays; a stage's device arrays
      copied = to_device(sent, target)
      assert all(leaf.devices() == {target} and leaf.committed for leaf in copied)
      assert ([leaf.dtype for leaf in copied]
              == [np.float32, jnp.bfloat16, np.int32, np.int32][:len(sent)])
      chex.assert_trees_all_equal(jax.device_get(copied), jax.device_get(sent))


@pytest.mark.parametrize("periodic", [False, True], ids=["layup", "local_sgd"])
def test_run_until_returns_with_every_iterations_loss_recorded(periodic):
  # A consistent point includes the compute threads' bookkeeping: with two iterations
  # dispatched ahead, the last loss of each device is read before run_until returns (and a
  # device waiting at an averaging boundary reads its losses before it waits).
  exchange = make_exchange(tau=3, out_freq=3, outer=None, lag=0) if periodic else None
  runtime = make_layup_runtime(4, max_dispatch_ahead=2, exchange=exchange)
  runtime.compile()
  for steps in (5, 9):
    runtime.run_until(4 * steps, lambda _: None)
    assert sum(len(losses) for losses in runtime.stats.losses) == 4 * steps
  runtime.close()


def test_a_delay_program_is_dispatched_in_units_of_its_calibrated_time_without_blocking():
  device = jax.devices()[5]
  program = straggler.DelayProgram(device)
  program.calibrate()
  assert program.seconds_per_unit > 0
  done = program(2.0)
  # Asynchronous: the caller goes on while the device works through 2 s of units.
  assert not done.is_ready()
  assert program.units_dispatched == round(2.0 / program.seconds_per_unit)
  jax.block_until_ready(done)
  assert np.isfinite(float(done))
  # (That the units take the device time asked for is what scripts/bench_straggler.py
  # --mode device measures: other devices' rates against the straggler's.)


needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs per-thread CPU affinity and two CPUs")


def _allowed_cpus(thread: threading.Thread) -> set[int]:
  """The CPUs the kernel lets one thread of this process run on (Linux's per-thread affinity)."""
  with open(f"/proc/self/task/{thread.native_id}/status") as f:
    line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
  cpus = set()
  for part in line.split(":")[1].strip().split(","):
    first, _, last = part.partition("-")
    cpus.update(range(int(first), int(last or first) + 1))
  return cpus


def _layup_thread_cpus() -> dict[str, set[int]]:
  return {t.name: _allowed_cpus(t) for t in threading.enumerate() if t.name.startswith("layup-")}


@needs_affinity
@pytest.mark.parametrize("pin", [True, False])
def test_pinned_dispatcher_and_updater_share_one_cpu_and_nothing_else_is_pinned(pin):
  # "auto" on CPU devices (as here) is "off": their work runs on the host's cores too.
  runtime = make_layup_runtime(4, pin_host_threads="on" if pin else "auto")
  runtime.compile()
  runtime.run_until(4 * 3, lambda done: None)
  allowed = os.sched_getaffinity(0)
  cpus = _layup_thread_cpus()
  runtime.close()
  assert set(cpus) == {"layup-dispatcher", "layup-updater"}
  if pin:
    assert cpus["layup-dispatcher"] == cpus["layup-updater"] == threads.shared_core(0)
    assert len(cpus["layup-dispatcher"]) == 1
  else:
    assert cpus["layup-dispatcher"] == cpus["layup-updater"] == allowed
  assert os.sched_getaffinity(0) == allowed  # the calling thread is not pinned


@needs_affinity
def test_a_runtime_with_one_thread_is_not_pinned():
  runtime = make_layup_runtime(4, pin_host_threads="on", updater_thread=False)
  runtime.compile()
  runtime.run_until(4 * 3, lambda done: None)
  cpus = _layup_thread_cpus()
  runtime.close()
  assert cpus == {"layup-dispatcher": os.sched_getaffinity(0)}


@needs_affinity
def test_processes_sharing_a_host_pin_their_threads_to_different_cpus():
  allowed = sorted(os.sched_getaffinity(0))
  chosen = [threads.shared_core(index) for index in range(len(allowed))]
  assert all(len(cpus) == 1 for cpus in chosen)
  assert set().union(*chosen) == set(allowed)
  assert threads.shared_core(len(allowed)) == chosen[0]  # more processes than CPUs: in turn


@pytest.mark.parametrize("mode, two_threads, platform, pinned", [
    ("auto", True, "gpu", True), ("auto", True, "cpu", False), ("on", True, "cpu", True),
    ("on", False, "gpu", False), ("off", True, "gpu", False)])
def test_auto_pins_the_two_threads_only_where_the_devices_are_not_the_hosts_cpus(
    mode, two_threads, platform, pinned):
  # Where the devices are CPUs their work shares the host's cores, and one thread has nothing
  # to share a core with; the other platforms cannot be made here, so the choice is its own.
  assert threads.pins_threads(mode, two_threads, platform) is pinned


class _SimulatedClock:
  """A clock that moves only when told (`advance`), so a scheduler's waits are counted without
  any real time passing."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += seconds


def _idle_scheduler(max_poll_s: float, asleep_s: float):
  """A scheduler on a simulated clock whose one task waits `asleep_s` (simulated) seconds; each
  idle wait advances the clock by its timeout. Returns the scheduler and the timeouts of its
  idle waits, after running it until its task ends."""
  from layup_jax.runtime.scheduler import Scheduler, Sleep

  clock, timeouts = _SimulatedClock(), []

  def idle_wait(timeout):
    timeouts.append(timeout)
    clock.advance(timeout)

  def waits():
    yield Sleep(asleep_s, now=clock)

  scheduler = Scheduler("probe", max_poll_s=max_poll_s, clock=clock, idle_wait=idle_wait)
  scheduler.spawn("waiting", waits())
  scheduler.run(stopped=lambda: len(scheduler) == 0)
  return scheduler, timeouts


def test_a_scheduler_counts_the_time_it_slept_with_nothing_to_run():
  scheduler, timeouts = _idle_scheduler(max_poll_s=1e-3, asleep_s=0.05)
  # Nothing could run for 50 ms: every wait is counted, and only the waits.
  assert scheduler.idle_waits == len(timeouts) > 0
  assert scheduler.idle_s == pytest.approx(sum(timeouts))
  assert sum(timeouts) >= 0.05 > sum(timeouts[:-1])  # it woke as soon as the task could run
  assert scheduler.turn_wait_s == 0.0  # alone on its thread: never waited for the turn


def test_an_idle_scheduler_looks_again_at_most_every_max_poll_s():
  from layup_jax.runtime.scheduler import MAX_POLL_S

  for max_poll_s in (5e-3, MAX_POLL_S):
    _, timeouts = _idle_scheduler(max_poll_s, asleep_s=0.05)
    # From 20 us, doubling after each idle look, up to the cap, then every cap.
    assert timeouts[0] == pytest.approx(20e-6)
    assert all(later == pytest.approx(min(2 * earlier, max_poll_s))
               for earlier, later in zip(timeouts, timeouts[1:]))
    assert max(timeouts) == pytest.approx(max_poll_s)
  # 50 ms with nothing to run: about 9 doublings then 9 looks at a 5 ms cap; hundreds at the
  # 0.1 ms default (each look is host CPU time taken from CPU devices' work).
  assert len(_idle_scheduler(5e-3, 0.05)[1]) <= 20 < len(_idle_scheduler(MAX_POLL_S, 0.05)[1])


@pytest.mark.parametrize("configured, expected", [(-1.0, 1e-3), (2e-4, 2e-4)])
def test_the_idle_poll_is_chosen_by_the_devices_platform_unless_configured(configured, expected):
  runtime = make_layup_runtime(2, idle_poll_s=configured)
  try:
    # CPU devices here: -1 chooses 1 ms (their work shares the host's cores with every look).
    assert runtime.dispatcher.max_poll_s == runtime.updater.max_poll_s == expected
  finally:
    runtime.close()


class _Bias(nn.Module):
  """One stage whose output is a learned bias: under `_bias_loss` its gradient is the same
  constant on every device and at every point, so the average model's path is known exactly."""

  @nn.compact
  def __call__(self, x):
    bias = self.param("bias", nn.initializers.zeros, (4,))
    return jnp.zeros((x.shape[0], 4)) + bias


def _bias_loss(logits, labels):
  return jnp.sum(jnp.mean(logits, axis=0) * jnp.arange(1.0, 5.0))  # gradient [1, 2, 3, 4]


@pytest.mark.parametrize("local_update", ["numerator", "params"])
def test_the_numerator_form_counts_every_devices_gradient_alike_in_the_average(local_update):
  """4 devices, a constant gradient g, plain SGD at learning rate 0.1, random peers: each local
  step moves the push-sum average by lr g / 4 in the numerator form, whatever the device's
  weight (it never fell below a quarter of its share here, the bound), so after 40 steps it
  sits at -40 lr g / 4; in the paper's form each step counts by its device's weight at that
  moment, and the weights spread, so it does not."""
  model = StagedModel([_Bias()], loss_fn=_bias_loss)
  runtime = make_layup_runtime(4, model=model, tx=optax.sgd(0.1), local_update=local_update,
                               max_update_scale=1e9)
  runtime.compile()
  weights_seen = []
  for k in range(40):
    weights_seen.append(runtime.store.weights.values[k % 4][0])
    runtime.iterate_serial(k % 4)
  runtime.close()
  average = np.asarray(_average(runtime)[0]).ravel()  # the stage packed: its bias
  expected = -40 * 0.1 * np.arange(1.0, 5.0) / 4
  assert max(weights_seen) / min(weights_seen) > 2  # the weights did spread
  if local_update == "numerator":
    np.testing.assert_allclose(average, expected, rtol=1e-5)
  else:
    assert np.abs(average - expected).max() > 0.01 * np.abs(expected).max()


def test_the_numerator_forms_scale_is_the_equal_share_over_the_weight_at_most_its_bound():
  weights = mixing.PushSumWeights(4, 1)
  weights.halve(0, 0)
  weights.halve(0, 0)  # w = 1/16: a quarter of its share
  assert weights.update_scale(0, 0, max_scale=8.0) == pytest.approx(4.0)
  assert weights.update_scale(0, 0, max_scale=2.0) == 2.0
  assert weights.update_scale(0, 0, 8.0, arriving=3 / 16) == pytest.approx(1.0)
  weights.equal_share = 1 / 2  # an elastic run with two devices left
  assert weights.update_scale(1, 0, max_scale=8.0) == pytest.approx(2.0)
