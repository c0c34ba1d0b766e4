"""What a run reports besides its progress: the models, training losses, push-sum weights,
iterations per device, skipped steps and update latencies, read by the runner at each record.

One object for every runtime (LayUp's and the baselines' on layup_jax/runtime/engine.py, and DDP):
the runtime records into it as it trains, the runner reads from it at consistent points. Reads
of what accumulates (losses, latencies) drain it: each record covers the span since the last.
Across processes each process holds its own devices' part; `collect` (a collective, every
process at the same consistent point) brings every part to every process (the models as their
push-sum consensus, not replica by replica), and the reads then cover the whole run until the
next `collect`.
"""

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from layup_jax.errors import NonFiniteError
from layup_jax.measure.run_figures import mean_or_nan
from layup_jax.multiprocess.wire import host_tree
from layup_jax.pushsum import consensus
from layup_jax.runtime.scheduler import Ready, Task, Until, drive

PyTree = Any
POLICIES = ("stop", "skip")  # config.faults.nonfinite


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


class RunStats:
  """Per device (of this process): losses, skipped steps, update-latency samples."""

  def __init__(self, num_devices: int, num_stages: int, read_snapshot: Callable[[], Snapshot],
               read_weights: Callable[[], list[list[float]]],
               read_iterations: Callable[[], list[int]],
               gather: Callable[[Any], list[Any]] | None = None,
               remote_latencies: collections.deque | None = None, timed: bool = True,
               host_cpu: Callable[[], float] | None = None,
               bytes_sent: Callable[[], int] = lambda: 0, identical_processes: int = 1,
               sends_dropped: Callable[[], int] = lambda: 0):
    """`read_*` give this process's models, push-sum weights and iterations per device;
    `gather` (a run across processes: `gathers.all_gather_data`) collects a value from
    every process; `remote_latencies` are the seconds of sends from other processes, as they
    merge; `timed`: whether stages' update latencies are sampled at all (DDP's are not);
    `host_cpu` the CPU seconds the runtime's own threads have spent dispatching (None: the
    runtime dispatches from the caller's thread); `bytes_sent` the bytes this process has sent
    to other processes so far (`layup_jax.multiprocess.traffic`), summed over processes by `collect`, or,
    without `gather`, multiplied by `identical_processes` (DDP: every process runs the same
    all-reduces); `sends_dropped` the sends from other processes this process dropped as
    malformed (`RemotePeers.notice_problem`, non-finite values), summed by `collect`."""
    self.num_stages = num_stages
    self.losses: list[list[float]] = [[] for _ in range(num_devices)]
    self.skipped = [0] * num_devices
    self.latencies: list[collections.deque] = [collections.deque() for _ in range(num_devices)]
    self._read_snapshot, self._read_weights = read_snapshot, read_weights
    self._read_iterations, self._gather = read_iterations, gather
    self._remote = remote_latencies if remote_latencies is not None else collections.deque()
    self._timed = timed
    self._host_cpu = host_cpu
    self._bytes_sent, self._identical_processes = bytes_sent, identical_processes
    self._sends_dropped = sends_dropped
    self._collected: dict[str, Any] | None = None

  # --- what the runtime records ----------------------------------------------------------------

  def record_loss(self, i: int, loss: float) -> None:
    self.losses[i].append(loss)

  def add_latency(self, i: int, s: int, seconds: float) -> None:
    self.latencies[i].append((s, seconds))

  # --- what the runner reads -------------------------------------------------------------------

  def collect(self) -> None:
    """Across processes, brings every process's part to every process (a collective: every
    process calls it at the same consistent point); in one process, nothing.

    Replicas do not cross: each process sends its per-stage weighted sums (`consensus.
    stage_masses`, one model's size) with its weights and scalars, every process forms the
    consensus from them, then each sends the squared distance of its replicas to it (a
    scalar). The snapshot read afterwards holds the consensus, the disagreement and device 0's
    own model (process 0's first device; the runner evaluates on process 0)."""
    if self._gather is None:
      return
    snapshot = self._read_snapshot()
    params = host_tree(snapshot.params)
    state = host_tree(snapshot.state)
    mine = {"mass": consensus.stage_masses(params, snapshot.weights),
            "state_mass": consensus.stage_masses(state, snapshot.state_weights),
            "weights": snapshot.weights, "state_weights": snapshot.state_weights,
            "losses": self._drain_losses(), "latencies": self._drain_latencies(),
            "iterations": self._read_iterations(), "skipped": list(self.skipped),
            "remote_latencies": self._drain_remote(), "bytes_sent": self._bytes_sent(),
            "sends_dropped": self._sends_dropped()}
    parts = self._gather(mine)
    joined = lambda key: [x for part in parts for x in part[key]]
    weights, state_weights = joined("weights"), joined("state_weights")
    center = consensus.consensus_of_masses([p["mass"] for p in parts], weights, params[0])
    center_state = consensus.consensus_of_masses([p["state_mass"] for p in parts], state_weights,
                                               state[0])
    squared = sum(self._gather(consensus.squared_distances(params, center)))
    distance = squared / len(weights) / max(consensus.squared_norm(center),
                                            float(np.finfo(np.float32).tiny))
    self._collected = {
        "snapshot": Snapshot(params=[params[0]], state=[state[0]], weights=weights,
                             state_weights=state_weights, center=center,
                             center_state=center_state, consensus_distance=distance),
        "losses": joined("losses"), "iterations": joined("iterations"),
        "skipped": joined("skipped"), "remote_latencies": joined("remote_latencies"),
        "bytes_sent": sum(part["bytes_sent"] for part in parts),
        "sends_dropped": sum(part["sends_dropped"] for part in parts),
        "latencies": [[x for part in parts for x in part["latencies"][s]]
                      for s in range(self.num_stages)],
    }

  def _part(self, key: str, read: Callable[[], Any]) -> Any:
    """The whole run's `key` after a `collect`, else this process's (`read()`)."""
    return self._collected[key] if self._collected is not None else read()

  def _take(self, key: str, drain: Callable[[], Any], empty: Any) -> Any:
    """As `_part`, for what a read drains: the collected value is handed out once."""
    if self._collected is not None:
      return self._collected.pop(key, empty)
    return drain()

  def snapshot(self) -> Snapshot:
    return self._part("snapshot", self._read_snapshot)

  def train_loss(self) -> float:
    """Mean training loss since the previous call (NaN if none was recorded)."""
    return mean_or_nan(self._take("losses", self._drain_losses, []))

  def weight_sums(self) -> list[float]:
    """Per stage, the sum over devices of the push-sum weights (1 while none is lost)."""
    weights = self._part("snapshot", lambda: None)
    rows = weights.weights if weights is not None else self._read_weights()
    return [float(sum(column)) for column in zip(*rows)]

  def devices_in_average(self) -> int:
    """How many devices' replicas the consensus averages (fewer once a process is lost)."""
    weights = self._part("snapshot", lambda: None)
    return len(weights.weights if weights is not None else self._read_weights())

  def iterations_per_device(self) -> list[int]:
    """Iterations each device has done (a straggler does fewer under LayUp)."""
    return list(self._part("iterations", self._read_iterations))

  def sends_dropped(self) -> int:
    """Sends from other processes dropped as malformed so far, by every process of the run."""
    return self._part("sends_dropped", self._sends_dropped)

  def bytes_between_processes(self) -> int:
    """The bytes every process of the run has sent to the others so far (0 in one process)."""
    return self._part("bytes_sent", lambda: self._bytes_sent() * self._identical_processes)

  def skipped_steps(self) -> int:
    """Iterations whose update was skipped for a non-finite gradient (`faults.nonfinite`)."""
    return sum(self._part("skipped", lambda: self.skipped))

  def stage_latencies(self) -> list[list[float]] | None:
    """Per stage, the update latencies (s) sampled since the previous call; None if stages
    are not timed."""
    if not self._timed:
      return None
    return self._take("latencies", self._drain_latencies, [[] for _ in range(self.num_stages)])

  def remote_send_latencies(self) -> list[float]:
    """Seconds from offer to merge of each send from another process's device since the
    previous call (none in one process, or without gossip)."""
    return self._take("remote_latencies", self._drain_remote, [])

  def host_cpu_s(self) -> float | None:
    """CPU seconds this process's runtime threads (dispatcher, updater) have spent so far,
    outside their idle waits: the host's share of the work, which on a machine whose cores also
    run the devices (fake CPU devices) is taken from them. None without such threads."""
    return self._host_cpu() if self._host_cpu is not None else None

  def _drain_losses(self) -> list[float]:
    losses = [loss for per_device in self.losses for loss in per_device]
    for per_device in self.losses:
      per_device.clear()
    return losses

  def _drain_latencies(self) -> list[list[float]]:
    per_stage: list[list[float]] = [[] for _ in range(self.num_stages)]
    for samples in self.latencies:
      while samples:
        s, seconds = samples.popleft()
        per_stage[s].append(seconds)
    return per_stage

  def _drain_remote(self) -> list[float]:
    return [self._remote.popleft() for _ in range(len(self._remote))]


