"""LayUp: asynchronous gossip with layer-wise push-sum updates (paper Algorithm 1).

The updater thread of device i, for each iteration of its compute thread:

  Randomly select a peer j
  w_i <- w_i / 2                                          (per-model weights only)
  for each layer l, as its gradient arrives:
    Local update:  x^{i,l} <- x~^{i,l} - eta grad(S_k, x^^{i,l})
    Communication: send(x^{i,l}, j)
    Peer update:   x^{j,l} <- (w_j x^^{j,l} + w_i x^{i,l}) / (w_i + w_j)
  w_j <- w_j + w_i                                        (per-model weights only)

`layup.push_sum` chooses the weights. `per_stage` (the default) gives every (device, stage) its
own weight: sending layer l halves w_{i,l}, and the peer update uses w_{j,l} and adds the sent
amount to it in the same atomic write, so each layer is an exact push-sum instance and the
average model is kept to rounding error. `per_model` is Algorithm 1 as written: one weight per
device, w_j grown only after the last layer. Layers are sent one at a time, so a third device
mixing a layer into j in between reads a w_j that does not match that layer, and the average
drifts (measured in docs/results.md); the paper accepts such contention as lock-free noise,
per_stage removes it at no cost (a float per stage).
"""

import dataclasses
from collections.abc import Sequence

import jax
import ml_collections
import optax

from layup_jax.algorithms.base import init_model
from layup_jax.data import Dataset, TrainStreams
from layup_jax.exchange import StatelessExchange
from layup_jax.options import RuntimeOptions
from layup_jax.runtime import AsyncRuntime
from layup_jax.stages import StagedModel


@dataclasses.dataclass(frozen=True)
class Iteration:
  peer: int | None  # j, or None without gossip
  model_weight: list[float] | None  # per-model push-sum: the halved w_i, per stage


class LayUp(StatelessExchange):
  """Algorithm 1's updater (module docstring), on the replica store and outboxes.

  The local update of each stage runs in the program of its backward, dispatched by the compute
  thread as the gradient is computed (`ReplicaStore.backward_step`): it applies to the newest
  x_{i,l} under the same lock a merge takes, as the updater's step did, without a gradient
  array, a hand-over and a program of its own. The updater's part per layer is then the
  communication: it sends the updated layer to j once it is computed. The order per layer is
  Algorithm 1's (local update, then send, then the peer update).
  """

  fuses_local_step = True

  def begin(self, i: int) -> Iteration:
    j = self.peers.pick(i)
    per_model = j is not None and self.links.options.push_sum == "per_model"
    return Iteration(j, self.store.halve_model_weight(i) if per_model else None)

  def on_stage(self, i: int, it: Iteration, s: int, grads, step: jax.Array):
    updated = (self.store.params(i, s) if grads is None
               else self.store.local_step(i, s, grads, step))
    if it.peer is None:
      return updated
    # Per stage: w_{i,s} is halved as the stage leaves, w_{j,s} grows as it is mixed in.
    amount = it.model_weight[s] if it.model_weight else None
    return self.links.outboxes[i].push(it.peer, s, amount)

  def end(self, i: int, it: Iteration):
    if it.peer is None:
      return
    yield from self.links.outboxes[i].flush()
    if it.model_weight:
      self.store.add_model_weight(it.peer, it.model_weight)


def build(config: ml_collections.ConfigDict, model: StagedModel,
          tx: optax.GradientTransformation, devices: Sequence[jax.Device],
          dataset: Dataset | TrainStreams) -> AsyncRuntime:
  params, state = init_model(config, model, dataset.example_batch)
  return AsyncRuntime(model, tx, devices, dataset.train, params, state, dataset.example_batch,
                      LayUp, RuntimeOptions.from_config(config))
