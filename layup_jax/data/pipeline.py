"""Per-device input pipelines on grain: exclusive shards each epoch (paper Eq. 1), prefetched.

A *split* is anything with `len(split)` samples and `split.read(indices, rng) -> Batch`: reading
and augmenting a whole batch at once lets NumPy vectorize it. `rng` is None for evaluation (no
augmentation). The pipeline only decides which indices form each device's batches and runs
`read` on background threads ahead of the compute thread.
"""

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, Protocol

import grain
import numpy as np

MAX_EPOCHS = 1_000_000  # the batch stream is lazily "infinite"


@dataclasses.dataclass(frozen=True)
class Batch:
  inputs: np.ndarray
  targets: np.ndarray


@dataclasses.dataclass(frozen=True)
class EvalBatch:
  inputs: np.ndarray
  targets: np.ndarray
  mask: np.ndarray  # 1 for real samples, 0 for padding of the last batch


class Split(Protocol):
  def __len__(self) -> int: ...

  def read(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch: ...


@dataclasses.dataclass(frozen=True)
class ArraySplit:
  """A split held in memory as two arrays; no augmentation."""

  inputs: np.ndarray
  targets: np.ndarray

  def __len__(self) -> int:
    return len(self.targets)

  def read(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch:
    del rng
    return Batch(self.inputs[indices], self.targets[indices])


@functools.lru_cache(maxsize=64)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_samples)


def shard_indices(num_samples: int, num_shards: int, shard: int, seed: int,
                  epoch: int) -> np.ndarray:
  """Sample indices of one shard for one epoch.

  All shards draw the same permutation of the epoch and take disjoint contiguous slices of it, so
  every sample is used by exactly one device per epoch; the remainder of N / M is dropped.
  """
  order = _epoch_permutation(num_samples, seed, epoch)
  per_shard = num_samples // num_shards
  return order[shard * per_shard : (shard + 1) * per_shard]


@dataclasses.dataclass(frozen=True)
class ShardBatchIndices:
  """Random access to one device's batches: element k is the index array of its k-th batch."""

  num_samples: int
  num_shards: int
  shard: int
  batch_size: int
  seed: int

  def batches_per_epoch(self) -> int:
    return (self.num_samples // self.num_shards) // self.batch_size

  def __len__(self) -> int:
    return self.batches_per_epoch() * MAX_EPOCHS

  def __getitem__(self, k: int) -> np.ndarray:
    epoch, batch = divmod(int(k), self.batches_per_epoch())
    indices = shard_indices(self.num_samples, self.num_shards, self.shard, self.seed, epoch)
    return indices[batch * self.batch_size : (batch + 1) * self.batch_size]


def _element_seed(seed: int, shard: int) -> int:
  return int(np.random.SeedSequence([seed, shard, 1]).generate_state(1)[0])


class TrainIterator(Iterator[Batch]):
  """Endless augmented batches of one device's shard, read ahead on background threads.

  Deterministic given the seed: batch k's indices and its augmentation randomness depend only on
  `(seed, shard, k)`, whatever the thread timing. `get_state()` is a small dict that
  `set_state()` takes back to continue at the same next batch (for checkpoints).
  """

  def __init__(self, split: Split, num_shards: int, shard: int, batch_size: int, seed: int,
               read_threads: int = 1, prefetch: int = 2):
    self.index = ShardBatchIndices(len(split), num_shards, shard, batch_size, seed)
    if self.index.batches_per_epoch() < 1:
      raise ValueError(f"shard {shard} of {len(split)} samples over {num_shards} devices has no "
                       f"full batch of {batch_size}")
    dataset = grain.MapDataset.source(self.index).random_map(
        lambda indices, rng: split.read(indices, rng), seed=_element_seed(seed, shard))
    self._dataset = dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch))
    self._iterator = iter(self._dataset)

  def batches_per_epoch(self) -> int:
    return self.index.batches_per_epoch()

  def __next__(self) -> Batch:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    return self._iterator.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._iterator.set_state(state)

  def close(self) -> None:
    """Stops the reader threads (pending reads are cancelled)."""
    self._iterator.close()

  @property
  def next_batch(self) -> int:
    """How many batches have been taken (the index of the next one)."""
    return int(self.get_state()["next_index"])


def _eval_batch(split: Split, indices: np.ndarray, batch_size: int) -> EvalBatch:
  batch = split.read(indices, None)
  pad = batch_size - len(indices)
  mask = np.concatenate([np.ones(len(indices), np.float32), np.zeros(pad, np.float32)])
  pad_rows = lambda a: np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
  return EvalBatch(pad_rows(batch.inputs), pad_rows(batch.targets), mask)


class EvalSet:
  """The whole test split in order, or `max_batches` batches of samples spread evenly over it,
  re-read each pass: a language model's test stream in order is a few documents per batch, so
  the first batches alone would measure the first documents only.

  Batches are read ahead on background threads; the last one is padded to full size and masked,
  so every batch has one shape and evaluation compiles once.
  """

  def __init__(self, split: Split, batch_size: int, max_batches: int = 0, read_threads: int = 1,
               prefetch: int = 2):
    self.split, self.batch_size = split, min(batch_size, len(split))
    self.num_batches = -(-len(split) // self.batch_size)
    self.indices = np.arange(len(split))
    if max_batches and max_batches < self.num_batches:
      self.num_batches = max_batches
      self.indices = np.linspace(0, len(split), max_batches * self.batch_size, endpoint=False,
                                 dtype=np.int64)
    self._read_options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)

  def __len__(self) -> int:
    return self.num_batches

  def __iter__(self) -> Iterator[EvalBatch]:
    starts = grain.MapDataset.range(0, self.num_batches * self.batch_size, self.batch_size)
    batches = starts.map(lambda start: _eval_batch(
        self.split, self.indices[int(start):int(start) + self.batch_size], self.batch_size))
    return iter(batches.to_iter_dataset(self._read_options))


def random_image_batches(batch_size: int, image_size: int, num_classes: int,
                         seed: int) -> Iterator[Batch]:
  """Endless batches of normal-random RGB images and uniform labels: inputs of a real shape for
  benchmarks, where the values do not matter."""
  rng = np.random.default_rng(seed)
  while True:
    yield Batch(rng.normal(size=(batch_size, image_size, image_size, 3)).astype(np.float32),
                rng.integers(0, num_classes, batch_size).astype(np.int32))
