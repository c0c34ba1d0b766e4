"""Models by name: each builder turns `config.model` into a StagedModel."""

from collections.abc import Callable

import ml_collections

from layup_jax.models import resnet
from layup_jax.stages import StagedModel


def _digits_resnet(config: ml_collections.ConfigDict) -> StagedModel:
  return StagedModel(
      resnet.small_resnet(tuple(config.widths), config.blocks_per_stage, config.num_classes)
  )


_REGISTRY: dict[str, Callable[[ml_collections.ConfigDict], StagedModel]] = {
    "digits_resnet": _digits_resnet,
}


def register(name: str, builder: Callable[[ml_collections.ConfigDict], StagedModel]) -> None:
  """Makes `config.model.name = name` build `builder(config.model)` (bring your own model)."""
  _REGISTRY[name] = builder


def names() -> list[str]:
  return sorted(_REGISTRY)


def make_model(config: ml_collections.ConfigDict) -> StagedModel:
  """The staged model that `config.model` names."""
  return _REGISTRY[config.name](config)
