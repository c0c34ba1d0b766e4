"""LayUp: asynchronous gossip with layer-wise push-sum updates (paper Algorithm 1)."""

from collections.abc import Sequence

import jax
import ml_collections
import optax

from layup_jax.algorithms.base import init_model, runtime_options
from layup_jax.data import Dataset
from layup_jax.runtime import LayUpRuntime
from layup_jax.stages import StagedModel


def build(
    config: ml_collections.ConfigDict,
    model: StagedModel,
    tx: optax.GradientTransformation,
    devices: Sequence[jax.Device],
    dataset: Dataset,
) -> LayUpRuntime:
  params, state = init_model(config, model, dataset.example_batch)
  return LayUpRuntime(
      model, tx, devices, dataset.train, params, state, dataset.example_batch,
      bn_policy=config.layup.bn_policy, gossip=config.layup.gossip,
      latency_every=config.metrics.latency_every,
      max_sends_in_flight=config.layup.max_sends_in_flight, **runtime_options(config),
  )