class StageTimer:
  """Update latencies: on a timed iteration (every `metrics.latency_every`-th of a device) the
  updater hands over, per stage, (stage, start, landing): the landing is an array, or a future
  of one for a send not made yet. Each device's latency task waits for its landings in order
  and records the seconds from start to landed in `stats`, off the updater's path."""

  def __init__(self, num_devices: int, stats: RunStats):
    self._landings = [collections.deque() for _ in range(num_devices)]
    self._stats = stats

  def hand(self, i: int, s: int, start: float, landed: Any) -> None:
    self._landings[i].append((s, start, landed))

  def task(self, i: int) -> Task:
    """Device i's latency task (a task of layup_jax/runtime/scheduler.py: it never blocks a thread)."""
    landings = self._landings[i]
    while True:
      if not landings:
        yield Until(lambda: landings, "a timed stage")
      yield from self._record(i, *landings[0])
      landings.popleft()

  def record_now(self, i: int) -> None:
    """Records device i's landings on the calling thread, waiting for each (the serial mode)."""
    while self._landings[i]:
      drive(self._record(i, *self._landings[i].popleft()))

  def idle(self) -> bool:
    """Whether every landing handed over has been recorded."""
    return not any(self._landings)

  def _record(self, i: int, s: int, start: float, landed: Any) -> Task:
    if isinstance(landed, Future):
      yield Until(landed.done, "a send to be made")
      landed = landed.result()
    if landed is not None:  # None: a send to another process, timed there
      yield Ready(landed)
      self._stats.add_latency(i, s, time.perf_counter() - start)


