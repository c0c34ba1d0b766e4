"""The LayUp runtime (paper Algorithm 1): a compute thread and an updater thread per device.

Each device i holds a `Replica`: device-committed params, BatchNorm state and Optax state, one
entry per stage (a flat vector with `pack_stages`, layup_jax/packing.py; else a pytree), kept in
Python lists whose elements are *replaced*, never mutated. Reading `replica.params[s]` therefore
always yields a complete stage, and a peer's merge lands by swapping the reference: no locks on
parameters, no receive queues, no buffers of peers' updates.

Compute thread i: forward stage by stage, each stage reading device i's *current* params when it
is dispatched (so updates that land mid-forward are used), then the stage VJPs in reverse order,
handing each stage's gradient to updater i as soon as it is dispatched.

Updater thread i, per iteration: pick a uniformly random peer j != i, halve w_i; per stage as its
gradient arrives: local Optax step on device i, a copy of the updated stage onto device j
(`layup_jax.transfer`), push-sum merge on device j; after the last stage w_j += the sent weight.

BatchNorm running statistics under gossip (`bn_policy`):
  "mix" (default): statistics travel with their stage and are merged with the same push-sum
      coefficients as the parameters. Statistics describe the activations of the parameters they
      sit beside; once parameters are mixed, only mixed statistics match them, and the consensus
      model is evaluated with the push-sum average of the statistics.
  "local": each device keeps the statistics of its own forward passes; the consensus model is
      evaluated with their plain mean. Cheaper, but a device's statistics lag its mixed weights.
"""

import collections
import dataclasses
import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from layup_jax import flops, nonfinite, pushsum, remap, transfer
from layup_jax.data.pipeline import Batch
from layup_jax.errors import NonFiniteError
from layup_jax.measurements import mean_or_nan
from layup_jax.packing import StagePacking
from layup_jax.snapshot import Snapshot
from layup_jax.stages import StagedModel, make_stage_steps, stage_key, staged_pass
from layup_jax.straggler import IterationClock

PyTree = Any
BN_POLICIES = ("mix", "local")
PICK = "pick"  # peer argument: let the runtime pick a random peer
_POLL_S = 0.05  # how often blocked threads look at the stop event


class WorkerError(RuntimeError):
  """A compute or updater thread failed; the message names its device and stage."""


@dataclasses.dataclass
class Replica:
  device: jax.Device
  params: list[PyTree]
  state: list[PyTree]
  opt_state: list[PyTree]
  stage_keys: list[jax.Array]  # stages.stage_key of this replica's key, one per stage
  iteration: int = 0


def local_update(tx: optax.GradientTransformation, params, opt_state, grads,
                 first_nonfinite: jax.Array | None = None, skip_nonfinite: bool = False):
  """One Optax step of one stage: `(new_params, new_opt_state, first_nonfinite)`.

  `first_nonfinite` follows the updates of one iteration in the order they are applied, so that
  the host reads one scalar per iteration rather than a flag per stage: `-(n + 1)` while the n
  gradients so far were finite (start with -1, the default), else the position n of the first
  non-finite one. With `skip_nonfinite`, a non-finite gradient leaves params and optimizer state
  as they were.
  """
  finite = nonfinite.all_finite(grads)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  if skip_nonfinite:
    new_params, new_opt_state = nonfinite.select(finite, (new_params, new_opt_state),
                                                 (params, opt_state))
  so_far = jnp.int32(-1) if first_nonfinite is None else first_nonfinite
  first_nonfinite = jnp.where(so_far >= 0, so_far,
                              jnp.where(finite, so_far - 1, -so_far - 1)).astype(jnp.int32)
  return new_params, new_opt_state, first_nonfinite


def device_arrays_like(tree: PyTree, device_of: Callable[[int], jax.Device], count: int):
  """`count` copies of `tree`'s shapes and dtypes, copy j committed to `device_of(j)`."""
  def like(j: int) -> PyTree:
    sharding = jax.sharding.SingleDeviceSharding(device_of(j))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

  return [like(j) for j in range(count)]


