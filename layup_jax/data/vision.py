"""CIFAR-100 and ImageNet splits: decoding and augmentation on host threads, in NumPy and PIL.

CIFAR: random crop of the 4-pixel zero-padded image and horizontal flip for training, then
per-channel normalization. ImageNet: random-resized crop (scale 0.08-1, aspect 3/4-4/3) to
`image_size` and flip for training; resize the short side to `eval_resize`, center crop
`image_size` for evaluation.
"""

import math

import numpy as np
from PIL import Image

from layup_jax.data.pipeline import Batch
from layup_jax.data.sources import RecordSource

CIFAR100_MEAN = np.array([0.5071, 0.4865, 0.4409], np.float32)
CIFAR100_STD = np.array([0.2673, 0.2564, 0.2762], np.float32)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def normalize(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
  """uint8 [B, H, W, 3] -> float32, per-channel standardized (one multiply-add pass)."""
  out = images.astype(np.float32)
  out *= 1.0 / (255.0 * std)
  out -= mean / std
  return out


def pad_crop_flip(images: np.ndarray, pad: int, rng: np.random.Generator) -> np.ndarray:
  """Random crop of the zero-padded images back to their size, and random horizontal flips."""
  num, height, width = images.shape[:3]
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  tops = rng.integers(0, 2 * pad + 1, num)
  lefts = rng.integers(0, 2 * pad + 1, num)
  flips = rng.random(num) < 0.5
  out = np.empty_like(images)
  for i in range(num):
    crop = padded[i, tops[i] : tops[i] + height, lefts[i] : lefts[i] + width]
    out[i] = crop[:, ::-1] if flips[i] else crop
  return out


class Cifar100Split:
  """`label` is the fine label (100 classes)."""

  def __init__(self, records: RecordSource):
    self._records = records

  def __len__(self) -> int:
    return len(self._records)

  def read(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch:
    rows = [self._records[i] for i in indices]
    images = np.stack([row["image"] for row in rows])
    if rng is not None:
      images = pad_crop_flip(images, 4, rng)
    labels = np.array([row["label"] for row in rows], np.int32)
    return Batch(normalize(images, CIFAR100_MEAN, CIFAR100_STD), labels)


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator,
                            scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
  """`(top, left, crop_height, crop_width)` as in Inception training; center crop as fallback."""
  area = height * width
  for _ in range(10):
    target = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
    crop_w = round(math.sqrt(target * aspect))
    crop_h = round(math.sqrt(target / aspect))
    if 0 < crop_w <= width and 0 < crop_h <= height:
      return (int(rng.integers(0, height - crop_h + 1)), int(rng.integers(0, width - crop_w + 1)),
              crop_h, crop_w)
  side = min(height, width)
  return (height - side) // 2, (width - side) // 2, side, side


def train_crop(image: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
  top, left, crop_h, crop_w = random_resized_crop_box(*image.shape[:2], rng)
  crop = Image.fromarray(image[top : top + crop_h, left : left + crop_w])
  out = np.asarray(crop.resize((size, size), Image.BILINEAR))
  return out[:, ::-1] if rng.random() < 0.5 else out


def eval_crop(image: np.ndarray, size: int, resize: int) -> np.ndarray:
  height, width = image.shape[:2]
  scale = resize / min(height, width)
  new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
  resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.BILINEAR))
  top, left = (new_h - size) // 2, (new_w - size) // 2
  return resized[top : top + size, left : left + size]


class ImageNetSplit:
  def __init__(self, records: RecordSource, image_size: int, eval_resize: int):
    self._records, self.image_size, self.eval_resize = records, image_size, eval_resize

  def __len__(self) -> int:
    return len(self._records)

  def read(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch:
    rows = [self._records[i] for i in indices]
    if rng is None:
      crops = [eval_crop(row["image"], self.image_size, self.eval_resize) for row in rows]
    else:
      crops = [train_crop(row["image"], self.image_size, rng) for row in rows]
    labels = np.array([row["label"] for row in rows], np.int32)
    return Batch(normalize(np.stack(crops), IMAGENET_MEAN, IMAGENET_STD), labels)
