"""GPT-2 weights from and to a local Hugging Face style checkpoint directory (no downloads).

The directory holds `model.safetensors` with the standard names
(`transformer.h.N.attn.c_attn.weight` and so on; the `transformer.` prefix may be absent). Our
parameter names follow the checkpoint, so the import is a rename: `weight` is Flax's `kernel`,
`scale` or `embedding`, and block N's layers live in the stage(s) of layer N. GPT-2's Conv1D stores
kernels as [in, out], as Flax's Dense does, so nothing is transposed. Every parameter must be found
with its shape, and every tensor of the checkpoint must be used (buffers such as `attn.bias` and
the tied `lm_head.weight` aside). A model with a padded vocabulary (`model.vocab_multiple`) takes
the checkpoint's `wte` in its first rows; the padded rows are zero (their logits are masked).
`save_gpt2_params` writes the same layout (and Hugging Face's `config.json`), so a model
trained here goes back to it and, through `model.pretrained`, into another run.
"""

import pathlib

import jax
import numpy as np

from layup_jax.models.staged import StagedModel

_RENAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


def stage_prefixes(num_stages: int, per_layer: bool) -> list[str]:
  """The checkpoint prefix of each stage: '' for embedding and head, 'h.N.' for layer N."""
  blocks = num_stages - 2
  layer = (lambda s: (s - 1) // 2) if per_layer else (lambda s: s - 1)
  return [""] + [f"h.{layer(s)}." for s in range(1, blocks + 1)] + [""]


def checkpoint_name(prefix: str, path: tuple[str, ...]) -> str:
  return prefix + ".".join([*path[:-1], _RENAMES[path[-1]]])


def read_checkpoint(directory: str | pathlib.Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  file = pathlib.Path(directory) / "model.safetensors"
  if not file.is_file():
    raise FileNotFoundError(
        f"no GPT-2 checkpoint at {file}: config.model.pretrained must be a local directory "
        "holding a Hugging Face style model.safetensors (nothing is downloaded)"
    )
  tensors = load_file(str(file))
  return {name.removeprefix("transformer."): value for name, value in tensors.items()}


def load_gpt2_params(model: StagedModel, example_tokens: np.ndarray, directory,
                     per_layer: bool = False, vocab_size: int | None = None) -> list:
  """Per-stage params of `model` filled from the checkpoint in `directory`; `vocab_size`, the
  real vocabulary of a model whose embedding is padded beyond it (`model.vocab_multiple`)."""
  tensors = read_checkpoint(directory)
  abstract, _ = jax.eval_shape(lambda: model.init(jax.random.key(0), example_tokens))
  prefixes = stage_prefixes(model.num_stages, per_layer)
  used, params = set(), []
  for prefix, stage in zip(prefixes, abstract):
    def fill(path, leaf, prefix=prefix):
      keys = tuple(getattr(k, "key", k) for k in path)
      name = checkpoint_name(prefix, keys)
      if name not in tensors:
        raise ValueError(f"GPT-2 checkpoint {directory} has no tensor {name!r} "
                         f"(expected shape {leaf.shape}); is config.model.size right?")
      value = tensors[name]
      if (name == "wte.weight" and value.shape[0] == vocab_size < leaf.shape[0]
          and value.shape[1:] == leaf.shape[1:]):  # a padded vocabulary: its padding stays zero
        value = np.concatenate(
            [value, np.zeros((leaf.shape[0] - value.shape[0], *value.shape[1:]), value.dtype)])
      if value.shape != leaf.shape:
        raise ValueError(f"GPT-2 checkpoint tensor {name!r} has shape {value.shape}, the model "
                         f"expects {leaf.shape}: check config.model.size, vocab_size and max_len")
      used.add(name)
      return np.asarray(value, leaf.dtype)
    params.append(jax.tree_util.tree_map_with_path(fill, stage))
  unused = sorted(n for n in set(tensors) - used if not n.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ValueError(f"GPT-2 checkpoint {directory} has tensors the model does not use, e.g. "
                     f"{unused[:3]}: check config.model.size")
  return params


def save_gpt2_params(model: StagedModel, params: list, model_config,
                     directory: str | pathlib.Path) -> None:
  """Writes per-stage GPT-2 `params` to `directory` as Hugging Face's GPT-2 checkpoint: the
  tensors under their `transformer.` names (a padded `wte` cut to `model_config.vocab_size`
  rows) in `model.safetensors`, and `config.json` with the model's shape."""
  import json

  from safetensors.numpy import save_file

  from layup_jax.models.gpt2 import SIZES

  prefixes = stage_prefixes(model.num_stages, per_layer=model_config.granularity == "per_layer")
  tensors = {}
  for prefix, stage in zip(prefixes, params):
    for path, leaf in jax.tree_util.tree_flatten_with_path(stage)[0]:
      name = checkpoint_name(prefix, tuple(getattr(k, "key", k) for k in path))
      value = np.asarray(leaf, np.float32)
      if name == "wte.weight":
        value = value[:model_config.vocab_size]
      tensors[f"transformer.{name}"] = np.ascontiguousarray(value)
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  size = SIZES[model_config.size]
  (directory / "config.json").write_text(json.dumps({
      "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
      "vocab_size": int(model_config.vocab_size), "n_positions": int(model_config.max_len),
      "n_ctx": int(model_config.max_len), "n_embd": size.embed_dim,
      "n_layer": size.num_layers, "n_head": size.num_heads,
      "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
      "tie_word_embeddings": True}, indent=1))
