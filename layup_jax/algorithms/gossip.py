"""Gossip baselines on LayUp's runtime: the same replicas, threads, data and straggler clock.

GoSGD (Blot et al. 2016): after the full backward pass, push-sum gossip of the *whole* model to
one random peer. It is LayUp without layer-wise updates, the ablation that isolates them.

AD-PSGD (Lian et al. 2018): after each local step a device averages its whole model
symmetrically with one random peer; both end with the average. Each device's model has a lock,
held for its local step and, for both devices in a fixed order, for a pairwise average, so two
averages that share a device never interleave and the sum of all models is kept.
"""

import threading
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from layup_jax import transfer
from layup_jax.algorithms.base import init_model, runtime_options
from layup_jax.data import Dataset
from layup_jax.runtime import PICK, LayUpRuntime
from layup_jax.stages import StagedModel


class GoSGDRuntime(LayUpRuntime):
  def _begin_iteration(self, i: int, peer: Any = PICK) -> Any:
    return peer  # the peer is chosen when the whole model is sent

  def _on_stage(self, i, context, s, grads) -> None:
    self._local_step(i, s, grads)

  def _end_iteration(self, i, context, finish, wait) -> None:
    j = self._pick_peer(i) if context is PICK else context
    if j is not None:
      sent = self.weights.send(i)
      share = self.weights.receiver_share(j, sent)
      for s in range(self.num_stages):
        self._send_stage(i, j, s, share)
      self.weights.receive(j, sent)
    finish()


class ADPSGDRuntime(LayUpRuntime):
  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._locks = [threading.Lock() for _ in range(self.num_devices)]

  def _begin_iteration(self, i: int, peer: Any = PICK) -> Any:
    return peer

  def _on_stage(self, i, context, s, grads) -> None:
    with self._locks[i]:
      self._local_step(i, s, grads)

  def _average_pair(self, i: int, j: int) -> None:
    """x_i, x_j <- (x_i + x_j) / 2, computed on device j and copied back to device i."""
    mine, peer = self.replicas[i], self.replicas[j]
    half = jax.device_put(np.float32(0.5), peer.device)
    for s in range(self.num_stages):
      trees = [(mine.params, peer.params)]
      if self.bn_policy == "mix" and self._has_state[s]:
        trees.append((mine.state, peer.state))
      for ours, theirs in trees:
        average = self._merge(theirs[s], transfer.to_device(ours[s], peer.device), half)
        theirs[s] = average
        ours[s] = transfer.to_device(average, mine.device)

  def _end_iteration(self, i, context, finish, wait) -> None:
    j = self._pick_peer(i) if context is PICK else context
    if j is not None:
      first, second = sorted((i, j))
      with self._locks[first], self._locks[second]:
        self._average_pair(i, j)
    finish()


def build(config: ml_collections.ConfigDict, model: StagedModel,
          tx: optax.GradientTransformation, devices: Sequence[jax.Device],
          dataset: Dataset) -> LayUpRuntime:
  runtime_class = {"gosgd": GoSGDRuntime, "adpsgd": ADPSGDRuntime}[config.algorithm]
  params, state = init_model(config, model, dataset.example_batch)
  return runtime_class(
      model, tx, devices, dataset.train, params, state, dataset.example_batch,
      bn_policy=config.layup.bn_policy, gossip=config.layup.gossip,
      latency_every=config.metrics.latency_every,
      max_sends_in_flight=config.layup.max_sends_in_flight, **runtime_options(config),
  )
