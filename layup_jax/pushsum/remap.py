"""Replicas saved on M devices, resumed on M' devices, with the push-sum consensus unchanged.

Push-sum's consensus of stage s is `sum_i w_{i,s} x_{i,s} / sum_i w_{i,s}`. Growing (M' > M),
new device k takes old replica `k mod M` and an equal share of its weights; shrinking, new
device k takes, stage by stage, the push-sum average of old replicas `k, k + M', k + 2M', ...`
and the sum of their weights. Either way each stage's weighted sum of replicas and its weight
sum are those saved, so the consensus model is too. Optimizer states are averaged with the same
per-stage weights (integer leaves, like step counts, take the largest). Host NumPy only: no
devices, no threads.
"""

import collections
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _weighted_mean(coefficients: np.ndarray, *leaves: np.ndarray) -> np.ndarray:
  first = np.asarray(leaves[0])
  if not jnp.issubdtype(first.dtype, jnp.floating):
    return np.max(np.stack([np.asarray(leaf) for leaf in leaves]), axis=0)
  total = sum(c * np.asarray(leaf, np.float64) for c, leaf in zip(coefficients, leaves))
  return np.asarray(total).astype(first.dtype)


def remap_replicas(replicas: Sequence[dict[str, list]], weights: Sequence[Sequence[float]],
                   num_devices: int) -> tuple[list[dict[str, list]], list[list[float]], list[int]]:
  """`(replicas, weights, source)` for `num_devices` devices. A replica is a dict of per-stage
  lists (`{"params": [...], "opt_state": [...], ...}`), `weights[i][s]` its push-sum weights;
  `source[k]` is the old replica whose identity (RNG keys, step counter) new device k
  inherits."""
  old = len(replicas)
  if num_devices >= old:
    source = [k % old for k in range(num_devices)]
    copies = collections.Counter(source)
    return ([replicas[j] for j in source],
            [[w / copies[j] for w in weights[j]] for j in source], source)
  groups = [list(range(k, old, num_devices)) for k in range(num_devices)]
  num_stages = len(weights[0])
  merged, merged_weights = [], []
  for group in groups:
    group_weights = np.asarray([weights[j] for j in group], np.float64)  # [member, stage]
    totals = group_weights.sum(axis=0)
    replica = {key: [] for key in replicas[group[0]]}
    for s in range(num_stages):
      coefficients = group_weights[:, s] / totals[s]
      for key, stages in replica.items():
        stages.append(jax.tree.map(lambda *leaves, c=coefficients: _weighted_mean(c, *leaves),
                                   *[replicas[j][key][s] for j in group]))
    merged.append(replica)
    merged_weights.append([float(t) for t in totals])
  return merged, merged_weights, [group[0] for group in groups]
