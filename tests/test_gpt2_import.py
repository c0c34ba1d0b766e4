"""GPT-2 import: a checkpoint in the Hugging Face layout gives the logits of an independent NumPy
forward pass of the same weights."""

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from layup_jax import defaults, models
from layup_jax.models import gpt2_import

VOCAB, CTX, DIM, HEADS, LAYERS = 48, 16, 64, 4, 2  # the "tiny" size


def write_checkpoint(directory, seed=0, prefix="transformer."):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.2 * rng.normal(size=shape)).astype(np.float32)
  tensors = {"wte.weight": normal(VOCAB, DIM), "wpe.weight": normal(CTX, DIM),
             "ln_f.weight": 1 + normal(DIM), "ln_f.bias": normal(DIM)}
  for i in range(LAYERS):
    tensors.update({
        f"h.{i}.ln_1.weight": 1 + normal(DIM), f"h.{i}.ln_1.bias": normal(DIM),
        f"h.{i}.attn.c_attn.weight": normal(DIM, 3 * DIM),
        f"h.{i}.attn.c_attn.bias": normal(3 * DIM),
        f"h.{i}.attn.c_proj.weight": normal(DIM, DIM), f"h.{i}.attn.c_proj.bias": normal(DIM),
        f"h.{i}.ln_2.weight": 1 + normal(DIM), f"h.{i}.ln_2.bias": normal(DIM),
        f"h.{i}.mlp.c_fc.weight": normal(DIM, 4 * DIM), f"h.{i}.mlp.c_fc.bias": normal(4 * DIM),
        f"h.{i}.mlp.c_proj.weight": normal(4 * DIM, DIM), f"h.{i}.mlp.c_proj.bias": normal(DIM),
        f"h.{i}.attn.bias": np.tril(np.ones((CTX, CTX), np.float32))[None, None],  # a buffer
    })
  save_file({prefix + k: v for k, v in tensors.items()}, str(directory / "model.safetensors"))
  return tensors


