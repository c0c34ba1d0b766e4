"""Fashion-MNIST is read from its official idx files, gzipped or not; a missing folder says how
to get them. The files here are written by the test (random images), not the real data."""

import numpy as np
import pytest

from layup_jax import data, defaults
from layup_jax.data import fashion_mnist
from layup_jax.errors import DataError
from tests.helpers import write_fashion_mnist


@pytest.mark.parametrize("gzipped", [True, False])
def test_the_idx_files_are_read_as_images_in_0_1_and_int32_labels(tmp_path, gzipped):
  written = write_fashion_mnist(tmp_path, num_train=48, num_test=16, gzipped=gzipped)
  train, test = fashion_mnist.load_fashion_mnist(str(tmp_path))
  for split, (images, labels) in zip((train, test), (written["train"], written["test"])):
    assert split.inputs.shape == (len(labels), 28, 28, 1) and split.inputs.dtype == np.float32
    np.testing.assert_allclose(split.inputs[..., 0] * 255.0, images, atol=1e-4)
    np.testing.assert_array_equal(split.targets, labels.astype(np.int32))


def test_the_dataset_shards_the_train_split_over_the_devices(tmp_path):
  write_fashion_mnist(tmp_path, num_train=64, num_test=16)
  config = defaults.get_config().data
  config.name, config.data_dir, config.batch_size = "fashion_mnist", str(tmp_path), 4
  dataset = data.make_dataset(config, 4, seed=0)
  assert dataset.num_train == 64 and dataset.steps_per_epoch == 4  # 64 / (4 devices x 4)
  batch = next(dataset.train[0])
  assert batch.inputs.shape == (4, 28, 28, 1)
  dataset.close()


def test_a_folder_without_the_files_says_both_ways_to_get_them(tmp_path):
  with pytest.raises(DataError) as error:
    fashion_mnist.load_fashion_mnist(str(tmp_path / "empty"))
  message = str(error.value)
  assert "apt-get install dataset-fashion-mnist" in message
  assert "zalandoresearch/fashion-mnist" in message and "data.data_dir" in message
  assert "\n" not in message


def test_a_file_that_is_not_idx_is_refused(tmp_path):
  write_fashion_mnist(tmp_path, gzipped=False)
  (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"not an idx file")
  with pytest.raises(DataError, match="is not an idx file"):
    fashion_mnist.load_fashion_mnist(str(tmp_path))
