"""Push-sum maths: a merge is a weighted mean, and a send conserves weight and mass."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from layup_jax import pushsum


def test_two_replica_merge_matches_hand_computation():
  weights = pushsum.PushSumWeights(4)  # every weight 1/4
  sent = weights.send(0)  # w_0: 1/4 -> 1/8, 1/8 travels
  share = weights.receiver_share(1, sent)  # w_1 / (w_1 + sent) = (1/4) / (3/8) = 2/3
  assert share == pytest.approx(2 / 3, abs=1e-15)
  merged = pushsum.merge({"w": jnp.array([3.0, 0.0])}, {"w": jnp.array([0.0, 6.0])}, share)
  chex.assert_trees_all_close(merged, {"w": jnp.array([2.0, 2.0])}, atol=1e-6)
  weights.receive(1, sent)
  assert weights.values == [1 / 8, 3 / 8, 1 / 4, 1 / 4]


def test_weight_sum_stays_one_over_a_scripted_peer_sequence():
  weights = pushsum.PushSumWeights(8)
  rng = np.random.default_rng(0)
  for _ in range(1000):
    i = int(rng.integers(8))
    j = int(rng.choice([k for k in range(8) if k != i]))
    weights.receive(j, weights.send(i))
    assert weights.total() == pytest.approx(1.0, abs=1e-12)
  assert min(weights.values) > 0


def test_send_and_merge_conserve_the_weighted_mass():
  rng = np.random.default_rng(1)
  replicas = [{"a": jnp.asarray(rng.normal(size=(3,)), jnp.float32)} for _ in range(4)]
  weights = pushsum.PushSumWeights(4)
  mass_before = sum(w * r["a"] for w, r in zip(weights.values, replicas))
  for i, j in [(0, 1), (1, 2), (3, 1), (2, 0)]:
    sent = weights.send(i)
    replicas[j] = pushsum.merge(replicas[j], replicas[i], weights.receiver_share(j, sent))
    weights.receive(j, sent)
  mass_after = sum(w * r["a"] for w, r in zip(weights.values, replicas))
  chex.assert_trees_all_close(mass_after, mass_before, atol=1e-6)


def test_consensus_is_the_weighted_mean_and_distance_is_relative():
  replicas = [{"a": jnp.array([1.0, 0.0])}, {"a": jnp.array([3.0, 0.0])}]
  center = pushsum.consensus(replicas, jnp.array([0.75, 0.25]))
  chex.assert_trees_all_close(center, {"a": jnp.array([1.5, 0.0])})
  # ||1 - 1.5||^2 = 0.25, ||3 - 1.5||^2 = 2.25, mean 1.25, over ||1.5||^2 = 2.25
  distance = pushsum.consensus_distance(replicas, center)
  assert float(distance) == pytest.approx(1.25 / 2.25, rel=1e-6)
  same = pushsum.consensus_distance([replicas[0]] * 3, replicas[0])
  assert float(same) == 0.0
