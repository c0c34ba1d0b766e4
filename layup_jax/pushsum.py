"""Push-sum maths (Kempe et al. 2003) as used by LayUp: no threads, no devices.

A replica i holds parameters x_i and a host weight w_i (float64, 1/M at start). Sending to a peer j
halves w_i and ships x_i with the halved weight; the peer mixes
`x_j <- (w_j x_j + w_sent x_i) / (w_j + w_sent)` and adds `w_sent` to `w_j` (paper Algorithm 1).
The mass `sum_i w_i x_i` and the weight sum are invariant under a send, so the consensus
`x_bar = sum_i w_i x_i / sum_i w_i` only moves through the local optimizer steps.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

PyTree = object


def merge(receiver: PyTree, sent: PyTree, receiver_share: jax.Array) -> PyTree:
  """`receiver_share * receiver + (1 - receiver_share) * sent`, leaf by leaf, in their dtype."""
  mixed = optax.tree.add_scale(sent, receiver_share, optax.tree.sub(receiver, sent))
  return optax.tree.cast_like(mixed, receiver)


def consensus(replicas: Sequence[PyTree], weights: jax.Array) -> PyTree:
  """The push-sum estimate `sum_i w_i x_i / sum_i w_i` of the average model."""
  weights = weights / jnp.sum(weights)
  total = optax.tree.scale(weights[0], replicas[0])
  for weight, replica in zip(weights[1:], replicas[1:]):
    total = optax.tree.add(total, optax.tree.scale(weight, replica))
  return optax.tree.cast_like(total, replicas[0])


def consensus_distance(replicas: Sequence[PyTree], center: PyTree) -> jax.Array:
  """Mean over replicas of `||x_i - x_bar||^2 / ||x_bar||^2` (the paper's model disagreement)."""
  center_sq = optax.tree.norm(center, squared=True)
  distances = [optax.tree.norm(optax.tree.sub(r, center), squared=True) for r in replicas]
  return jnp.mean(jnp.stack(distances)) / jnp.maximum(center_sq, jnp.finfo(jnp.float32).tiny)


class PushSumWeights:
  """The host-side push-sum weights, one float64 per device.

  `send` halves the sender's weight and returns the halved amount; `receive` adds it to the peer.
  Returning the amount (instead of re-reading w_i when the iteration ends, as Algorithm 1 writes
  it) keeps the weight sum exactly invariant even if w_i grows from other senders meanwhile.
  Updates are plain float stores: concurrent updaters may lose one (the paper's lock-free
  semantics); the sum is logged so that drift is visible.
  """

  def __init__(self, num_devices: int):
    self.values = [1.0 / num_devices] * num_devices

  def send(self, sender: int) -> float:
    sent = self.values[sender] / 2.0
    self.values[sender] -= sent
    return sent

  def receiver_share(self, receiver: int, sent: float) -> float:
    """The receiver's coefficient `w_j / (w_j + w_sent)` in the merge."""
    w_receiver = self.values[receiver]
    return w_receiver / (w_receiver + sent)

  def receive(self, receiver: int, sent: float) -> None:
    self.values[receiver] += sent

  def total(self) -> float:
    return float(sum(self.values))
