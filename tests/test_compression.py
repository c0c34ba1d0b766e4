"""Compressed sends: each codec's rounding is bounded, and error feedback makes the mass a
device's compressed sends carry equal the mass it meant to send, less one residual."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layup_jax.pushsum import compression


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_round_trip_is_within_the_codecs_rounding(codec):
  rng = np.random.default_rng(0)
  # Blocks of very different magnitudes, as in a packed stage (conv weights beside gammas).
  x = jnp.asarray(np.concatenate([rng.normal(size=300) * 1e-3, rng.normal(size=700)]),
                  jnp.float32).reshape(10, 100)
  back = compression.decode_leaf(compression.encode_leaf(x, codec), x, codec)
  assert back.shape == x.shape and back.dtype == x.dtype
  error = np.abs(np.asarray(back - x)).ravel()
  if codec == "bf16":  # 8 significant bits: half an ulp, relative
    assert np.all(error <= np.abs(np.asarray(x)).ravel() * 2.0 ** -8)
  else:  # half a step of each block's own scale
    blocks = np.pad(np.asarray(x).ravel(), (0, (-x.size) % compression.BLOCK))
    scales = np.abs(blocks.reshape(-1, compression.BLOCK)).max(axis=1) / 127
    step = np.repeat(scales, compression.BLOCK)[:x.size]
    assert np.all(error <= step / 2 * (1 + 1e-6))
    # The first block holds only the small values: rounded on their own scale.
    assert error[:256].max() < 1e-2 * error[700:].max()
    # An array smaller than a block travels in its own size, with one scale.
    small = jnp.arange(5.0)
    q, scale = compression.encode_leaf(small, codec)
    assert q.size == 5 and scale.size == 1


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_error_feedback_sends_the_intended_mass_less_one_residual(codec):
  """Sends of a drifting stage with varying push-sum amounts: the mass received,
  sum_k a_k c_k, equals sum_k a_k x_k minus the residual held at the end, and that residual
  stays within one send's rounding (it does not accumulate)."""
  rng = np.random.default_rng(1)
  x = {"w": jnp.asarray(rng.normal(size=(40, 30)), jnp.float32)}
  residual = jax.tree.map(jnp.zeros_like, x)
  intended = received = jax.tree.map(lambda v: np.zeros(v.shape), x)
  template = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), x)
  worst = 0.0
  for k in range(200):
    x = jax.tree.map(lambda v: v + 0.01 * jnp.asarray(rng.normal(size=v.shape), jnp.float32), x)
    amount = float(0.5 ** rng.integers(1, 8))
    wire, residual = compression.encode(x, residual, np.float32(amount), codec)
    sent = compression.decode(wire, template, codec)
    intended = jax.tree.map(lambda t, v, a=amount: t + a * np.asarray(v, np.float64),
                            intended, x)
    received = jax.tree.map(lambda t, v, a=amount: t + a * np.asarray(v, np.float64),
                            received, sent)
    worst = max(worst, float(jnp.abs(residual["w"]).max()))
    if k == 0:  # without feedback, what one send leaves out
      one_send = float(np.abs(intended["w"] - received["w"]).max())
  chex.assert_trees_all_close(
      received, jax.tree.map(lambda t, e: t - np.asarray(e, np.float64), intended, residual),
      atol=1e-5)
  assert worst <= 2 * max(one_send, 1e-6) * 2 ** 7  # bounded by the largest amount's rounding


def test_only_parameters_are_compressed_and_statistics_travel_as_they_are():
  params = {"w": jnp.ones((3, 4)), "step": jnp.array(3, jnp.int32)}
  state = {"mean": jnp.full((4,), 0.123456789)}
  template = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), (params, state))
  residual = jax.tree.map(jnp.zeros_like, params)
  wire, new_residual = compression.encode((params, state), residual, np.float32(0.5), "int8")
  assert wire[0]["w"][0].dtype == jnp.int8 and wire[0]["step"].dtype == jnp.int32
  assert wire[1] is state
  assert jax.tree.structure(new_residual) == jax.tree.structure(params)
  back = compression.decode(wire, template, "int8")
  chex.assert_trees_all_equal(back[1], state)
  chex.assert_trees_all_close(back[0], params, atol=1e-6)
  shapes = compression.wire_template(template, "int8")
  assert jax.tree.map(lambda v: (v.shape, v.dtype), shapes) == jax.tree.map(
      lambda v: (v.shape, v.dtype), wire)


def test_settle_gives_each_replica_back_its_residual_over_its_weight():
  devices = jax.devices()[:2]
  template = {"w": jax.ShapeDtypeStruct((5,), jnp.float32)}
  compressor = compression.Compressor("bf16", [template], devices)
  x = jax.device_put({"w": jnp.asarray([1.0, 1 / 3, 2 / 3, 1e-3, 7.77])}, devices[1])
  compressor.encode(1, 0, x, 0.25)
  held = compressor.residual_mass(0)
  assert np.abs(held["w"]).max() > 0  # 1/3 is not a bf16 value
  added = {}
  compressor.settle(lambda i, s: [0.5, 0.125][i], lambda i, s, d: added.__setitem__(i, d))
  np.testing.assert_allclose(np.asarray(added[1]["w"]), held["w"] / 0.125, rtol=1e-6)
  assert np.asarray(added[0]["w"]).max() == 0
  assert added[1]["w"].devices() == {devices[1]}
  assert np.abs(compressor.residual_mass(0)["w"]).max() == 0


def test_an_unknown_codec_is_refused():
  with pytest.raises(ValueError, match="compression must be one of"):
    compression.Compressor("fp4", [], [])
