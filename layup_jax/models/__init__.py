"""Models by name: each builder turns `config.model` into a `StagedModel`.

Owns: the staged-model API users build their own models with (`staged`: `StagedModel`, `Tie`,
`group_stages`), the ResNets (`resnet`), GPT-2 (`gpt2`, and its Hugging Face weight import
`gpt2_import`) and the LSTM (`lstm`). Imports Flax and jax only: every other package may import
it. `python -m layup_jax.models` prints each model's stages.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from layup_jax.models import gpt2, gpt2_import, lstm, resnet
from layup_jax.models.staged import StagedModel, group_stages

GRANULARITIES = ("per_block", "per_layer")
VARIANTS = ("cifar", "imagenet")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  build: Callable[[ml_collections.ConfigDict], StagedModel]
  example_inputs: Callable[[ml_collections.ConfigDict, int], np.ndarray]  # config, batch
  # (config, model, example inputs) -> per-stage params from config.pretrained, if supported
  load_pretrained: Callable | None = None


def _images(height: int, channels: int = 3):
  return lambda config, batch: np.zeros((batch, height, height, channels), np.float32)


def _resnet_images(config, batch):
  return _images(224 if config.variant == "imagenet" else 32)(config, batch)


def _tokens(config, batch):
  return np.zeros((batch, min(config.max_len, 16)), np.int32)


def _resnet(factory):
  def build(config):
    return StagedModel(factory(config.num_classes, config.variant == "imagenet",
                               config.granularity))
  return build


_REGISTRY: dict[str, ModelEntry] = {
    "digits_resnet": ModelEntry(
        lambda c: StagedModel(resnet.small_resnet(tuple(c.widths), c.blocks_per_stage,
                                                  c.num_classes, c.granularity)),
        _images(8, 1)),
    "resnet18": ModelEntry(_resnet(resnet.resnet18), _resnet_images),
    "resnet50": ModelEntry(_resnet(resnet.resnet50), _resnet_images),
    "gpt2": ModelEntry(
        lambda c: gpt2.gpt2(c.size, c.vocab_size, c.max_len, c.dropout, DTYPES[c.dtype],
                            c.granularity, c.vocab_multiple, c.attention),
        _tokens,
        lambda c, model, inputs: gpt2_import.load_gpt2_params(
            model, inputs, c.pretrained, per_layer=c.granularity == "per_layer",
            vocab_size=c.vocab_size)),
    "lstm": ModelEntry(
        lambda c: StagedModel(lstm.lstm_classifier(c.vocab_size, c.hidden_size, c.num_layers,
                                                   c.num_classes)),
        _tokens),
}


def register(name: str, builder: Callable[[ml_collections.ConfigDict], StagedModel],
             example_inputs: Callable[[ml_collections.ConfigDict, int], np.ndarray] | None = None
             ) -> None:
  """Makes `config.model.name = name` build `builder(config.model)` (bring your own model)."""
  _REGISTRY[name] = ModelEntry(builder, example_inputs or _images(8, 1))


def names() -> list[str]:
  return sorted(_REGISTRY)


def make_model(config: ml_collections.ConfigDict) -> StagedModel:
  """The staged model that `config.model` names, its stages grouped by
  `config.stages_per_group` (`stages.group_stages`)."""
  return group_stages(_REGISTRY[config.name].build(config), config.get("stages_per_group", 1))


def example_inputs(config: ml_collections.ConfigDict, batch: int) -> np.ndarray:
  """A zero batch of the model's input shape, for shapes and parameter counts."""
  return _REGISTRY[config.name].example_inputs(config, batch)


def supports_pretrained(name: str) -> bool:
  return _REGISTRY[name].load_pretrained is not None


def load_pretrained(config: ml_collections.ConfigDict, model: StagedModel,
                    inputs: np.ndarray) -> list:
  """Per-stage params read from `config.pretrained`."""
  return _REGISTRY[config.name].load_pretrained(config, model, inputs)
