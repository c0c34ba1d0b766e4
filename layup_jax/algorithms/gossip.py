"""Gossip baselines on the asynchronous runtime: the same replicas, threads, data and stragglers.

GoSGD (Blot et al. 2016): after the full backward pass, push-sum gossip of the *whole* model to
one random peer. It is LayUp without layer-wise updates, the ablation that isolates them. Its
push-sum weights follow `layup.push_sum` as LayUp's do (per stage by default: each stage an
exact push-sum instance; per model: one weight per device, added to the peer after the last
stage).

AD-PSGD (Lian et al. 2018): after each local step a device averages its whole model
symmetrically with one random peer; both end with the average. The average of each stage is
one atomic pairwise step of the replica store (`ReplicaStore.average_pair`): the sum of all
models is kept whatever local steps land meanwhile.
"""

from collections.abc import Sequence

import jax
import ml_collections
import optax

from layup_jax.algorithms.base import init_model
from layup_jax.data import Dataset, TrainStreams
from layup_jax.exchange import LocalStepsExchange
from layup_jax.options import RuntimeOptions
from layup_jax.runtime import AsyncRuntime
from layup_jax.stages import StagedModel


class _PeerExchange(LocalStepsExchange):
  """Local steps stage by stage; after the last, the whole model exchanged with one peer."""

  def end(self, i: int, context) -> None:
    j = self.peers.pick(i)
    if j is not None:
      self.exchange_with(i, j)


class GoSGD(_PeerExchange):
  """The whole model pushed to the peer, stage by stage, with push-sum weights."""

  def exchange_with(self, i: int, j: int) -> None:
    per_model = self.links.options.push_sum == "per_model"
    model_weight = self.store.halve_model_weight(i) if per_model else None
    outbox = self.links.outboxes[i]
    for s in range(self.store.num_stages):
      outbox.push(j, s, model_weight[s] if model_weight else None)
    outbox.flush()
    if model_weight:
      self.store.add_model_weight(j, model_weight)


class ADPSGD(_PeerExchange):
  """Every stage averaged with the peer's, both sides keeping the average."""

  def exchange_with(self, i: int, j: int) -> None:
    for s in range(self.store.num_stages):
      self.store.average_pair(i, j, s)

  def compile(self) -> None:
    jax.block_until_ready(self.store.compile_pair_average())


EXCHANGES = {"gosgd": GoSGD, "adpsgd": ADPSGD}


def build(config: ml_collections.ConfigDict, model: StagedModel,
          tx: optax.GradientTransformation, devices: Sequence[jax.Device],
          dataset: Dataset | TrainStreams) -> AsyncRuntime:
  params, state = init_model(config, model, dataset.example_batch)
  return AsyncRuntime(model, tx, devices, dataset.train, params, state, dataset.example_batch,
                      EXCHANGES[config.algorithm], RuntimeOptions.from_config(config))