def numpy_gpt2_logits(t, tokens):
  """GPT-2's forward pass written from the paper's description, in float64 NumPy."""
  t = {k: v.astype(np.float64) for k, v in t.items()}

  def layer_norm(x, name):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * t[name + ".weight"] + t[name + ".bias"]

  def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

  batch, length = tokens.shape
  h = t["wte.weight"][tokens] + t["wpe.weight"][:length][None]  # [B, T, D]
  causal = np.tril(np.ones((length, length), bool))
  for i in range(LAYERS):
    p = f"h.{i}."
    x = layer_norm(h, p + "ln_1") @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
    q, k, v = np.split(x, 3, axis=-1)
    split = lambda a: a.reshape(batch, length, HEADS, DIM // HEADS).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)  # [B, nh, T, hs]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(DIM // HEADS)
    scores = np.where(causal, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    y = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, length, DIM)
    h = h + y @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
    x = gelu(layer_norm(h, p + "ln_2") @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"])
    h = h + x @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
  return layer_norm(h, "ln_f") @ t["wte.weight"].T


def tiny_config(directory, granularity="per_block"):
  config = defaults.get_config().model
  config.update({"name": "gpt2", "size": "tiny", "vocab_size": VOCAB, "max_len": CTX,
                     "granularity": granularity, "pretrained": str(directory)})
  return config


@pytest.mark.parametrize("granularity", ["per_block", "per_layer"])
@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_imported_weights_give_the_numpy_logits(tmp_path, granularity, prefix):
  tensors = write_checkpoint(tmp_path, prefix=prefix)
  config = tiny_config(tmp_path, granularity)
  model = models.make_model(config)
  tokens = np.random.default_rng(1).integers(0, VOCAB, (3, 12)).astype(np.int32)
  params = models.load_pretrained(config, model, tokens)
  _, state = model.init(jax.random.key(0), tokens)
  logits, _ = model.apply(params, state, tokens, jax.random.key(0), 0, train=False)
  want = numpy_gpt2_logits(tensors, tokens)
  np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=1e-4)
  assert np.abs(want).max() > 1.0  # the comparison is not between two near-zero arrays


def test_a_missing_checkpoint_and_a_wrong_size_say_so(tmp_path):
  config = tiny_config(tmp_path / "nowhere")
  model = models.make_model(config)
  tokens = np.zeros((1, 4), np.int32)
  with pytest.raises(FileNotFoundError, match="no GPT-2 checkpoint at .*nowhere/model.safetensors"):
    models.load_pretrained(config, model, tokens)

  write_checkpoint(tmp_path)
  wrong = tiny_config(tmp_path)
  wrong.vocab_size = VOCAB + 1
  with pytest.raises(ValueError, match=r"'wte.weight' has shape \(48, 64\), the model expects "
                                       r"\(49, 64\)"):
    models.load_pretrained(wrong, models.make_model(wrong), tokens)

  shallow = tiny_config(tmp_path)
  model = models.make_model(shallow)
  prefixes = gpt2_import.stage_prefixes(model.num_stages, per_layer=False)
  assert prefixes == ["", "h.0.", "h.1.", ""]


def _tiny(vocab_multiple, attention="auto"):
  config = defaults.get_config().model
  config.update({"name": "gpt2", "size": "tiny", "vocab_size": VOCAB, "max_len": CTX,
                 "vocab_multiple": vocab_multiple, "attention": attention})
  return config


def test_a_padded_vocabulary_leaves_the_logits_and_the_loss_as_they_were():
  """64 rows for 48 tokens: the padded rows (random here, not zero) change no real token's
  logit, the loss or its gradient, and no padded token is ever the most likely."""
  plain, padded = models.make_model(_tiny(0)), models.make_model(_tiny(64))
  tokens = np.random.default_rng(1).integers(0, VOCAB, (3, 12)).astype(np.int32)
  labels = np.roll(tokens, -1, axis=1)
  params, state = plain.init(jax.random.key(0), tokens)
  padded_params, _ = padded.init(jax.random.key(0), tokens)
  assert padded_params[0]["wte"]["embedding"].shape == (64, DIM)
  extra = 0.5 * np.random.default_rng(2).normal(size=(64 - VOCAB, DIM)).astype(np.float32)
  padded_params = [dict(p) for p in params]
  padded_params[0] = {**params[0], "wte": {"embedding": np.concatenate(
      [params[0]["wte"]["embedding"], extra])}}
  key = jax.random.key(0)
  logits, _ = plain.apply(params, state, tokens, key, 0, train=False)
  padded_logits, _ = padded.apply(padded_params, state, tokens, key, 0, train=False)
  np.testing.assert_allclose(np.asarray(padded_logits)[..., :VOCAB], np.asarray(logits),
                             atol=1e-5, rtol=1e-5)
  assert int(np.asarray(padded_logits).argmax(-1).max()) < VOCAB
  loss = lambda model, p: model.loss(p, state, tokens, labels, key, 0)[0]
  np.testing.assert_allclose(float(loss(padded, padded_params)), float(loss(plain, params)),
                             atol=1e-5, rtol=1e-5)
  grads = jax.grad(lambda p: loss(padded, p))(padded_params)
  plain_grads = jax.grad(lambda p: loss(plain, p))(params)
  wte_grad = np.asarray(grads[0]["wte"]["embedding"])
  np.testing.assert_allclose(wte_grad[:VOCAB], np.asarray(plain_grads[0]["wte"]["embedding"]),
                             atol=1e-5, rtol=1e-5)
  assert not wte_grad[VOCAB:].any()  # the padded rows learn nothing


def test_a_checkpoint_imported_into_a_padded_vocabulary_gives_the_numpy_logits(tmp_path):
  tensors = write_checkpoint(tmp_path)
  config = _tiny(64)
  config.pretrained = str(tmp_path)
  model = models.make_model(config)
  tokens = np.random.default_rng(1).integers(0, VOCAB, (3, 12)).astype(np.int32)
  params = models.load_pretrained(config, model, tokens)
  wte = np.asarray(params[0]["wte"]["embedding"])
  assert wte.shape == (64, DIM) and not wte[VOCAB:].any()
  _, state = model.init(jax.random.key(0), tokens)
  logits, _ = model.apply(params, state, tokens, jax.random.key(0), 0, train=False)
  np.testing.assert_allclose(np.asarray(logits)[..., :VOCAB], numpy_gpt2_logits(tensors, tokens),
                             atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_attention_on_the_cpu_is_xlas(attention):
  """On CPU devices "auto" is XLA's attention: the same logits, bit for bit."""
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12)).astype(np.int32)
  chosen, xla = models.make_model(_tiny(0, attention)), models.make_model(_tiny(0, "xla"))
  params, state = xla.init(jax.random.key(0), tokens)
  key = jax.random.key(0)
  np.testing.assert_array_equal(
      np.asarray(chosen.apply(params, state, tokens, key, 0, train=False)[0]),
      np.asarray(xla.apply(params, state, tokens, key, 0, train=False)[0]))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's attention needs a GPU")
def test_cudnn_attention_matches_xlas_to_bf16_tolerance():
  config = _tiny(0, "cudnn")
  config.dtype = "bfloat16"
  tokens = np.random.default_rng(1).integers(0, VOCAB, (4, CTX)).astype(np.int32)
  cudnn = models.make_model(config)
  config.attention = "xla"
  xla = models.make_model(config)
  params, state = xla.init(jax.random.key(0), tokens)
  key = jax.random.key(0)
  np.testing.assert_allclose(
      np.asarray(cudnn.apply(params, state, tokens, key, 0, train=False)[0]),
      np.asarray(xla.apply(params, state, tokens, key, 0, train=False)[0]), atol=2e-2, rtol=2e-2)
