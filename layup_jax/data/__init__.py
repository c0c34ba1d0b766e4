"""Datasets by name: each builds a train and a test split; the pipeline shards and prefetches.

| `data.name` | source | splits (train / test) | samples |
|---|---|---|---|
| `digits` | scikit-learn (shipped) | fixed `test_fraction` split | 8x8x1 image, label |
| `fashion_mnist` | the official idx files in `data_dir` (else Debian's `dataset-fashion-mnist`) | train / t10k | 28x28x1 image, label |
| `cifar100` | TFDS `cifar100` | train / test | 32x32x3 image, fine label |
| `imagenet2012` | TFDS `imagenet2012` | train / validation | `image_size` crop, label |
| `imdb_reviews` | TFDS `imdb_reviews` | train / test | `seq_len` tokens, label |
| `lm1b`, `tiny_shakespeare` | TFDS | train / test | `seq_len` tokens, next tokens |
| `wikitext103` | TFDS `huggingface:wikitext/wikitext-103-raw-v1` | train / test | same |
| `minipile` | TFDS `huggingface:jeankaddour__minipile` | train / test | same |
| `text_files` | files under `text_dir` matching `text_glob` (less `text_exclude`) | `test_fraction` of the files, by a hash of their paths | same |

Imports `errors` only (and the libraries that read data): every other package may import it.
"""

import dataclasses
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np

from layup_jax.data import digits, fashion_mnist, sources, text, vision
from layup_jax.data.pipeline import (
  ArraySplit,
  Batch,
  EvalBatch,
  EvalSet,
  Split,
  TrainIterator,
  shard_indices,
)
from layup_jax.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  build: Callable[[ml_collections.ConfigDict], tuple[Split, Split]]
  tfds_name: str = ""  # default TFDS name (data.tfds_name overrides)
  splits: tuple[str, str] = ("train", "test")
  kind: str = "classification"  # or "language_model"


@dataclasses.dataclass
class Dataset:
  train: list[TrainIterator]  # one per device, each over its own exclusive shard
  test: EvalSet
  example_batch: Batch  # one training batch, for shapes at init and compilation
  num_train: int
  kind: str
  train_split: Split | None = None  # the whole training split, for `statistics_inputs`

  @property
  def steps_per_epoch(self) -> int:
    return self.train[0].batches_per_epoch()

  def statistics_inputs(self, num_batches: int, batch_size: int, seed: int) -> list[np.ndarray]:
    """`num_batches` batches of training inputs, without augmentation, from one fixed shuffle
    of the whole training split (`seed`): what `precise_bn_batches` recomputes the evaluated
    model's BatchNorm statistics from."""
    if num_batches == 0:  # the default: no shuffle of the whole split at the first evaluation
      return []
    order = np.random.default_rng(seed).permutation(self.num_train)
    batch_size = min(batch_size, self.num_train)
    return [self.train_split.read(order[np.arange(k * batch_size, (k + 1) * batch_size)
                                        % self.num_train], None).inputs
            for k in range(num_batches)]

  def close(self) -> None:
    for iterator in self.train:
      iterator.close()


@dataclasses.dataclass(frozen=True)
class TrainStreams:
  """What a runtime trains on: one batch iterator per device and an example batch (a `Dataset`
  has both; benchmarks build this from random batches of a real shape)."""

  train: list[Iterator[Batch]]
  example_batch: Batch


def _tfds_splits(config) -> tuple[str, str, str]:
  spec = DATASETS[config.name]
  train, test = spec.splits
  return (config.tfds_name or spec.tfds_name, config.train_split or train,
          config.test_split or test)


def _open(config, split: str) -> sources.RecordSource:
  name, _, _ = _tfds_splits(config)
  return sources.open_split(name, split, config.data_dir)


def _digits(config):
  return digits.load_digits(config.test_fraction)


def _fashion_mnist(config):
  return fashion_mnist.load_fashion_mnist(config.data_dir)


def _cifar100(config):
  _, train, test = _tfds_splits(config)
  return vision.Cifar100Split(_open(config, train)), vision.Cifar100Split(_open(config, test))


def _imagenet(config):
  _, train, test = _tfds_splits(config)
  return tuple(vision.ImageNetSplit(_open(config, split), config.image_size, config.eval_resize)
               for split in (train, test))


def _imdb(config):
  _, train, test = _tfds_splits(config)
  tokenizer = text.make_tokenizer(config.tokenizer)
  pad = 0 if isinstance(tokenizer, text.ByteTokenizer) else tokenizer.eos_id
  return tuple(text.ReviewSplit(_open(config, split), tokenizer, config.seq_len, pad)
               for split in (train, test))


