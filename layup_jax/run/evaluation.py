"""Test metrics of the push-sum consensus model, of device 0's own model, and their disagreement."""

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from layup_jax.data import EvalBatch
from layup_jax.models.staged import StagedModel
from layup_jax.pushsum import consensus
from layup_jax.runtime.stats import Snapshot


def _consensus_and_distance(params, state, weights, state_weights):
  """The consensus model (stage by stage, `weights[i, s]`), its statistics, the disagreement."""
  center = consensus.consensus(params, weights)
  return center, consensus.consensus(state, state_weights), consensus.consensus_distance(params, center)


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
      """Summed loss and accuracy over real samples; a sequence's are its tokens' means."""
      logits, _ = model.apply(params, state, inputs, key, iteration, train=False)
      log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
      nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
      correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
      per_sample = lambda v: v.reshape(v.shape[0], -1).mean(axis=1)
      return jnp.sum(per_sample(nll) * mask), jnp.sum(per_sample(correct) * mask)

    self._sums = jax.jit(sums)

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

  def _loss_and_accuracy(self, params, state) -> tuple[float, float]:
    totals, num_samples = [], 0.0
    for batch in self._test:
      arrays = jax.device_put((batch.inputs, batch.targets, batch.mask), self._device)
      totals.append(self._sums(params, state, *arrays))
      num_samples += float(batch.mask.sum())
    loss, correct = np.sum(np.asarray(jax.device_get(totals)), axis=0)
    return float(loss / num_samples), float(correct / num_samples)

  def evaluate(self, snapshot: Snapshot) -> dict[str, float]:
    params, state = jax.device_put((snapshot.params, snapshot.state), self._device)
    if snapshot.center is not None:  # reduced across processes (`RunStats.collect`)
      center, center_state = jax.device_put((snapshot.center, snapshot.center_state),
                                            self._device)
      distance = snapshot.consensus_distance
    else:
      weights, state_weights = jax.device_put(
          (np.asarray(snapshot.weights, np.float32),
           np.asarray(snapshot.state_weights, np.float32)), self._device)
      center, center_state, distance = self._consensus(params, state, weights, state_weights)
    recomputed = self.recompute_statistics(center, center_state)
    loss, accuracy = self._loss_and_accuracy(center, recomputed)
    running = {}
    if recomputed is not center_state:  # training's statistics, beside the recomputed ones
      running_loss, running_accuracy = self._loss_and_accuracy(center, center_state)
      running = {"running_statistics_loss": running_loss,
                 "running_statistics_accuracy": running_accuracy}
    device0_loss, device0_accuracy = self._loss_and_accuracy(params[0], state[0])
    return {
        "loss": loss,
        "accuracy": accuracy,
        **running,
        "device0_loss": device0_loss,
        "device0_accuracy": device0_accuracy,
        "consensus_distance": float(distance),
    }
