"""ResNets (He et al. 2016) as lists of stage modules: stem, residual blocks, head.

Each residual block is written as its layers ("parts"): a part takes and returns
`(h, block_input)` so that the residual can cross a stage boundary. With `per_block` staging a
block's parts run inside one stage (`Chain`); with `per_layer` every convolution is a stage.
The ImageNet variant has a 7x7 stride-2 stem and a max-pool; the CIFAR variant a 3x3 stem and
no pool. Bottleneck blocks put the stride on the 3x3 convolution (torchvision's ResNet v1.5).
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def _batch_norm(train: bool, name: str | None = None) -> nn.BatchNorm:
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)


def _conv(features: int, size: int, strides: int = 1, name: str | None = None) -> nn.Conv:
  return nn.Conv(features, (size, size), (strides, strides), padding=[(size // 2, size // 2)] * 2,
                 use_bias=False, kernel_init=nn.initializers.kaiming_normal(), name=name)


class Stem(nn.Module):
  """Convolution, BatchNorm, ReLU; ImageNet adds a 7x7 stride-2 kernel and a 3x3 max-pool."""

  features: int
  imagenet: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = _conv(self.features, 7 if self.imagenet else 3, 2 if self.imagenet else 1)(x)
    x = nn.relu(_batch_norm(train)(x))
    if self.imagenet:
      x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    return x


class BlockIn(nn.Module):
  """The first convolution of a block: `x -> (relu(bn(conv(x))), x)`."""

  features: int
  size: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, jax.Array]:
    h = _conv(self.features, self.size, self.strides, name="conv")(x)
    return nn.relu(_batch_norm(train, "bn")(h)), x


class BlockMid(nn.Module):
  """A middle convolution of a bottleneck block: `(h, x) -> (relu(bn(conv(h))), x)`."""

  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, inputs, train: bool) -> tuple[jax.Array, jax.Array]:
    h, x = inputs
    h = _conv(self.features, 3, self.strides, name="conv")(h)
    return nn.relu(_batch_norm(train, "bn")(h)), x


class BlockOut(nn.Module):
  """The last convolution and the residual: `(h, x) -> relu(bn(conv(h)) + shortcut(x))`.

  The shortcut is a strided 1x1 convolution with BatchNorm when the shape changes.
  """

  features: int
  size: int
  strides: int = 1

  @nn.compact
  def __call__(self, inputs, train: bool) -> jax.Array:
    h, x = inputs
    h = _batch_norm(train, "bn")(_conv(self.features, self.size, name="conv")(h))
    if x.shape != h.shape:
      x = _conv(self.features, 1, self.strides, name="shortcut_conv")(x)
      x = _batch_norm(train, "shortcut_bn")(x)
    return nn.relu(h + x)


class Chain(nn.Module):
  """Parts of one block run as one stage."""

  parts: Sequence[nn.Module]

  def __call__(self, x, train: bool):
    for part in self.parts:
      x = part(x, train=train)
    return x


class Head(nn.Module):
  """Global average pooling and the classifier."""

  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def basic_block(features: int, strides: int) -> list[nn.Module]:
  return [BlockIn(features, 3, strides), BlockOut(features, 3, strides)]


def bottleneck_block(features: int, strides: int) -> list[nn.Module]:
  return [BlockIn(features, 1), BlockMid(features, strides), BlockOut(4 * features, 1, strides)]


def resnet(
    blocks_per_width: Sequence[int],
    widths: Sequence[int],
    num_classes: int,
    *,
    bottleneck: bool = False,
    imagenet: bool = False,
    granularity: str = "per_block",
) -> list[nn.Module]:
  """Stem, residual blocks (stride 2 entering each width after the first), head."""
  make_block = bottleneck_block if bottleneck else basic_block
  modules: list[nn.Module] = [Stem(widths[0], imagenet)]
  for width_idx, (width, count) in enumerate(zip(widths, blocks_per_width)):
    for block_idx in range(count):
      strides = 2 if width_idx > 0 and block_idx == 0 else 1
      parts = make_block(width, strides)
      modules.extend(parts if granularity == "per_layer" else [Chain(tuple(parts))])
  modules.append(Head(num_classes))
  return modules


def resnet18(num_classes: int, imagenet: bool, granularity: str) -> list[nn.Module]:
  return resnet((2, 2, 2, 2), (64, 128, 256, 512), num_classes, imagenet=imagenet,
                granularity=granularity)


def resnet50(num_classes: int, imagenet: bool, granularity: str) -> list[nn.Module]:
  return resnet((3, 4, 6, 3), (64, 128, 256, 512), num_classes, bottleneck=True,
                imagenet=imagenet, granularity=granularity)


def small_resnet(widths: Sequence[int], blocks_per_stage: int, num_classes: int,
                 granularity: str = "per_block") -> list[nn.Module]:
  """The digits task's CIFAR-style ResNet: one width per stage of basic blocks."""
  return resnet([blocks_per_stage] * len(widths), widths, num_classes, granularity=granularity)
