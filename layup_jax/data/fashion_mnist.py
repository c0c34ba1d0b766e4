"""Fashion-MNIST from its four official idx files (60,000 + 10,000 28x28 grey images, 10 classes).

The files are what the official repository distributes (github.com/zalandoresearch/fashion-mnist,
`data/fashion`) and what Debian's package `dataset-fashion-mnist` installs under
`/usr/share/datasets/fashion-mnist/`: `train-images-idx3-ubyte.gz`, `train-labels-idx1-ubyte.gz`,
`t10k-images-idx3-ubyte.gz`, `t10k-labels-idx1-ubyte.gz` (gzipped or not). Nothing is
downloaded at run time.
"""

import functools
import gzip
import os

import numpy as np

from layup_jax.data.pipeline import ArraySplit
from layup_jax.errors import DataError

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_UBYTE = 0x08  # the idx type code of unsigned bytes, the only one these files use


def missing_message(folder: str) -> str:
  return (f"Fashion-MNIST's idx files are not in {folder}: install Debian's package "
          f"(apt-get install dataset-fashion-mnist, into {DEBIAN_DIR}) or download the four "
          "files {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz from "
          "https://github.com/zalandoresearch/fashion-mnist (data/fashion) into a folder and "
          "set data.data_dir to it")


def _path(folder: str, stem: str) -> str:
  for name in (stem + ".gz", stem):
    path = os.path.join(folder, name)
    if os.path.exists(path):
      return path
  raise DataError(missing_message(folder))


def read_idx(path: str, ndim: int) -> np.ndarray:
  """An idx file's array (big-endian header: two zero bytes, the type code, the number of
  dimensions, one int32 per dimension; then the data)."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  if len(raw) < 4 or raw[0] or raw[1] or raw[2] != _UBYTE or raw[3] != ndim:
    raise DataError(f"{path} is not an idx file of {ndim}-dimensional unsigned bytes")
  shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
  data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
  if data.size != int(np.prod(shape)):
    raise DataError(f"{path} holds {data.size} bytes of data, its header says {shape}")
  return data.reshape(shape)


@functools.cache
def load_fashion_mnist(data_dir: str = "") -> tuple[ArraySplit, ArraySplit]:
  """Train and test splits, images scaled to [0, 1] with shape [N, 28, 28, 1], labels int32;
  from `data_dir`, else Debian's folder. Cached and read-only, as `digits.load_digits`."""
  folder = os.path.expanduser(data_dir) if data_dir else DEBIAN_DIR
  splits = []
  for split in ("train", "test"):
    images_stem, labels_stem = FILES[split]
    images = read_idx(_path(folder, images_stem), 3)
    labels = read_idx(_path(folder, labels_stem), 1)
    if len(images) != len(labels):
      raise DataError(f"Fashion-MNIST's {split} split in {folder} has {len(images)} images "
                      f"and {len(labels)} labels")
    inputs = (images.astype(np.float32) / 255.0)[..., None]
    targets = labels.astype(np.int32)
    inputs.setflags(write=False)
    targets.setflags(write=False)
    splits.append(ArraySplit(inputs, targets))
  return splits[0], splits[1]
