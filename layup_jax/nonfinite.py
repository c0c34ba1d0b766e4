"""Pure helpers for non-finite losses and gradients: detect them on device, keep the old values.

Every check is a device scalar computed inside the jitted step, so detecting a NaN costs no host
sync in the step; the runtimes read the flags one iteration later, when they are ready anyway.
"""

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
POLICIES = ("stop", "skip")  # config.faults.nonfinite


def all_finite(tree: PyTree) -> jax.Array:
  """True iff every element of every floating leaf of `tree` is finite (True for no leaves)."""
  checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def select(keep_new: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """`new` where `keep_new` holds, else `old` (whole trees, one scalar predicate)."""
  return jax.tree.map(lambda n, o: jnp.where(keep_new, n, o), new, old)


def keep_finite(new: PyTree, old: PyTree) -> PyTree:
  """`new` element by element, except where it is not finite: there `old` (BatchNorm statistics
  of a batch that held a NaN stay as they were)."""
  def pick(n, o):
    if not jnp.issubdtype(n.dtype, jnp.inexact):
      return n
    return jnp.where(jnp.isfinite(n), n, o)
  return jax.tree.map(pick, new, old)
