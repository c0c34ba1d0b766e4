"""The paper's TFDS datasets through the real pipeline, with records from tfds.testing.mock_data.

The data dir holds only metadata (tests/tfds_fakes.py), so the project's own checks — is the
dataset prepared, does the split exist — run as they would on a prepared data dir.
"""

import numpy as np
import pytest

from layup_jax import data, defaults
from layup_jax.data import sources, vision
from layup_jax.errors import DataError
from tests.tfds_fakes import mocked_tfds

NUM_RECORDS = 48
TFDS_NAMES = {name: spec.tfds_name for name, spec in data.DATASETS.items() if spec.tfds_name}


@pytest.fixture
def data_config(tmp_path):
  config = defaults.get_config().data
  config.data_dir, config.token_cache_dir = str(tmp_path), ""
  config.batch_size, config.seq_len, config.image_size, config.eval_resize = 4, 16, 32, 36
  config.read_threads, config.eval_batch_size = 2, 4
  return config


@pytest.fixture
def mocked(tmp_path):
  with mocked_tfds(tmp_path, list(TFDS_NAMES.values()), NUM_RECORDS):
    yield


def _expected_shapes(name, config):
  if name == "cifar100":
    return (32, 32, 3), np.float32, ()
  if name == "imagenet2012":
    return (config.image_size, config.image_size, 3), np.float32, ()
  if name == "imdb_reviews":
    return (config.seq_len,), np.int32, ()
  return (config.seq_len,), np.int32, (config.seq_len,)


@pytest.mark.parametrize("name", sorted(TFDS_NAMES))
def test_batches_have_the_model_shapes_and_dtypes(name, data_config, mocked):
  data_config.name = name
  dataset = data.make_dataset(data_config, num_devices=2, seed=0)
  input_shape, input_dtype, target_shape = _expected_shapes(name, data_config)
  for batch in (next(dataset.train[0]), next(iter(dataset.test))):
    assert batch.inputs.shape == (4, *input_shape) and batch.inputs.dtype == input_dtype
    assert batch.targets.shape == (4, *target_shape) and batch.targets.dtype == np.int32
  if dataset.kind == "language_model":
    assert batch.inputs.max() < 257 and batch.inputs.min() >= 0
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])  # next tokens
  elif name == "imdb_reviews":
    assert set(np.unique(batch.targets)) <= {0, 1} and batch.inputs.max() < 257
  else:
    classes = 100 if name == "cifar100" else 1000
    assert 0 <= batch.targets.min() and batch.targets.max() < classes
    low = (0 - vision.IMAGENET_MEAN) / vision.IMAGENET_STD
    high = (1 - vision.IMAGENET_MEAN) / vision.IMAGENET_STD
    if name == "cifar100":
      low = (0 - vision.CIFAR100_MEAN) / vision.CIFAR100_STD
      high = (1 - vision.CIFAR100_MEAN) / vision.CIFAR100_STD
    assert (batch.inputs >= low - 1e-5).all() and (batch.inputs <= high + 1e-5).all()


@pytest.mark.parametrize("name", sorted(TFDS_NAMES))
def test_one_epoch_of_shards_is_disjoint_covers_the_split_and_resumes(name, data_config, mocked):
  data_config.name = name
  devices = 3
  dataset = data.make_dataset(data_config, num_devices=devices, seed=7)
  train, _ = data.build_splits(data_config)
  epoch = [np.concatenate([it.index[k] for k in range(it.batches_per_epoch())])
           for it in dataset.train]
  joined = np.concatenate(epoch)
  per_device = (len(train) // devices) // 4 * 4
  assert len(joined) == len(set(joined.tolist())) == devices * per_device  # disjoint
  assert per_device > len(train) // devices - 4  # covers all but the remainder
  # What a device gets is what its indices say (augmentation aside), in order.
  iterator = dataset.train[1]
  first = next(iterator)
  if name != "imagenet2012":  # random-resized crops change the shape of the content
    reference = train.read(iterator.index[0], None if name != "cifar100" else
                           np.random.default_rng(0))
    np.testing.assert_array_equal(first.targets, reference.targets)
  # Same seed, same batches; a saved state resumes at the same next batch.
  again = data.make_dataset(data_config, num_devices=devices, seed=7).train[1]
  np.testing.assert_array_equal(next(again).inputs, first.inputs)
  state = iterator.get_state()
  expected = [next(iterator).inputs for _ in range(3)]
  again.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(again).inputs, want)


def test_cifar_augmentation_is_a_shifted_crop_of_the_padded_image_maybe_flipped():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
  out = vision.pad_crop_flip(images, 4, np.random.default_rng(1))
  padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)))
  for image, crop in zip(padded, out):
    matches = [(top, left, flip) for top in range(9) for left in range(9) for flip in (0, 1)
               if np.array_equal(crop, image[top:top + 32, left:left + 32][:, ::-1] if flip
                                 else image[top:top + 32, left:left + 32])]
    assert matches
  assert not np.array_equal(out, images)


def test_random_resized_crops_stay_inside_the_image_with_the_inception_scales():
  rng = np.random.default_rng(0)
  for _ in range(500):
    height, width = rng.integers(20, 400, 2)
    top, left, crop_h, crop_w = vision.random_resized_crop_box(height, width, rng)
    assert 0 <= top and top + crop_h <= height and 0 <= left and left + crop_w <= width
    fallback = crop_h == crop_w == min(height, width)
    assert fallback or 0.07 <= crop_h * crop_w / (height * width) <= 1.0
  image = np.arange(300 * 200 * 3, dtype=np.uint8).reshape(300, 200, 3)
  assert vision.eval_crop(image, 224, 256).shape == (224, 224, 3)


def test_a_dataset_that_is_not_prepared_says_where_it_looked_and_how_to_prepare_it(tmp_path):
  with pytest.raises(DataError) as error:
    sources.open_split("cifar100", "train", str(tmp_path))
  message = str(error.value)
  assert "'cifar100' is not prepared in the data dir " + str(tmp_path) in message
  assert f"tfds build cifar100 --data_dir={tmp_path} --file_format=array_record" in message
  with pytest.raises(DataError, match=r"'huggingface:wikitext/wikitext-103-raw-v1' is not "
                                      r"prepared .*wikitext/wikitext_103_raw_v1/\*"):
    sources.open_split(TFDS_NAMES["wikitext103"], "train", str(tmp_path))
  with pytest.raises(DataError, match=r"--manual_dir="):
    sources.open_split("imagenet2012", "train", str(tmp_path))


def test_a_wrong_split_name_lists_the_splits_there_are(tmp_path, mocked):
  with pytest.raises(DataError, match=r"'cifar100' has no split 'tset' \(in 'tset'\); its splits "
                                      r"are \['test', 'train', 'validation'\]"):
    sources.open_split("cifar100", "tset", str(tmp_path))
  sources.open_split("cifar100", "train[:50%]+test", str(tmp_path))  # slices and sums are fine


class _Broken:
  def __len__(self):
    return 10

  def __getitem__(self, index):
    if index == 3:
      raise ValueError("bad record bytes")
    return {"image": np.zeros((32, 32, 3), np.uint8), "label": 1}


def test_a_corrupt_record_is_named_even_from_a_reader_thread():
  split = vision.Cifar100Split(sources.RecordSource(_Broken(), "cifar100/train in /data"))
  iterator = data.TrainIterator(split, 1, 0, batch_size=10, seed=0, read_threads=2)
  with pytest.raises(DataError, match=r"corrupt record 3 of cifar100/train in /data: "
                                      r"ValueError: bad record bytes"):
    next(iterator)
