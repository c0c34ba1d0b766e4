"""Push-sum maths: a merge is a weighted mean, and a send conserves each stage's weight and mass."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layup_jax.pushsum import consensus, mixing


def test_two_replica_merge_matches_hand_computation():
  weights = mixing.PushSumWeights(4, 2)  # every weight 1/4
  sent = weights.halve(0, 1)  # w_{0,1}: 1/4 -> 1/8, 1/8 travels
  share = weights.receiver_share(1, 1, sent)  # w_{1,1} / (w_{1,1} + sent) = (1/4) / (3/8)
  assert share == pytest.approx(2 / 3, abs=1e-15)
  merged = mixing.merge({"w": jnp.array([3.0, 0.0])}, {"w": jnp.array([0.0, 6.0])}, share)
  chex.assert_trees_all_close(merged, {"w": jnp.array([2.0, 2.0])}, atol=1e-6)
  weights.add(1, 1, sent)
  assert weights.values == [[1 / 4, 1 / 8], [1 / 4, 3 / 8], [1 / 4, 1 / 4], [1 / 4, 1 / 4]]
  assert weights.sums() == [1.0, 1.0]


def test_weight_sums_stay_one_over_a_scripted_peer_sequence():
  weights = mixing.PushSumWeights(8, 3)
  rng = np.random.default_rng(0)
  for _ in range(1000):
    i, s = int(rng.integers(8)), int(rng.integers(3))
    j = int(rng.choice([k for k in range(8) if k != i]))
    weights.add(j, s, weights.halve(i, s))
    assert weights.sums() == pytest.approx([1.0] * 3, abs=1e-12)
  assert min(min(row) for row in weights.values) > 0


def test_send_and_merge_conserve_each_stages_weighted_mass():
  # Stages sent one at a time and interleaved between devices (as updater threads do): each
  # stage's mass sum_i w_{i,s} x_{i,s} is kept.
  rng = np.random.default_rng(1)
  replicas = [[{"a": jnp.asarray(rng.normal(size=(3,)), jnp.float32)} for _ in range(2)]
              for _ in range(4)]
  weights = mixing.PushSumWeights(4, 2)

  def mass(s):
    return sum(w[s] * r[s]["a"] for w, r in zip(weights.values, replicas))

  before = [mass(s) for s in range(2)]
  for i, j, s in [(0, 1, 0), (2, 1, 1), (0, 1, 1), (3, 1, 0), (1, 2, 0), (2, 0, 1)]:
    sent = weights.halve(i, s)
    share = weights.receiver_share(j, s, sent)
    replicas[j][s] = mixing.merge(replicas[j][s], replicas[i][s], share)
    weights.add(j, s, sent)
  for s in range(2):
    chex.assert_trees_all_close(mass(s), before[s], atol=1e-6)


def test_consensus_is_the_weighted_mean_of_each_stage_and_distance_is_relative():
  replicas = [[{"a": jnp.array([1.0, 0.0])}, {"b": jnp.array(2.0)}],
              [{"a": jnp.array([3.0, 0.0])}, {"b": jnp.array(6.0)}]]
  center = consensus.consensus(replicas, jnp.array([[0.75, 0.5], [0.25, 0.5]]))
  chex.assert_trees_all_close(center, [{"a": jnp.array([1.5, 0.0])}, {"b": jnp.array(4.0)}])
  # stage 0: ||1 - 1.5||^2 = 0.25, ||3 - 1.5||^2 = 2.25; stage 1: 4 and 4. Means over replicas
  # of the whole model: (0.25 + 4 + 2.25 + 4) / 2 = 5.25, over ||x_bar||^2 = 2.25 + 16.
  distance = consensus.consensus_distance(replicas, center)
  assert float(distance) == pytest.approx(5.25 / 18.25, rel=1e-6)
  same = consensus.consensus_distance([replicas[0]] * 3, replicas[0])
  assert float(same) == 0.0


def test_a_pairwise_average_as_a_correction_keeps_the_sum_and_a_concurrent_step():
  mine, theirs = jnp.array([1.0, 2.0]), jnp.array([3.0, -2.0])
  chex.assert_trees_all_close(mixing.toward_average(mine, mine, theirs), jnp.array([2.0, 0.0]))
  stepped = mine + jnp.array([0.5, 0.5])  # a local step landed after `mine` was read
  left = mixing.toward_average(stepped, mine, theirs)
  right = mixing.toward_average(theirs, theirs, mine)
  chex.assert_trees_all_close(left + right, stepped + theirs)
  chex.assert_trees_all_close(left, jnp.array([2.5, 0.5]))


def test_the_consensus_from_each_process_s_weighted_sums_is_the_consensus_of_every_replica():
  """Across processes only each part's per-stage weighted sums cross (one model's size), then a
  scalar: the consensus and the disagreement formed from them equal those of all replicas."""
  rng = np.random.default_rng(0)
  replicas = [[{"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4)
                .astype(np.float32)} for _ in range(3)] for _ in range(6)]
  weights = rng.uniform(0.1, 1.0, size=(6, 3))
  weights /= weights.sum(axis=0)
  parts = [(0, 2), (2, 5), (5, 6)]  # three processes of 2, 3 and 1 devices
  masses = [consensus.stage_masses(replicas[a:b], weights[a:b]) for a, b in parts]
  center = consensus.consensus_of_masses(masses, weights, replicas[0])
  want = consensus.consensus(replicas, weights)
  for got_stage, want_stage in zip(center, want, strict=True):
    for got, expected in zip(jax.tree.leaves(got_stage), jax.tree.leaves(want_stage)):
      assert got.dtype == np.float32
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  squared = sum(consensus.squared_distances(replicas[a:b], center) for a, b in parts)
  distance = squared / len(replicas) / consensus.squared_norm(center)
  assert distance == pytest.approx(float(consensus.consensus_distance(replicas, want)), rel=1e-5)
