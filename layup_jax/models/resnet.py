"""A small CIFAR-style ResNet, staged as stem, one stage per basic block, and head."""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def _batch_norm(train: bool) -> nn.BatchNorm:
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)


class Stem(nn.Module):
  """3x3 convolution, BatchNorm, ReLU; no max-pool (CIFAR variant)."""

  features: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(x)
    return nn.relu(_batch_norm(train)(x))


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual; a 1x1 projection when the shape changes."""

  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    residual = x
    y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), padding="SAME",
                use_bias=False)(x)
    y = nn.relu(_batch_norm(train)(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(y)
    y = _batch_norm(train)(y)
    if residual.shape != y.shape:
      residual = nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(x)
      residual = _batch_norm(train)(residual)
    return nn.relu(y + residual)


class Head(nn.Module):
  """Global average pooling and the classifier."""

  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def small_resnet(widths: Sequence[int], blocks_per_stage: int, num_classes: int) -> list[nn.Module]:
  """Stem, then `blocks_per_stage` basic blocks per width (stride 2 entering each later width)."""
  modules: list[nn.Module] = [Stem(widths[0])]
  for width_idx, width in enumerate(widths):
    for block_idx in range(blocks_per_stage):
      strides = 2 if width_idx > 0 and block_idx == 0 else 1
      modules.append(BasicBlock(width, strides))
  modules.append(Head(num_classes))
  return modules
