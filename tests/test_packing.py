"""Packed stages: one flat vector per stage, and a VJP's residuals in one buffer per dtype."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from layup_jax.runtime import packing

TREE = {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
                  "bias": np.array([7.0, 8.0], np.float32)},
        "scale": np.array(0.5, jnp.bfloat16)}


def test_a_stage_packs_into_one_vector_and_back_exactly():
  layout = packing.StagePacking.of(TREE)
  flat = jax.jit(layout.pack)(TREE)
  assert flat.shape == (9,) and flat.dtype == np.float32 == layout.dtype and layout.size == 9
  back = jax.jit(layout.unpack)(flat)
  chex.assert_trees_all_equal(back, TREE)
  assert back["scale"].dtype == jnp.bfloat16  # each leaf gets its dtype back
  # Equal layouts are equal keys (stages of one shape share their jitted functions).
  assert packing.StagePacking.of(TREE) == layout and hash(packing.StagePacking.of(TREE))
  empty = packing.StagePacking.of({})
  assert empty.pack({}).shape == (0,) and empty.unpack(empty.pack({})) == {}


def test_an_optax_step_on_the_packed_vector_equals_the_step_on_the_pytree():
  tree = {"a": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
          "b": np.ones(5, np.float32)}
  grads = jax.tree.map(lambda x: np.cos(3 * x), tree)
  layout = packing.StagePacking.of(tree)
  for tx in (optax.sgd(0.1, momentum=0.9), optax.adamw(1e-2, weight_decay=0.1),
             optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))):
    state, flat_state = tx.init(tree), tx.init(layout.pack(tree))
    params, flat = tree, layout.pack(tree)
    for _ in range(3):
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      flat_updates, flat_state = tx.update(layout.pack(grads), flat_state, flat)
      flat = optax.apply_updates(flat, flat_updates)
    chex.assert_trees_all_close(layout.unpack(flat), params, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("packed_up_to", [packing.RESIDUALS_PACKED_UP_TO, 0],
                         ids=["small residuals packed", "large residuals kept"])
def test_packed_residuals_give_the_same_gradients_with_fewer_arrays(packed_up_to, monkeypatch):
  monkeypatch.setattr(packing, "RESIDUALS_PACKED_UP_TO", packed_up_to)
  def stage(params, x, key):
    h = jnp.tanh(x @ params["w"]) * jax.random.bernoulli(key, 0.7, x.shape[:1] + (4,))
    return jnp.sum(h.astype(jnp.bfloat16).astype(jnp.float32) ** 2)

  params = {"w": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
  x, key = np.ones((5, 3), np.float32), jax.random.key(1)

  def forward(params, x):
    return jax.vjp(lambda p: stage(p, x, key), params)

  _, vjp = jax.jit(forward)(params, x)
  def packed_forward(params, x):
    out, vjp = forward(params, x)
    return out, packing.pack_residuals(vjp)

  _, packed = jax.jit(packed_forward)(params, x)
  if packed_up_to:
    assert len(jax.tree.leaves(packed)) < len(jax.tree.leaves(vjp))
  else:  # too large to copy: the same arrays
    assert len(jax.tree.leaves(packed)) == len(jax.tree.leaves(vjp))
  want = jax.jit(lambda v: v(1.0))(vjp)
  got = jax.jit(lambda p: packing.unpack_residuals(p)(1.0))(packed)
  chex.assert_trees_all_close(got, want)


def test_residuals_that_are_the_forward_inputs_are_passed_again_not_copied():
  def forward(w, x):
    y, vjp = jax.vjp(lambda w, x: jnp.tanh(x @ w), w, x)
    return y, packing.pack_residuals(vjp, (w, x)), packing.pack_residuals(vjp)

  w = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
  x = np.ones((5, 3), np.float32)
  _, stripped, copied = jax.jit(forward)(w, x)
  size = lambda residuals: sum(leaf.nbytes for leaf in jax.tree.leaves(residuals))
  assert size(copied) - size(stripped) == w.nbytes + x.nbytes
  dy = np.ones((5, 4), np.float32)
  got = jax.jit(lambda r, w, x: packing.unpack_residuals(r, (w, x))(dy))(stripped, w, x)
  want = jax.jit(lambda r: packing.unpack_residuals(r)(dy))(copied)
  chex.assert_trees_all_close(got, want)


def test_the_gradient_of_a_packed_stage_is_written_in_place_not_summed_from_padded_copies():
  layout = packing.StagePacking.of(TREE)
  weights = jax.tree.map(lambda x: np.linspace(1, 2, x.size).reshape(x.shape).astype(x.dtype),
                         TREE)
  def loss(tree):
    return sum(jnp.sum(w.astype(jnp.float32) * jnp.sin(x.astype(jnp.float32)))
               for w, x in zip(jax.tree.leaves(weights), jax.tree.leaves(tree)))

  got = jax.grad(lambda flat: loss(layout.unpack(flat)))(layout.pack(TREE))
  want = layout.pack(jax.grad(loss)(TREE))
  chex.assert_trees_all_close(got, want, rtol=1e-6)
  # One write per leaf into one vector: no copy of the whole vector per leaf (a slice's own
  # gradient is a zero-padded copy of the vector, summed over the leaves).
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda flat: loss(layout.unpack(flat))))(
      layout.pack(TREE)))
  assert " pad[" not in jaxpr and jaxpr.count("dynamic_update_slice") == len(layout.shapes)
