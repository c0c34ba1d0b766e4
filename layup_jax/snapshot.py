"""What the runner evaluates: references to every replica's model at a consistent point, or,
across processes, the consensus already reduced from every process's part."""

import dataclasses
from typing import Any

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """References to every replica's model at a consistent point, for evaluation.

  `weights[i][s]` average stage s's parameters over replicas i (push-sum weights; 1.0 for a
  replicated model) and `state_weights` the BatchNorm statistics, which depend on the
  BatchNorm policy.
  """

  params: list[list[PyTree]]  # [replica][stage]
  state: list[list[PyTree]]
  weights: list[list[float]]  # [replica][stage]
  state_weights: list[list[float]]
  # Across processes (`RunStats.collect`): the consensus model and statistics and the
  # replicas' disagreement, reduced from each process's weighted sums; `params` and `state`
  # then hold device 0's model only (the weights stay every device's).
  center: list[PyTree] | None = None
  center_state: list[PyTree] | None = None
  consensus_distance: float | None = None
