"""Per-device exclusive shards of an in-memory split, reshuffled every epoch (paper Eq. 1)."""

import dataclasses
from collections.abc import Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class ArraySplit:
  inputs: np.ndarray
  targets: np.ndarray

  def __len__(self) -> int:
    return len(self.targets)


@dataclasses.dataclass(frozen=True)
class Batch:
  inputs: np.ndarray
  targets: np.ndarray


@dataclasses.dataclass(frozen=True)
class EvalBatch:
  inputs: np.ndarray
  targets: np.ndarray
  mask: np.ndarray  # 1 for real samples, 0 for padding of the last batch


def shard_indices(num_samples: int, num_shards: int, shard: int, seed: int,
                  epoch: int) -> np.ndarray:
  """Sample indices of one shard for one epoch.

  All shards draw the same permutation of the epoch and take disjoint contiguous slices of it, so
  every sample is used by exactly one device per epoch; the remainder of N / M is dropped.
  """
  order = np.random.default_rng([seed, epoch]).permutation(num_samples)
  per_shard = num_samples // num_shards
  return order[shard * per_shard : (shard + 1) * per_shard]


class ShardIterator(Iterator[Batch]):
  """Endless batches of one device's shard; its state is `(epoch, position)`."""

  def __init__(self, split: ArraySplit, num_shards: int, shard: int, batch_size: int, seed: int):
    self._split, self._num_shards, self._shard = split, num_shards, shard
    self._batch_size, self._seed = batch_size, seed
    self.epoch, self.position = 0, 0
    self._indices = self._epoch_indices()

  def _epoch_indices(self) -> np.ndarray:
    return shard_indices(len(self._split), self._num_shards, self._shard, self._seed, self.epoch)

  def batches_per_epoch(self) -> int:
    return (len(self._split) // self._num_shards) // self._batch_size

  def __next__(self) -> Batch:
    if self.position + self._batch_size > len(self._indices):
      self.epoch, self.position = self.epoch + 1, 0
      self._indices = self._epoch_indices()
    chosen = self._indices[self.position : self.position + self._batch_size]
    self.position += self._batch_size
    return Batch(self._split.inputs[chosen], self._split.targets[chosen])


def eval_batches(split: ArraySplit, batch_size: int) -> list[EvalBatch]:
  """The whole split in order, the last batch padded to full size and masked."""
  batches = []
  for start in range(0, len(split), batch_size):
    inputs = split.inputs[start : start + batch_size]
    targets = split.targets[start : start + batch_size]
    pad = batch_size - len(targets)
    mask = np.concatenate([np.ones(len(targets), np.float32), np.zeros(pad, np.float32)])
    inputs = np.concatenate([inputs, np.zeros((pad, *inputs.shape[1:]), inputs.dtype)])
    targets = np.concatenate([targets, np.zeros((pad, *targets.shape[1:]), targets.dtype)])
    batches.append(EvalBatch(inputs, targets, mask))
  return batches
