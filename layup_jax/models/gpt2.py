"""GPT-2 (Radford et al. 2019) as stages: embedding, one stage per block, final LayerNorm + head.

Decoder-only, pre-LayerNorm, learned positions, GELU (tanh form, as GPT-2), causal attention
through `jax.nn.dot_product_attention`, dropout on embeddings and residual branches. Parameter
names follow the Hugging Face checkpoint (`wte`, `wpe`, `ln_1`, `attn.c_attn`, `attn.c_proj`,
`ln_2`, `mlp.c_fc`, `mlp.c_proj`, `ln_f`), so importing one is a rename.

The output projection is the token embedding `wte`. It lives only in the embedding stage and the
head stage reads it through a `Tie` (layup_jax/models/staged.py): both stages' gradients reach
the one matrix, which is updated once per iteration and merged once.
With `dtype=bfloat16` activations and matmuls run in bf16 while params stay float32.

`vocab_multiple` pads the vocabulary (the embedding's rows, the head's logits) to a multiple of
64 or 128, the matrix shapes the GPU's matmul units take whole (50,257 becomes 50,304): the
padded tokens never occur, their logits are masked out of the softmax, so the loss and the real
tokens' logits are those of the unpadded model. `attention` chooses `jax.nn.dot_product_attention`'s
implementation: "xla", "cudnn" (flash attention; GPUs only, bf16 or fp16), or "auto" (cuDNN where
the devices are GPUs and it takes these shapes, else XLA).
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from layup_jax.models.staged import StagedModel, Tie


@dataclasses.dataclass(frozen=True)
class GPT2Size:
  num_layers: int
  embed_dim: int
  num_heads: int


SIZES = {
    "tiny": GPT2Size(2, 64, 4),
    "mini": GPT2Size(4, 64, 4),
    "gpt2": GPT2Size(12, 768, 12),
    "gpt2-medium": GPT2Size(24, 1024, 16),
    "gpt2-large": GPT2Size(36, 1280, 20),
    "gpt2-xl": GPT2Size(48, 1600, 25),
}

_INIT = nn.initializers.normal(0.02)
ATTENTION = ("auto", "xla", "cudnn")  # config.model.attention


def padded_vocab(vocab_size: int, multiple: int) -> int:
  """`vocab_size` rounded up to a multiple of `multiple` (0 or 1: unchanged)."""
  return vocab_size if multiple <= 1 else math.ceil(vocab_size / multiple) * multiple


def attend(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str) -> jax.Array:
  """Causal attention `[B, T, nh, hs]` by the named implementation; "auto" takes cuDNN's where
  the devices are GPUs and it accepts the call, else XLA's (decided when traced)."""
  if implementation == "auto":
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
      try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
      except (NotImplementedError, RuntimeError, ValueError, TypeError):
        pass  # a shape or dtype cuDNN does not take: XLA's
    implementation = "xla"
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


