"""Push-sum's estimate of the average model, and how far the replicas are from it: what an
evaluation reads (paper Section 3: the consensus model `x_bar_s = sum_i w_{i,s} x_{i,s} /
sum_i w_{i,s}`, and the model disagreement). Across processes each process contributes its
weighted sum (`stage_masses`) instead of its replicas. No threads, no devices.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = object


def consensus(replicas: Sequence[Sequence[PyTree]], weights: jax.Array) -> list[PyTree]:
  """Stage by stage, the push-sum estimate of the average model,
  `x_bar_s = sum_i w_{i,s} x_{i,s} / sum_i w_{i,s}`; `replicas[i][s]`, `weights[i, s]`."""
  weights = jnp.asarray(weights)
  weights = weights / jnp.sum(weights, axis=0, keepdims=True)
  center = []
  for s in range(weights.shape[1]):
    total = optax.tree.scale(weights[0, s], replicas[0][s])
    for i in range(1, len(replicas)):
      total = optax.tree.add(total, optax.tree.scale(weights[i, s], replicas[i][s]))
    center.append(optax.tree.cast_like(total, replicas[0][s]))
  return center


def consensus_distance(replicas: Sequence[PyTree], center: PyTree) -> jax.Array:
  """Mean over replicas of `||x_i - x_bar||^2 / ||x_bar||^2` (the paper's model disagreement)."""
  center_sq = optax.tree.norm(center, squared=True)
  distances = [optax.tree.norm(optax.tree.sub(r, center), squared=True) for r in replicas]
  return jnp.mean(jnp.stack(distances)) / jnp.maximum(center_sq, jnp.finfo(jnp.float32).tiny)


def stage_masses(replicas: Sequence[Sequence[PyTree]], weights) -> list[PyTree]:
  """Per stage, `sum_i w_{i,s} x_{i,s}` over `replicas` (host arrays; summed in float64, kept
  in the replicas' dtype): one process's part of the consensus, which crosses to the others
  instead of its replicas."""
  masses = []
  for s in range(len(replicas[0])):
    terms = [jax.tree.map(lambda x, w=weights[i][s]: w * np.asarray(x, np.float64), replica[s])
             for i, replica in enumerate(replicas)]
    summed = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *terms)
    masses.append(jax.tree.map(lambda x, like: x.astype(np.asarray(like).dtype), summed,
                               replicas[0][s]))
  return masses


def consensus_of_masses(masses: Sequence[Sequence[PyTree]], weights, like: Sequence[PyTree]
                        ) -> list[PyTree]:
  """`x_bar_s = sum_p mass_{p,s} / sum_i w_{i,s}` from every part's `stage_masses` and every
  device's weights, in the dtypes of `like` (one replica)."""
  totals = np.sum(np.asarray(weights, np.float64), axis=0)
  center = []
  for s, like_stage in enumerate(like):
    summed = jax.tree.map(lambda *xs: np.sum(np.asarray(xs, np.float64), axis=0),
                          *[part[s] for part in masses])
    center.append(jax.tree.map(lambda x, l, t=totals[s]: (x / t).astype(np.asarray(l).dtype),
                               summed, like_stage))
  return center


def squared_distances(replicas: Sequence[PyTree], center: PyTree) -> float:
  """`sum_i ||x_i - x_bar||^2` over `replicas` (host, float64): one part of
  `consensus_distance`'s numerator."""
  total = 0.0
  for replica in replicas:
    for x, c in zip(jax.tree.leaves(replica), jax.tree.leaves(center), strict=True):
      total += float(np.sum((np.asarray(x, np.float64) - np.asarray(c, np.float64)) ** 2))
  return total


def squared_norm(tree: PyTree) -> float:
  return float(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
