"""scikit-learn's handwritten digits (1,797 8x8 images, shipped with the package, no download)."""

import functools

import numpy as np
from sklearn import datasets

from layup_jax.data.pipeline import ArraySplit

SPLIT_SEED = 0  # the train/test split is fixed, whatever the run's seed


@functools.cache
def load_digits(test_fraction: float) -> tuple[ArraySplit, ArraySplit]:
  """A fixed train/test split, images scaled to [0, 1] with shape [N, 8, 8, 1].

  Cached, as config validation and the dataset both ask for it; the arrays are read-only so
  that the shared copy cannot be changed by accident.
  """
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
  num_test = round(test_fraction * len(labels))
  test, train = order[:num_test], order[num_test:]
  splits = ArraySplit(images[train], labels[train]), ArraySplit(images[test], labels[test])
  for split in splits:
    split.inputs.setflags(write=False)
    split.targets.setflags(write=False)
  return splits