class FiniteChecks:
  """Per device: the gradient checks not read yet, (iteration, stages in update order,
  first_nonfinite), and how many iterations its updater has applied (`applied`)."""

  def __init__(self, num_devices: int, policy: str, stats: RunStats, loss_stage: int):
    self._pending = [collections.deque() for _ in range(num_devices)]
    self.applied = [0] * num_devices
    self._policy, self._stats, self._loss_stage = policy, stats, loss_stage

  def applied_one(self, i: int, closed: tuple[Any, Any] | None) -> None:
    """Device i's updater applied an iteration; `closed` is its (order, first_nonfinite)."""
    if closed is not None:
      self._pending[i].append((self.applied[i], *closed))
    self.applied[i] += 1

  def read(self, i: int, wait: bool = True) -> None:
    """Reads device i's checks: counts skipped iterations, or raises NonFiniteError. Without
    `wait` it stops at the first check not yet computed (an updater never waits for its
    device)."""
    pending = self._pending[i]
    while pending and (wait or pending[0][2].is_ready()):
      iteration, order, first_nonfinite = pending.popleft()
      position = int(first_nonfinite)
      if position < 0:
        continue
      if self._policy != "skip":
        raise NonFiniteError(
            f"non-finite gradient of stage {order[position]} on device {i} at its step "
            f"{iteration} (backward order: the first stage found non-finite)")
      self._stats.skipped[i] += 1

  def record_loss(self, i: int, iteration: int, loss: float) -> None:
    """Keeps a finite loss; raises NonFiniteError unless non-finite steps are skipped."""
    if math.isfinite(loss):
      self._stats.record_loss(i, loss)
    elif self._policy != "skip":
      raise NonFiniteError(
          f"non-finite training loss ({loss}) on device {i} at its step {iteration}, in stage "
          f"{self._loss_stage} (the loss stage)")