class Embedding(nn.Module):
  """Token and position embeddings: `tokens [B, T] -> h [B, T, D]`."""

  vocab_size: int
  max_len: int
  embed_dim: int
  dropout: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
    wte = nn.Embed(self.vocab_size, self.embed_dim, embedding_init=_INIT, name="wte")
    wpe = nn.Embed(self.max_len, self.embed_dim, embedding_init=nn.initializers.normal(0.01),
                   name="wpe")
    h = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]  # [B, T, D]
    return nn.Dropout(self.dropout, deterministic=not train)(h).astype(self.dtype)


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention: `c_attn` makes q, k, v; `c_proj` mixes the heads."""

  num_heads: int
  num_layers: int
  dtype: jnp.dtype
  attention: str = "auto"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, dim = x.shape
    head_dim = dim // self.num_heads
    qkv = nn.Dense(3 * dim, dtype=self.dtype, kernel_init=_INIT, name="c_attn")(x)  # [B, T, 3D]
    qkv = qkv.reshape(batch, length, 3, self.num_heads, head_dim)  # [B, T, 3, nh, hs]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, nh, hs]
    y = attend(q, k, v, self.attention)  # [B, T, nh, hs]
    return nn.Dense(dim, dtype=self.dtype, kernel_init=_proj_init(self.num_layers),
                    name="c_proj")(y.reshape(batch, length, dim))


class FeedForward(nn.Module):
  """`c_proj(gelu(c_fc(x)))` with a 4x hidden width."""

  num_layers: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.Dense(4 * x.shape[-1], dtype=self.dtype, kernel_init=_INIT, name="c_fc")(x)
    return nn.Dense(x.shape[-1], dtype=self.dtype, kernel_init=_proj_init(self.num_layers),
                    name="c_proj")(jax.nn.gelu(h, approximate=True))


def _proj_init(num_layers: int):
  """GPT-2 scales the residual projections by 1/sqrt(2 L)."""
  return nn.initializers.normal(0.02 / (2 * num_layers) ** 0.5)


def _attention_branch(h, num_heads, num_layers, dropout, dtype, train, attention):
  """`h + attn(ln_1(h))`; called inside a compact method, so its layers belong to the caller."""
  y = CausalSelfAttention(num_heads, num_layers, dtype, attention, name="attn")(
      nn.LayerNorm(1e-5, dtype=dtype, name="ln_1")(h))
  return h + nn.Dropout(dropout, deterministic=not train)(y)


def _mlp_branch(h, num_layers, dropout, dtype, train):
  """`h + mlp(ln_2(h))`, likewise."""
  y = FeedForward(num_layers, dtype, name="mlp")(nn.LayerNorm(1e-5, dtype=dtype, name="ln_2")(h))
  return h + nn.Dropout(dropout, deterministic=not train)(y)


class Block(nn.Module):
  """A transformer block, or one half of it, as one stage.

  `halves=("attn", "mlp")` is the whole block (per_block granularity); per_layer granularity
  makes one stage of `("attn",)` and one of `("mlp",)`.
  """

  num_heads: int
  num_layers: int
  dropout: float
  dtype: jnp.dtype
  halves: tuple[str, ...] = ("attn", "mlp")
  attention: str = "auto"

  @nn.compact
  def __call__(self, h: jax.Array, train: bool) -> jax.Array:
    if "attn" in self.halves:
      h = _attention_branch(h, self.num_heads, self.num_layers, self.dropout, self.dtype, train,
                            self.attention)
    if "mlp" in self.halves:
      h = _mlp_branch(h, self.num_layers, self.dropout, self.dtype, train)
    return h


class Head(nn.Module):
  """`(h, wte) -> logits [B, T, V]` in float32: final LayerNorm, then the tied projection. With
  a padded `wte` (more rows than `vocab_size`) the padded tokens' logits are masked to the
  float32 minimum: no probability, no gradient, never an argmax."""

  dtype: jnp.dtype
  vocab_size: int | None = None  # the real vocabulary; None: every row of wte

  @nn.compact
  def __call__(self, inputs) -> jax.Array:
    h, wte = inputs
    x = nn.LayerNorm(1e-5, dtype=self.dtype, name="ln_f")(h)
    logits = jnp.einsum("btd,vd->btv", x, wte.astype(self.dtype)).astype(jnp.float32)
    if self.vocab_size is None or self.vocab_size == wte.shape[0]:
      return logits
    real = jnp.arange(wte.shape[0]) < self.vocab_size  # [V_padded]
    return jnp.where(real, logits, jnp.finfo(jnp.float32).min)


def gpt2(size: str, vocab_size: int, max_len: int, dropout: float = 0.0,
         dtype: jnp.dtype = jnp.float32, granularity: str = "per_block",
         vocab_multiple: int = 0, attention: str = "auto") -> StagedModel:
  """The staged GPT-2 of a named size; `Tie` shares `wte` between stage 0 and the head."""
  spec = SIZES[size]
  halves = [("attn",), ("mlp",)] if granularity == "per_layer" else [("attn", "mlp")]
  blocks = [Block(spec.num_heads, spec.num_layers, dropout, dtype, half, attention)
            for _ in range(spec.num_layers) for half in halves]
  rows = padded_vocab(vocab_size, vocab_multiple)
  modules = [Embedding(rows, max_len, spec.embed_dim, dropout, dtype), *blocks,
             Head(dtype, vocab_size if rows != vocab_size else None)]
  tie = Tie(owner=0, consumer=len(modules) - 1, path=("wte", "embedding"))
  return StagedModel(modules, ties=(tie,))