class _Budget:
  """Iterations the compute threads may start, how many their updaters have finished and of how
  many the compute threads have recorded the loss.

  Guards only this bookkeeping (a condition variable), never model state. When every granted
  iteration is finished and recorded, all threads are idle between iterations: a consistent
  point.
  """

  def __init__(self):
    self._cond = threading.Condition()
    self.granted = self.started = self.finished = self.recorded = 0
    self._closed = False

  def try_acquire(self) -> bool:
    """Starts an iteration if one is granted now."""
    with self._cond:
      if self.started < self.granted and not self._closed:
        self.started += 1
        return True
      return False

  def acquire(self) -> bool:
    with self._cond:
      while self.started >= self.granted and not self._closed:
        self._cond.wait(_POLL_S)
      if self._closed:
        return False
      self.started += 1
      return True

  def finish(self) -> None:
    with self._cond:
      self.finished += 1
      self._cond.notify_all()

  def record(self) -> None:
    with self._cond:
      self.recorded += 1
      self._cond.notify_all()

  def grant(self, total: int) -> None:
    with self._cond:
      self.granted = max(self.granted, total)
      self._cond.notify_all()

  def hold(self, multiple: int) -> int:
    """Grants nothing beyond the next multiple of `multiple` iterations; returns that total."""
    with self._cond:
      self.granted = min(self.granted, -(-self.started // multiple) * multiple)
      self._cond.notify_all()
      return self.granted

  def reset(self, total: int) -> None:
    """Counts `total` iterations as granted, started, finished and recorded (a restored run)."""
    with self._cond:
      self.granted = self.started = self.finished = self.recorded = total

  def wait_finished(self, total: int, timeout: float) -> bool:
    """Waits until `total` iterations are finished and recorded, or the timeout passes."""
    done = lambda: self.finished >= total and self.recorded >= total
    with self._cond:
      self._cond.wait_for(lambda: done() or self._closed, timeout)
      return done()

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()


class PeriodSync:
  """Rendezvous of all devices at the end of each averaging period.

  Device i's `arrive(period)` counts it in; the last device to arrive runs `action(period)`
  (before returning) and the period is then done. `wait_until(predicate)` blocks until a
  condition on the periods holds, and gives up with `_Stopped` when the runtime stops. Only this
  bookkeeping is locked.
  """

  def __init__(self, num_devices: int, action: Callable[[int], None], stop: threading.Event):
    self._num, self._action, self._stop = num_devices, action, stop
    self._cond = threading.Condition()
    self._arrived: dict[int, int] = collections.defaultdict(int)
    self.done = 0  # periods whose action has run (they complete in order)

  def arrive(self, period: int) -> bool:
    """Counts the caller in; True if it was the last and has run the action."""
    with self._cond:
      self._arrived[period] += 1
      if self._arrived[period] < self._num:
        return False
      del self._arrived[period]
      self._action(period)
      self.done = period
      self._cond.notify_all()
      return True

  def wait_until(self, predicate: Callable[[], bool]) -> None:
    """Blocks until `predicate()` holds, re-checked at each `notify()` and completed period."""
    with self._cond:
      while not predicate():
        if self._stop.is_set():
          raise _Stopped()
        self._cond.wait(_POLL_S)

  def notify(self) -> None:
    with self._cond:
      self._cond.notify_all()

  def restore(self, done: int, arrived: dict[int, int]) -> None:
    """Continues a checkpointed run: `done` periods complete, `arrived[p]` devices at p."""
    with self._cond:
      self.done = done
      self._arrived = collections.defaultdict(int, arrived)


class LayUpRuntime:
  """LayUp on the given devices, threaded, or one iteration at a time with `iterate_serial`."""

  donates_buffers = True  # Optax states are donated to their updates: a checkpoint copies first

  def __init__(
      self,
      model: StagedModel,
      tx: optax.GradientTransformation,
      devices: Sequence[jax.Device],
      train_batches: Sequence[Iterator[Batch]],
      init_params: list[PyTree],
      init_state: list[PyTree],
      example_batch: Batch,
      *,
      seed: int,
      bn_policy: str = "mix",
      max_dispatch_ahead: int = 1,
      straggler_device: int = -1,
      straggler_delay_iters: float = 0.0,
      straggler_mode: str = "host",
      nonfinite_policy: str = "stop",
      gossip: bool = True,
      latency_every: int = 0,
      pack_stages: bool = True,
      remat: str = "dots",
      max_sends_in_flight: int = 0,
  ):
    if bn_policy not in BN_POLICIES:
      raise ValueError(f"bn_policy must be one of {BN_POLICIES}, got {bn_policy!r}")
    if nonfinite_policy not in nonfinite.POLICIES:
      raise ValueError(f"nonfinite_policy must be one of {nonfinite.POLICIES}")
    self.num_devices = len(devices)
    self.num_stages = model.num_stages
    self.bn_policy = bn_policy
    self._train_batches = list(train_batches)
    self._example_batch = example_batch
    self._model = model
    self._skip_nonfinite = nonfinite_policy == "skip"
    # Each stage's params, Optax state and BatchNorm state as one flat vector each
    # (layup_jax.packing), or as pytrees. A stage without state keeps its empty dict.
    self._has_state = [bool(jax.tree.leaves(st)) for st in init_state]
    self._packings = self._state_packings = None
    if pack_stages:
      self._packings = [StagePacking.of(p) for p in init_params]
      self._state_packings = [StagePacking.of(st) if has else None
                              for st, has in zip(init_state, self._has_state)]
    self._steps = make_stage_steps(model, keep_finite_state=self._skip_nonfinite,
                                   packings=self._packings, state_packings=self._state_packings,
                                   remat=remat)
    if pack_stages:
      init_params = [jax.jit(k.pack)(p) for k, p in zip(self._packings, init_params)]
      init_state = [jax.jit(k.pack)(st) if k else st
                    for k, st in zip(self._state_packings, init_state)]
      self._unpack = [jax.jit(k.unpack) for k in self._packings]
      self._unpack_state = [jax.jit(k.unpack) if k else (lambda st: st)
                            for k in self._state_packings]
    # Donated: the Optax state and the gradient, which only the updater reads (the new params
    # take the gradient's buffer), and the received copy of a peer's stage (the merge's output
    # takes its buffer). Params are never donated: forwards, backwards and peers read them.
    self._update = jax.jit(functools.partial(local_update, tx,
                                             skip_nonfinite=self._skip_nonfinite),
                           donate_argnums=(1, 2))
    self._merge = jax.jit(pushsum.merge, donate_argnums=(1,))
    # A scalar computed from a merged stage: ready once the merge has run, and holding it (to
    # wait on a send) keeps no version of the peer's stage alive.
    self._landed = jax.jit(lambda leaf: jnp.sum(leaf.ravel()[:1]))
    self._ahead = max_dispatch_ahead
    self._gossip = gossip  # False: local steps only, no peer (an ablation of communication)
    # Every `latency_every`-th iteration of a device its updater times each stage from gradient
    # ready to merge landed (two waits on the device; 0 = never). Samples (stage, seconds).
    self._latency_every = latency_every
    self._latencies: list[collections.deque] = [collections.deque() for _ in devices]
    base_key = jax.random.key(seed)
    self.replicas = [
        Replica(
            device=device,
            params=list(jax.device_put(init_params, device)),
            state=list(jax.device_put(init_state, device)),
            opt_state=list(jax.device_put([tx.init(p) for p in init_params], device)),
            stage_keys=jax.device_put(
                [stage_key(jax.random.fold_in(base_key, i), s) for s in range(model.num_stages)],
                device),
        )
        for i, device in enumerate(devices)
    ]
    self.weights = pushsum.PushSumWeights(self.num_devices)
    self._peer_rngs = [np.random.default_rng([seed, 1, i]) for i in range(self.num_devices)]
    self._clocks = [
        IterationClock(straggler_delay_iters if i == straggler_device else 0.0, straggler_mode,
                       device)
        for i, device in enumerate(devices)
    ]
    self._losses: list[list[float]] = [[] for _ in devices]
    # Gradient finiteness of each device's iterations not read yet, (iteration, stages in the
    # order updated, `local_update`'s first_nonfinite), that of the iteration under way, and how
    # many iterations each updater has applied and skipped.
    self._finite_checks: list[collections.deque] = [collections.deque() for _ in devices]
    self._all_finite = [jax.device_put(np.int32(-1), d) for d in devices]  # nothing checked yet
    self._open_checks = [([], start) for start in self._all_finite]
    self._updates_done = [0] * self.num_devices
    self._skipped = [0] * self.num_devices
    # Stage each thread is at, to name it when it fails: (role, device) -> stage index.
    self._position: dict[tuple[str, int], int | None] = {}
    self._grad_queues = [
        queue.Queue(maxsize=self.num_stages * max_dispatch_ahead) for _ in devices
    ]
    self._budget = _Budget()
    # Merges each updater has dispatched to peers and not yet seen land, oldest first (as
    # `_landed` scalars; only with a bound on them).
    self._sends_in_flight = [collections.deque() for _ in devices]
    self._max_sends_in_flight = max_sends_in_flight or math.inf
    self._stop = threading.Event()
    self._failures: list[tuple[str, int, int | None, BaseException]] = []
    self._threads: list[threading.Thread] = []

  # --- one iteration's pieces, shared by the serial and the threaded modes --------------------

  def _compute_iteration(self, i: int, emit: Callable[[int, PyTree], None]):
    """Forward and backward pass of device i; `emit(stage, grads)` as each gradient appears.

    Returns the loss and the gradients of stage 0, the last output of the backward pass.
    """
    replica = self.replicas[i]
    batch = next(self._train_batches[i])
    x, labels, iteration = transfer.to_device(
        (batch.inputs, batch.targets, np.int32(replica.iteration)), replica.device)
    replica.iteration += 1

    def at_stage(stage_idx: int) -> None:
      self._position["compute", i] = stage_idx

    return staged_pass(self._model, self._steps, lambda s: replica.params[s], replica.state, x,
                       labels, replica.stage_keys, iteration, emit, on_stage=at_stage)

  def _pick_peer(self, i: int) -> int | None:
    if self.num_devices == 1 or not self._gossip:
      return None
    j = int(self._peer_rngs[i].integers(self.num_devices - 1))
    return j if j < i else j + 1

  def _local_step(self, i: int, s: int, grads: PyTree) -> None:
    """Local Optax step of stage s on device i (its gradient's finiteness is read later)."""
    replica = self.replicas[i]
    order, so_far = self._open_checks[i]
    replica.params[s], replica.opt_state[s], so_far = self._update(
        replica.params[s], replica.opt_state[s], grads, so_far)
    order.append(s)
    self._open_checks[i] = (order, so_far)

  def _finish_updates(self, i: int) -> None:
    """Device i's updater has applied its iteration: count it, queue its finiteness check."""
    order, so_far = self._open_checks[i]
    if order:
      self._finite_checks[i].append((self._updates_done[i], order, so_far))
    self._open_checks[i] = ([], self._all_finite[i])
    self._updates_done[i] += 1

  def _check_finite(self, i: int, wait: bool = True) -> None:
    """Reads device i's gradient checks, counts skipped iterations, or raises NonFiniteError
    naming device, stage and step. Without `wait` it stops at the first check not yet computed
    (an updater never waits for its device)."""
    checks = self._finite_checks[i]
    while checks and (wait or checks[0][2].is_ready()):
      iteration, order, first_nonfinite = checks.popleft()
      position = int(first_nonfinite)
      if position < 0:
        continue
      if not self._skip_nonfinite:
        raise NonFiniteError(
            f"non-finite gradient of stage {order[position]} on device {i} at its step "
            f"{iteration} (backward order: the first stage found non-finite)")
      self._skipped[i] += 1

  def _check_loss(self, i: int, iteration: int, loss: float) -> bool:
    """True if the loss is finite; raises NonFiniteError unless non-finite steps are skipped."""
    if math.isfinite(loss):
      return True
    if not self._skip_nonfinite:
      raise NonFiniteError(
          f"non-finite training loss ({loss}) on device {i} at its step {iteration}, in stage "
          f"{self.num_stages - 1} (the loss stage)")
    return False

  def _sent_part(self, replica: Replica, s: int) -> PyTree:
    """What a send of stage s carries: its params, and its BatchNorm statistics under "mix"."""
    if self.bn_policy == "mix" and self._has_state[s]:
      return replica.params[s], replica.state[s]
    return replica.params[s]

  def _send_stage(self, i: int, j: int, s: int, share: float) -> PyTree:
    """Push-sum merge of device i's stage s into device j, j keeping `share` of its own.

    One transfer and one jitted merge for params and statistics together (each is a Python
    dispatch from an updater thread; they add up over stages and devices).
    """
    replica, peer = self.replicas[i], self.replicas[j]
    in_flight = self._sends_in_flight[i]
    while in_flight and in_flight[0].is_ready():
      in_flight.popleft()
    while len(in_flight) >= self._max_sends_in_flight:  # bounds what peers hold of ours
      jax.block_until_ready(in_flight.popleft())
    received = transfer.to_device(self._sent_part(replica, s), peer.device)
    merged = self._merge(self._sent_part(peer, s), received, np.float32(share))
    if isinstance(merged, tuple):
      peer.params[s], peer.state[s] = merged
    else:
      peer.params[s] = merged
    if self._max_sends_in_flight < math.inf:
      in_flight.append(self._landed(jax.tree.leaves(merged)[0]))
    return merged

  def _update_and_send(self, i: int, j: int | None, s: int, grads: PyTree, sent: float) -> None:
    """Local Optax step of stage s on device i, then its push-sum merge into peer j.

    On a sampled iteration, times the stage's update latency: from its gradient being computed
    to the merged stage being computed on the peer (to the local update without a peer).
    """
    timed = self._latency_every and self._updates_done[i] % self._latency_every == 0
    if timed:
      jax.block_until_ready(grads)
      start = time.perf_counter()
    self._local_step(i, s, grads)
    landed = self.replicas[i].params[s]
    if j is not None:
      landed = self._send_stage(i, j, s, self.weights.receiver_share(j, sent))
    if timed:
      jax.block_until_ready(landed)
      self._latencies[i].append((s, time.perf_counter() - start))

  def stage_latencies(self) -> list[list[float]]:
    """Update latency samples (seconds) of each stage since the previous call, all devices."""
    per_stage: list[list[float]] = [[] for _ in range(self.num_stages)]
    for samples in self._latencies:
      while samples:
        s, seconds = samples.popleft()
        per_stage[s].append(seconds)
    return per_stage

  # --- what an iteration's updates do: LayUp's here, the baselines' in their subclasses -------

  def _begin_iteration(self, i: int, peer: Any = PICK) -> Any:
    """When device i's first gradient of an iteration arrives: pick a peer, halve w_i."""
    j = self._pick_peer(i) if peer is PICK else peer
    return j, (self.weights.send(i) if j is not None else 0.0)

  def _on_stage(self, i: int, context: Any, s: int, grads: PyTree) -> None:
    """As stage s's gradient arrives: update the stage and push it to the peer."""
    j, sent = context
    self._update_and_send(i, j, s, grads, sent)

  def _end_iteration(self, i: int, context: Any, finish: Callable[[], None], wait: bool) -> None:
    """After the last stage: w_j += the sent weight; `finish()` marks the iteration done.

    `wait` is False in the serial mode, where nothing may block.
    """
    j, sent = context
    if j is not None:
      self.weights.receive(j, sent)
    finish()

  def _before_iteration(self, i: int, wait: bool = True) -> None:
    """Called before device i starts an iteration: by compute thread i before it takes budget
    (it may block), or by `iterate_serial` with `wait=False` (it must not)."""

  def _may_wait_before_iteration(self, i: int) -> bool:
    """Whether `_before_iteration(i)` may block now (waiting for other devices)."""
    return False

  def iterate_serial(self, i: int, peer: Any = PICK) -> float:
    """One whole iteration of device i (sending to `peer` where the algorithm has one), on the
    calling thread: the deterministic mode for exact tests (scripted peers, fixed order)."""
    grads: dict[int, PyTree] = {}
    self._before_iteration(i, wait=False)
    loss, _ = self._compute_iteration(i, lambda s, g: grads.__setitem__(s, g))
    self._check_loss(i, self.replicas[i].iteration - 1, float(loss))
    context = self._begin_iteration(i, peer)
    for s in reversed(range(self.num_stages)):
      self._on_stage(i, context, s, grads[s])
    self._end_iteration(i, context, lambda: None, wait=False)
    self._finish_updates(i)
    self._check_finite(i)
    return float(loss)

  # --- compilation ----------------------------------------------------------------------------

  def compile(self) -> None:
    """Runs every per-stage function once on every device, discarding the results.

    Concurrent first compilations race, and none may happen inside the timed loop.
    """
    example = (self._example_batch.inputs, self._example_batch.targets)
    for clock in self._clocks:
      clock.compile()
    for replica, all_finite in zip(self.replicas, self._all_finite):
      inputs, targets = jax.device_put(example, replica.device)
      iteration = jax.device_put(np.int32(0), replica.device)
      share = jax.device_put(np.float32(0.5), replica.device)
      grads: list[PyTree] = [None] * self.num_stages
      state = list(replica.state)  # the warm-up leaves the replica as it is
      loss, _ = staged_pass(self._model, self._steps, replica.params.__getitem__, state, inputs,
                            targets, replica.stage_keys, iteration, grads.__setitem__)
      outputs = [loss, state]  # not the gradients: their updates take them
      copy = lambda tree: jax.tree.map(jnp.copy, tree)  # donated arguments: not the replica's
      for s, stage_grads in enumerate(grads):
        outputs.append(self._update(replica.params[s], copy(replica.opt_state[s]), stage_grads,
                                    all_finite))
        outputs.append(self._merge(replica.params[s], copy(replica.params[s]), share))
        if self._has_state[s]:
          outputs.append(self._merge(replica.state[s], copy(replica.state[s]), share))
        sent = self._sent_part(replica, s)  # the form `_send_stage` merges
        outputs.append(self._merge(sent, copy(sent), np.float32(0.5)))
        if self._max_sends_in_flight < math.inf:  # what a bounded `_send_stage` waits on
          outputs.append(self._landed(jax.tree.leaves(outputs[-1])[0]))
      jax.block_until_ready(outputs)

  # --- the threads ----------------------------------------------------------------------------

  def _run_guarded(self, role: str, i: int, loop: Callable[[int], None]) -> None:
    try:
      loop(i)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
      self._failures.append((role, i, self._position.get((role, i)), exc))
      self._stop.set()
      self._budget.close()

  def _record_losses(self, i: int, pending: collections.deque, keep: int) -> None:
    """Reads device i's oldest dispatched losses until `keep` are left (each waits for its
    iteration's forward pass)."""
    while len(pending) > keep:
      iteration, loss = pending.popleft()
      value = float(loss)
      if self._check_loss(i, iteration, value):
        self._losses[i].append(value)
      self._budget.record()

  def _compute_loop(self, i: int) -> None:
    pending: collections.deque = collections.deque()
    clock = self._clocks[i]
    while True:
      if self._may_wait_before_iteration(i):  # for other devices: read every loss first
        self._record_losses(i, pending, keep=0)
      self._before_iteration(i)
      if not self._budget.try_acquire():
        self._record_losses(i, pending, keep=0)  # nothing to dispatch now: read every loss
        if not self._budget.acquire():
          return
      clock.start_iteration(idle=self._stop.wait)
      iteration = self.replicas[i].iteration

      def emit(s: int, grads: PyTree) -> None:
        if s == 0:  # the backward pass's last output (the updater will donate it)
          clock.end_iteration(grads)
        self._hand_over(i, (s, grads))

      loss, _ = self._compute_iteration(i, emit)
      pending.append((iteration, loss))
      # Bound how far this thread dispatches ahead of its device (the loss is ready once the
      # forward pass of that iteration has run).
      self._record_losses(i, pending, keep=self._ahead - 1)

  def _hand_over(self, i: int, item) -> None:
    while not self._stop.is_set():
      try:
        self._grad_queues[i].put(item, timeout=_POLL_S)
        return
      except queue.Full:
        continue
    raise _Stopped()

  def _next_gradient(self, i: int):
    while not self._stop.is_set():
      try:
        return self._grad_queues[i].get(timeout=_POLL_S)
      except queue.Empty:
        continue
    raise _Stopped()

  def _updater_loop(self, i: int) -> None:
    while True:
      stage, grads = self._next_gradient(i)
      context = self._begin_iteration(i)
      for count in range(self.num_stages):
        if count:
          stage, grads = self._next_gradient(i)
        self._position["updater", i] = stage
        self._on_stage(i, context, stage, grads)
      self._position["updater", i] = None
      self._finish_updates(i)
      self._check_finite(i, wait=False)
      # Last: once the iteration is marked finished the main thread may read this device.
      self._end_iteration(i, context, self._budget.finish, wait=True)

  def _start_threads(self) -> None:
    for role, loop in (("compute", self._compute_loop), ("updater", self._updater_loop)):
      for i in range(self.num_devices):
        thread = threading.Thread(
            target=self._run_guarded, args=(role, i, loop), name=f"layup-{role}-{i}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

  def _raise_if_failed(self) -> None:
    failures = [f for f in self._failures if not isinstance(f[3], _Stopped)]
    if failures:
      role, i, stage, exc = failures[0]
      self.close()
      if isinstance(exc, NonFiniteError):
        raise exc
      raise WorkerError(
          f"{role} thread of device {i} failed at stage {stage}: {type(exc).__name__}: {exc}"
      ) from exc

  # --- the Runtime interface ------------------------------------------------------------------

  def run_until(self, iterations: int, on_progress: Callable[[int], None],
                should_stop: Callable[[], bool] = lambda: False) -> None:
    if self._stop.is_set():
      self._raise_if_failed()
      raise RuntimeError("the runtime was closed")
    if not self._threads:
      self._start_threads()
    self._budget.grant(iterations)
    target = iterations
    while not self._budget.wait_finished(target, timeout=0.1):
      self._raise_if_failed()
      on_progress(self._budget.finished)
      if target == iterations and should_stop():
        # No new iterations beyond the next whole step; those under way finish.
        target = self._budget.hold(self.num_devices)
    self._raise_if_failed()
    for i in range(self.num_devices):  # every thread is idle: read the last flags
      self._check_finite(i)
    on_progress(self._budget.finished)

  def iterations_done(self) -> int:
    return self._budget.finished

  def stage_params(self, i: int) -> list[PyTree]:
    """Device i's params, one pytree per stage (unpacked where stages are stored packed)."""
    params = list(self.replicas[i].params)
    if self._packings:
      return [unpack(p) for unpack, p in zip(self._unpack, params)]
    return params

  def stage_state(self, i: int) -> list[PyTree]:
    """Device i's BatchNorm state, one pytree per stage (unpacked as `stage_params`)."""
    state = list(self.replicas[i].state)
    if self._packings:
      return [unpack(st) for unpack, st in zip(self._unpack_state, state)]
    return state

  def snapshot(self) -> Snapshot:
    weights = list(self.weights.values)
    uniform = [1.0] * self.num_devices
    return Snapshot(
        params=[self.stage_params(i) for i in range(self.num_devices)],
        state=[self.stage_state(i) for i in range(self.num_devices)],
        weights=weights,
        state_weights=weights if self.bn_policy == "mix" else uniform,
    )

  def train_loss(self) -> float:
    losses = [loss for per_device in self._losses for loss in per_device]
    for per_device in self._losses:
      per_device.clear()
    return mean_or_nan(losses)

  def weight_sum(self) -> float:
    return self.weights.total()

  def skipped_steps(self) -> int:
    return sum(self._skipped)

  def iterations_per_device(self) -> list[int]:
    return [r.iteration for r in self.replicas]

  def _iteration_arguments(self) -> tuple:
    """What `flops.staged_calls` needs to replay one iteration of device 0 (its state is not
    changed)."""
    replica = self.replicas[0]
    example = jax.device_put((self._example_batch.inputs, self._example_batch.targets),
                             replica.device)
    return (self._model, self._steps, self._update, replica.params, list(replica.state),
            replica.opt_state, Batch(*example), jax.device_put(jax.random.key(0), replica.device),
            jax.device_put(np.int32(0), replica.device))

  def flops_per_iteration(self, analyse: Callable = flops.lowered) -> float:
    """XLA's FLOPs of one device's iteration (stage functions and updates; no gossip), the
    model's FLOPs: counted without the backward's recomputation (`remat`), as MFU counts them;
    `analyse` is `flops.lowered` (no compilation) or `flops.compiled`."""
    model, _, *arguments = self._iteration_arguments()
    steps = make_stage_steps(model, packings=self._packings, state_packings=self._state_packings)
    return flops.staged_flops(model, steps, *arguments, analyse=analyse)

  def temp_bytes(self) -> int:
    """The largest scratch memory XLA allocates for one of this runtime's functions (a merge
    needs none beyond its output)."""
    return flops.staged_temp_bytes(*self._iteration_arguments())

  # --- checkpoints (at a consistent point: every thread idle between iterations) --------------

  def _replica_arrays(self, r: Replica) -> dict[str, list]:
    return {"params": list(r.params), "state": list(r.state), "opt_state": list(r.opt_state)}

  def state_dict(self) -> tuple[PyTree, dict[str, Any]]:
    arrays = {"replicas": [self._replica_arrays(r) for r in self.replicas],
              "stage_keys": [[jax.random.key_data(k) for k in r.stage_keys]
                             for r in self.replicas]}
    meta = {
        "num_devices": self.num_devices,
        "iterations_done": self._budget.finished,
        "iterations": [r.iteration for r in self.replicas],
        "weights": list(self.weights.values),
        "peer_rngs": [g.bit_generator.state for g in self._peer_rngs],
        "clocks": [c.get_state() for c in self._clocks],
        "losses": [list(per_device) for per_device in self._losses],
        "skipped": list(self._skipped),
    }
    return arrays, meta

  def restore_template(self, meta: dict[str, Any]) -> PyTree:
    saved = meta["num_devices"]
    device_of = lambda j: self.replicas[j % self.num_devices].device
    return {
        "replicas": device_arrays_like(self._replica_arrays(self.replicas[0]), device_of, saved),
        "stage_keys": device_arrays_like([jax.random.key_data(k)
                                          for k in self.replicas[0].stage_keys],
                                         device_of, saved),
    }

  def load_state_dict(self, arrays: PyTree, meta: dict[str, Any]) -> None:
    saved = meta["num_devices"]
    if saved == self.num_devices:
      trees, weights, source = arrays["replicas"], list(meta["weights"]), list(range(saved))
    else:
      host = jax.tree.map(np.asarray, arrays["replicas"])
      trees, weights, source = remap.remap_replicas(host, meta["weights"], self.num_devices)
    for k, replica in enumerate(self.replicas):
      tree = jax.device_put(trees[k], replica.device)
      replica.params, replica.state = list(tree["params"]), list(tree["state"])
      replica.opt_state = list(tree["opt_state"])
      replica.iteration = int(meta["iterations"][source[k]])
      self._updates_done[k] = replica.iteration
      if k < saved:  # a device that existed keeps its keys, peer RNG and clock
        replica.stage_keys = [jax.device_put(jax.random.wrap_key_data(d), replica.device)
                              for d in arrays["stage_keys"][k]]
        self._peer_rngs[k].bit_generator.state = meta["peer_rngs"][k]
        self._clocks[k].set_state(meta["clocks"][k])
        self._skipped[k] = int(meta["skipped"][k])
        if saved == self.num_devices:
          self._losses[k] = list(meta["losses"][k])
    self.weights.values = weights
    steps = meta["iterations_done"] // saved
    self._budget.reset(steps * self.num_devices)

  def close(self) -> None:
    self._stop.set()
    self._budget.close()
    for thread in self._threads:
      thread.join(timeout=10.0)
    alive = [t.name for t in self._threads if t.is_alive()]
    if alive:
      raise RuntimeError(f"threads did not stop: {alive}")


class _Stopped(Exception):
  """Raised inside a thread blocked on a queue when the runtime stops."""
