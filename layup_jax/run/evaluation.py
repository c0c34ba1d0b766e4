"""Test metrics of the push-sum consensus model, of device 0's own model, and their disagreement."""

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from layup_jax.data import EvalBatch
from layup_jax.models.staged import StagedModel
from layup_jax.pushsum import consensus
from layup_jax.runtime.stats import Snapshot

PyTree = Any


def _consensus_and_distance(params, state, weights, state_weights):
  """The consensus model (stage by stage, `weights[i, s]`), its statistics, the disagreement."""
  center = consensus.consensus(params, weights)
  return (center, consensus.consensus(state, state_weights),
          consensus.consensus_distance(params, center))


class Evaluator:
  """Evaluates snapshots on one device, reading the test set again for each model evaluated
  (a test set need not fit in device memory).

  With `statistics_inputs` (`precise_bn_batches`), the consensus model's BatchNorm statistics
  are recomputed before it is evaluated: a forward pass in training mode over each batch, in
  order, each moving the running averages as training does (the ResNets' momentum 0.9 leaves
  0.9^K of the statistics training left after K batches). Training's running averages follow
  the last ~10 batches of one device (a few hundred samples) at weights that moved since, so
  at a high learning rate the evaluated model's statistics, not its weights, decide much of its
  accuracy (PreciseBN, Wu & Johnson 2021). Device 0's own model keeps its running statistics.
  The consensus is then also evaluated with the statistics training left
  (`running_statistics_loss`, `running_statistics_accuracy`): one run gives both measures of the
  same weights, the recomputed one and the one every run without `precise_bn_batches` reports.
  """

  def __init__(self, model: StagedModel, test: Iterable[EvalBatch], device: jax.Device,
               statistics_inputs: Sequence[np.ndarray] = ()):
    self._device, self._test = device, test
    self._statistics_inputs = [jax.device_put(x, device) for x in statistics_inputs]
    key = jax.device_put(jax.random.key(0), device)
    iteration = jax.device_put(np.int32(0), device)

    def sums(params, state, inputs, targets, mask):
      """Summed loss, accuracy and the model's own metrics over real samples; a sequence's
      are its tokens' means."""
      logits, _ = model.apply(params, state, inputs, key, iteration, train=False)
      log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
      nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
      correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
      per_sample = lambda v: v.reshape(v.shape[0], -1).astype(jnp.float32).mean(axis=1)
      values = [nll, correct] + [fn(logits, targets) for _, fn in model.metrics]
      return jnp.stack([jnp.sum(per_sample(v) * mask) for v in values])

    self._sums = jax.jit(sums)
    self._names = ["loss", "accuracy"] + [name for name, _ in model.metrics]

    def running_statistics(params, state, inputs):
      _, new_state = model.apply(params, state, inputs, key, iteration, train=True)
      return new_state

    self._running_statistics = jax.jit(running_statistics)
    self._consensus = jax.jit(_consensus_and_distance)

  def recompute_statistics(self, params, state):
    """`state` moved over every statistics batch at `params` (unchanged without batches or
    BatchNorm)."""
    if not jax.tree.leaves(state):
      return state
    for inputs in self._statistics_inputs:
      state = self._running_statistics(params, state, inputs)
    return state

  def _means(self, params, state) -> dict[str, float]:
    """Loss, accuracy and the model's own metrics, each its mean over the test set."""
    totals, num_samples = [], 0.0
    for batch in self._test:
      arrays = jax.device_put((batch.inputs, batch.targets, batch.mask), self._device)
      totals.append(self._sums(params, state, *arrays))
      num_samples += float(batch.mask.sum())
    sums = np.sum(np.asarray(jax.device_get(totals)), axis=0)
    return {name: float(total / num_samples) for name, total in zip(self._names, sums)}

  def consensus_model(self, snapshot: Snapshot) -> tuple[PyTree, PyTree]:
    """The model `evaluate` evaluates, per stage on the evaluation's device: the consensus
    params and its statistics (recomputed under `precise_bn_batches`). What
    `layup_jax.export` writes out."""
    center, center_state, _ = self.consensus(snapshot)
    return center, self.recompute_statistics(center, center_state)

  def consensus(self, snapshot: Snapshot) -> tuple[PyTree, PyTree, jax.Array]:
    """The push-sum consensus of the replicas' params and statistics (training's), and the
    params' disagreement with it: `(params, state, distance)`."""
    if snapshot.center is not None:  # reduced across processes (`RunStats.collect`)
      center, center_state = jax.device_put((snapshot.center, snapshot.center_state),
                                            self._device)
      distance = snapshot.consensus_distance
    else:
      params, state = jax.device_put((snapshot.params, snapshot.state), self._device)
      weights, state_weights = jax.device_put(
          (np.asarray(snapshot.weights, np.float32),
           np.asarray(snapshot.state_weights, np.float32)), self._device)
      center, center_state, distance = self._consensus(params, state, weights, state_weights)
    return center, center_state, distance

  def evaluate(self, snapshot: Snapshot) -> dict[str, float]:
    center, center_state, distance = self.consensus(snapshot)
    recomputed = self.recompute_statistics(center, center_state)
    means = self._means(center, recomputed)
    running = {}
    if recomputed is not center_state:  # training's statistics, beside the recomputed ones
      at_running = self._means(center, center_state)
      running = {"running_statistics_loss": at_running["loss"],
                 "running_statistics_accuracy": at_running["accuracy"]}
    params, state = jax.device_put((snapshot.params[0], snapshot.state[0]), self._device)
    device0 = self._means(params, state)
    return {
        **means,
        **running,
        "device0_loss": device0["loss"],
        "device0_accuracy": device0["accuracy"],
        "consensus_distance": float(distance),
    }