def _tfds_corpus(config):
  _, train, test = _tfds_splits(config)
  tokenizer = text.make_tokenizer(config.tokenizer)
  splits = []
  for split in (train, test):
    records = _open(config, split)
    stream = text.record_stream(records, "text", tokenizer, config.token_cache_dir)
    splits.append(text.PackedWindows(stream, config.seq_len, records.description))
  return tuple(splits)


def _text_files(config):
  if not config.text_dir:
    raise DataError("data.name='text_files' needs data.text_dir, a folder of text files")
  tokenizer = text.make_tokenizer(config.tokenizer)
  train, test = text.file_streams(config.text_dir, config.text_glob, tokenizer,
                                  config.test_fraction, config.token_cache_dir,
                                  tuple(config.get("text_exclude", ())))
  return (text.PackedWindows(train, config.seq_len, f"the train files of {config.text_dir}"),
          text.PackedWindows(test, config.seq_len, f"the test files of {config.text_dir}"))


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec(_digits),
    "fashion_mnist": DatasetSpec(_fashion_mnist),
    "cifar100": DatasetSpec(_cifar100, "cifar100"),
    "imagenet2012": DatasetSpec(_imagenet, "imagenet2012", ("train", "validation")),
    "imdb_reviews": DatasetSpec(_imdb, "imdb_reviews"),
    "lm1b": DatasetSpec(_tfds_corpus, "lm1b", kind="language_model"),
    "tiny_shakespeare": DatasetSpec(_tfds_corpus, "tiny_shakespeare", kind="language_model"),
    "wikitext103": DatasetSpec(_tfds_corpus, "huggingface:wikitext/wikitext-103-raw-v1",
                               kind="language_model"),
    "minipile": DatasetSpec(_tfds_corpus, "huggingface:jeankaddour__minipile",
                            kind="language_model"),
    "text_files": DatasetSpec(_text_files, kind="language_model"),
}


def register(name: str, build: Callable[[ml_collections.ConfigDict],
                                        tuple[Split | tuple[np.ndarray, np.ndarray], ...]],
             kind: str = "classification") -> None:
  """Makes `config.data.name = name` train on your data (bring your own dataset).

  `build(config.data)` returns the train and the test split, each either `(inputs, labels)`
  arrays (held in memory, as `ArraySplit`) or any object with `__len__` and `read(indices, rng)
  -> Batch` (the `Split` protocol: a record source that reads and augments a batch). The
  pipeline shards, shuffles, reads ahead and resumes them as it does the built-in datasets.
  `kind`: "classification" (labels per sample) or "language_model" (a target per token).
  """
  if kind not in ("classification", "language_model"):
    raise ValueError(f"kind must be 'classification' or 'language_model', got {kind!r}")

  def build_splits_of(config):
    return tuple(ArraySplit(*split) if isinstance(split, tuple) else split
                 for split in build(config))

  DATASETS[name] = DatasetSpec(build_splits_of, kind=kind)


def names() -> list[str]:
  return sorted(DATASETS)


def token_vocab_size(config: ml_collections.ConfigDict) -> int | None:
  """Tokens a text dataset can produce (None for images), to check the model's vocabulary."""
  if DATASETS[config.name].kind == "language_model" or config.name == "imdb_reviews":
    return text.make_tokenizer(config.tokenizer).vocab_size
  return None


def build_splits(config: ml_collections.ConfigDict) -> tuple[Split, Split]:
  return DATASETS[config.name].build(config)


def make_dataset(config: ml_collections.ConfigDict, num_devices: int, seed: int) -> Dataset:
  """Per-device train iterators and the test set; checks the batch fits each device's shard."""
  train, test = build_splits(config)
  shard = len(train) // num_devices
  if config.batch_size > shard:
    raise ConfigError(
        f"config.data.batch_size={config.batch_size}: each of the {num_devices} devices has only "
        f"{shard} training samples per epoch; use a batch size <= {shard} or fewer devices")
  iterators = [TrainIterator(train, num_devices, device, config.batch_size, seed,
                             config.read_threads, config.prefetch)
               for device in range(num_devices)]
  example = train.read(np.arange(config.batch_size), np.random.default_rng(0))
  return Dataset(
      train=iterators,
      test=EvalSet(test, config.eval_batch_size, config.max_eval_batches, config.read_threads,
                   config.prefetch),
      example_batch=example,
      num_train=len(train),
      kind=DATASETS[config.name].kind,
      train_split=train,
  )


__all__ = [
  "ArraySplit",
  "Batch",
  "DataError",
  "Dataset",
  "EvalBatch",
  "EvalSet",
  "Split",
  "TrainIterator",
  "TrainStreams",
  "build_splits",
  "make_dataset",
  "names",
  "shard_indices",
]
