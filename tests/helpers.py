"""Small models, builders and probes shared by the tests."""

import contextlib

import flax.linen as nn
import jax

from layup_jax.models.staged import StagedModel


@contextlib.contextmanager
def backend_compilations():
  """The XLA compilations made while the block runs (jax's monitoring events, by name). A
  program read from the persistent compilation cache counts too: jax times its compile-or-read
  step as one event (`tests/test_compile_cache.py` holds jax to it), so a compilation the block
  should not make cannot hide behind a cache hit."""
  compiles = []

  def on_duration(name, *_, **__):
    if "backend_compile" in name:
      compiles.append(name)

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)


class DenseBN(nn.Module):
  """A small stage with BatchNorm, so mechanics tests compile in milliseconds."""

  features: int

  @nn.compact
  def __call__(self, x, train: bool):
    x = x.reshape(x.shape[0], -1)
    x = nn.Dense(self.features)(x)
    return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))


class FlatDense(nn.Module):
  """A classifier head on flattened inputs; its `__call__` takes no `train`."""

  num_classes: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


def mlp_model(widths=(16, 16), num_classes=10) -> StagedModel:
  return StagedModel([DenseBN(w) for w in widths] + [FlatDense(num_classes)])


def make_layup_runtime(num_devices=8, *, model=None, learning_rate=0.05, batch_size=8, seed=0,
                       exchange=None, tx=None, train_batches=None, fanout=1, latency_every=0,
                       **options):
  """A LayUp runtime (or a baseline's: `exchange`, the factory of its `Exchange`) on the digits
  data with SGD with momentum (or `tx`), on the first devices; `options` are `RuntimeOptions`
  fields, the others the config's defaults (`RuntimeOptions.of`). One peer per send (the
  paper's, `layup_paper`'s) and no latency samples unless a test asks: half the sends and
  programs of the defaults, which the suite's many small runtimes would otherwise pay."""
  import jax
  import optax

  from layup_jax.algorithms.layup import LayUp
  from layup_jax.data import digits
  from layup_jax.data.pipeline import Batch, TrainIterator
  from layup_jax.runtime.engine import AsyncRuntime
  from layup_jax.runtime.options import RuntimeOptions

  model = model or mlp_model()
  train, _ = digits.load_digits(0.2)
  iterators = train_batches or [TrainIterator(train, num_devices, i, batch_size, seed)
                                for i in range(num_devices)]
  example = Batch(train.inputs[:batch_size], train.targets[:batch_size])
  params, state = model.init(jax.random.key(seed), example.inputs)
  tx = tx or optax.sgd(learning_rate, momentum=0.9)
  return AsyncRuntime(model, tx, jax.devices()[:num_devices], iterators, params, state, example,
                      exchange or LayUp, RuntimeOptions.of(seed=seed, fanout=fanout,
                                                           latency_every=latency_every, **options))


class Hidden(nn.Module):
  """A dense ReLU stage without BatchNorm, for exact comparisons with DDP."""

  features: int

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(self.features)(x.reshape(x.shape[0], -1)))


def plain_mlp(widths=(16, 16), num_classes=10) -> StagedModel:
  return StagedModel([Hidden(w) for w in widths] + [FlatDense(num_classes)])


def write_fashion_mnist(folder, num_train=64, num_test=32, gzipped=True, seed=0):
  """Writes Fashion-MNIST's four idx files with random images and labels into `folder`;
  returns {split: (images, labels)} as uint8 arrays."""
  import gzip
  import os

  import numpy as np

  from layup_jax.data.fashion_mnist import FILES

  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(seed)
  written = {}
  for split, count in (("train", num_train), ("test", num_test)):
    images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, count, dtype=np.uint8)
    for stem, array in zip(FILES[split], (images, labels)):
      header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
      path = os.path.join(folder, stem + (".gz" if gzipped else ""))
      with (gzip.open if gzipped else open)(path, "wb") as f:
        f.write(header + array.tobytes())
    written[split] = (images, labels)
  return written


def tensorboard_scalars(folder):
  """{tag: [(step, value), ...]} of the scalar events in `folder`'s event files, read with
  tensorboardX's protobuf (records: length, its CRC, the event, its CRC)."""
  import collections
  import pathlib
  import struct

  from tensorboardX.proto import event_pb2

  out = collections.defaultdict(list)
  for path in sorted(pathlib.Path(folder).glob("events.out.tfevents.*")):
    raw, offset = path.read_bytes(), 0
    while offset < len(raw):
      (length,) = struct.unpack_from("<Q", raw, offset)
      event = event_pb2.Event.FromString(raw[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        out[value.tag].append((event.step, value.simple_value))
  return dict(out)
