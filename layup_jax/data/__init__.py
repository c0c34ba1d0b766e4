"""Datasets by name: each builder makes per-device train iterators and a test set."""

import dataclasses
from collections.abc import Callable

import ml_collections

from layup_jax.data import digits
from layup_jax.data.sharding import ArraySplit, Batch, EvalBatch, ShardIterator, eval_batches

EVAL_BATCH_SIZE = 512


@dataclasses.dataclass
class Dataset:
  train: list[ShardIterator]  # one per device, each over its own exclusive shard
  test: list[EvalBatch]
  example_batch: Batch  # one training batch, for shapes at init and compilation
  num_train: int

  @property
  def steps_per_epoch(self) -> int:
    return self.train[0].batches_per_epoch()


def _in_memory(train: ArraySplit, test: ArraySplit, config, num_devices: int,
               seed: int) -> Dataset:
  iterators = [
      ShardIterator(train, num_devices, shard, config.batch_size, seed)
      for shard in range(num_devices)
  ]
  return Dataset(
      train=iterators,
      test=eval_batches(test, min(EVAL_BATCH_SIZE, len(test))),
      example_batch=Batch(train.inputs[: config.batch_size], train.targets[: config.batch_size]),
      num_train=len(train),
  )


def _digits(config: ml_collections.ConfigDict, num_devices: int, seed: int) -> Dataset:
  train, test = digits.load_digits(config.test_fraction)
  return _in_memory(train, test, config, num_devices, seed)


def num_train_samples(config: ml_collections.ConfigDict) -> int:
  """Training-set size without building iterators (for config validation)."""
  return _SIZES[config.name](config)


_REGISTRY: dict[str, Callable[[ml_collections.ConfigDict, int, int], Dataset]] = {
    "digits": _digits,
}
_SIZES: dict[str, Callable[[ml_collections.ConfigDict], int]] = {
    "digits": lambda config: len(digits.load_digits(config.test_fraction)[0]),
}


def names() -> list[str]:
  return sorted(_REGISTRY)


def make_dataset(config: ml_collections.ConfigDict, num_devices: int, seed: int) -> Dataset:
  return _REGISTRY[config.name](config, num_devices, seed)


__all__ = ["Batch", "Dataset", "EvalBatch", "make_dataset", "names", "num_train_samples"]
