"""The LSTM classifier of the paper's IMDb appendix: embedding, 2 LSTM layers of 256, classifier.

One stage per layer; the classifier reads the last time step of the top layer.
"""

import flax.linen as nn
import jax


class Embedding(nn.Module):
  vocab_size: int
  features: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    return nn.Embed(self.vocab_size, self.features)(tokens)  # [B, T, E]


class LSTMLayer(nn.Module):
  """`[B, T, F] -> [B, T, H]`, scanned over time."""

  hidden_size: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.RNN(nn.OptimizedLSTMCell(self.hidden_size))(x)


class Classifier(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, h: jax.Array) -> jax.Array:
    return nn.Dense(self.num_classes)(h[:, -1])  # the last time step


def lstm_classifier(vocab_size: int, hidden_size: int, num_layers: int,
                    num_classes: int) -> list[nn.Module]:
  return [Embedding(vocab_size, hidden_size),
          *[LSTMLayer(hidden_size) for _ in range(num_layers)],
          Classifier(num_classes)]
