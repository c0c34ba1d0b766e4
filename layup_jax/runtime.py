"""The asynchronous runtime: a compute thread and an updater thread per device (paper Section 3).

The only module that starts threads. What happens to a device's stages is its algorithm's
`Exchange` (layup_jax/exchange.py; LayUp's is layup_jax/algorithms/layup.py); the replicas and
every write to them are the `ReplicaStore`'s (layup_jax/replicas.py).

Compute thread i: forward stage by stage, each stage reading device i's *current* params when it
is dispatched (so updates that land mid-forward are used), then the stage VJPs in reverse order,
handing each stage to updater i as soon as it is dispatched, with the step that drives the
learning-rate schedule (the run's global step at the iteration's start, or the device's own
iteration count: `Exchange.schedule_by_own_iteration`). Where the exchange allows it
(`Exchange.fuses_local_step`: LayUp, GoSGD, the periodic baselines) each stage's local update
is in the program of its backward, and what is handed over is the updated stage; else
(AD-PSGD) the gradient, which the updater applies. Fusing saves a program launch per stage and
the gradient's memory; the host's time per iteration is what feeds a fast device
(scripts/bench_host.py).

Updater thread i: per iteration `begin`, `on_stage` as each gradient arrives, `end`, then the
iteration counts as finished. An updater never waits for another device's work (sends wait for
the sender's own, layup_jax/outbox.py), except where an algorithm is synchronous by definition
(AD-PSGD's pairwise average, a periodic average) or a user bounds the sends in flight.

Latency thread i (with `metrics.latency_every`): on every latency_every-th iteration of device
i the updater waits for each stage's gradient (on its own device) and hands the watcher the
stage's landing (the merge on the peer, or the local update); the watcher waits for it and
records the time. The waiting on a peer's device happens off the updater's path.

`iterate_serial` runs one whole iteration of one device on the calling thread: the
deterministic mode for exact tests (scripted peers, fixed order). The threads and the serial mode
run the same exchange and the same store.
"""

import collections
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import jax
import numpy as np
import optax

from layup_jax import crossprocess, distributed, flops, outbox, transfer
from layup_jax.checkpointing import DeviceRows
from layup_jax.data.pipeline import Batch
from layup_jax.errors import ConfigError, NonFiniteError
from layup_jax.exchange import Exchange, Links, PeerSampler
from layup_jax.measurements import mean_or_nan
from layup_jax.options import RuntimeOptions
from layup_jax.outbox import Outbox
from layup_jax.replicas import ReplicaStore
from layup_jax.snapshot import Snapshot
from layup_jax.stages import StagedModel, make_stage_steps, staged_pass, states_in
from layup_jax.straggler import IterationClock

PyTree = Any
# 2: per-stage push-sum weights, step-driven schedules; 3: replicas and stage keys as rows of
# arrays sharded over the devices (`checkpointing.DeviceRows`).
CHECKPOINT_FORMAT = 3
_POLL_S = 0.05  # how often blocked threads look at the stop event
_UPDATER_CLOSES = object()  # a handed-over stage whose iteration's checks the updater closes


class WorkerError(RuntimeError):
  """A compute or updater thread failed; the message names its device and stage."""


class _Stopped(Exception):
  """Raised inside a thread blocked on a queue or a period when the runtime stops."""


_OWN_ARRAYS = ("replicas", "stage_keys")  # the runtime's checkpoint arrays; the others: exchange


def _exchange_arrays(arrays: dict) -> dict:
  """The exchange's entries of a checkpoint's arrays (all but `_OWN_ARRAYS`)."""
  return {key: value for key, value in arrays.items() if key not in _OWN_ARRAYS}


class Budget:
  """Iterations the compute threads may start, how many their updaters have finished and of how
  many the compute threads have recorded the loss.

  Guards only this bookkeeping (a condition variable), never model state. When every granted
  iteration is finished and recorded, all threads are idle between iterations: a consistent
  point. An iteration's index (how many started before it) gives the run's global step.
  """

  def __init__(self, num_devices: int = 1):
    self._cond = threading.Condition()
    self.granted = self.started = self.finished = self.recorded = 0
    self._closed = False
    self._num_devices = num_devices

  def _may_start(self, own: int | None) -> bool:
    """Whether an iteration is granted to a device that has taken `own` (None: any device may
    take any granted iteration; else each takes its equal share, `granted / num_devices`)."""
    return self.started < self.granted and (own is None
                                            or own < self.granted // self._num_devices)

  def try_acquire(self, own: int | None = None) -> int | None:
    """Starts an iteration if one is granted now (`_may_start`); returns its index."""
    with self._cond:
      if self._may_start(own) and not self._closed:
        self.started += 1
        return self.started - 1
      return None

  def acquire(self, own: int | None = None) -> int | None:
    """Waits for a granted iteration and starts it; None once closed."""
    with self._cond:
      while not self._may_start(own) and not self._closed:
        self._cond.wait(_POLL_S)
      if self._closed:
        return None
      self.started += 1
      return self.started - 1

  def start_now(self) -> int:
    """Grants and starts one iteration (the serial mode); returns its index."""
    with self._cond:
      self.granted = max(self.granted, self.started + 1)
      self.started += 1
      return self.started - 1

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
  condition on the periods holds, and gives up when `stopped()` turns true. Only this
  bookkeeping is locked.
  """

  def __init__(self, num_devices: int, action: Callable[[int], None],
               stopped: Callable[[], bool]):
    self._num, self._action, self._stopped = num_devices, action, stopped
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
        if self._stopped():
          raise _Stopped()
        self._cond.wait(_POLL_S)

  def notify(self) -> None:
    with self._cond:
      self._cond.notify_all()

  def arrived(self) -> dict[int, int]:
    with self._cond:
      return dict(self._arrived)

  def restore(self, done: int, arrived: dict[int, int]) -> None:
    """Continues a checkpointed run: `done` periods complete, `arrived[p]` devices at p."""
    with self._cond:
      self.done = done
      self._arrived = collections.defaultdict(int, arrived)


@dataclasses.dataclass
class _Checks:
  """Device i's gradient finiteness checks not read yet, (iteration, stages in update order,
  first_nonfinite), and how many iterations its updater has applied and skipped."""

  pending: collections.deque = dataclasses.field(default_factory=collections.deque)
  applied: int = 0
  skipped: int = 0


class AsyncRuntime:
  """An algorithm's `Exchange` on the given devices: threaded, or one iteration at a time with
  `iterate_serial`."""

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
      make_exchange: Callable[[Links], Exchange],
      options: RuntimeOptions,
  ):
    self.options = options
    # Across processes, this process runs its own devices only (global positions first ..
    # first + num_devices - 1 of the run's `total_devices`); every index below is a position
    # among them, except peers, which are global.
    positions = distributed.local_positions(devices)
    if positions != list(range(positions[0], positions[0] + len(positions))):
      raise ConfigError(f"this process's devices are not consecutive in the run: {positions}")
    self.first, self.total_devices = positions[0], len(devices)
    run_devices = list(devices)
    self._run_devices = tuple(run_devices)
    devices = [devices[p] for p in positions]
    train_batches = [list(train_batches)[p] for p in positions]
    self.num_devices, self.num_stages = len(devices), model.num_stages
    self._model = model
    self._train_batches = train_batches
    self._example_batch = example_batch
    self.store = ReplicaStore(model, tx, devices, init_params, init_state, options,
                              lock=threading.Lock, first=self.first,
                              total_devices=self.total_devices)
    self.peers = PeerSampler(self.total_devices, options.seed, options.gossip, self.first,
                             self.num_devices)
    self._stop = threading.Event()
    self._remote = None  # a run across processes: sends to and from the others' devices
    if self.num_devices < self.total_devices:
      self._remote = crossprocess.RemotePeers(
          [d.process_index for d in jax.devices()[:self.total_devices]], self.first,
          self.num_devices, self.store.part_template, self.store.device,
          lambda j, s, received, amount: self.store.merge(j, s, received, amount, True),
          lambda j, s: self.store.take(j, s, halve=False)[0], self.store.correct_toward,
          host=options.transfer_host)
    self.outboxes = [Outbox(self.store, i, self.peers.choose, options.max_sends_in_flight,
                            first=self.first, remote=self._remote, stopped=self._stop.is_set)
                     for i in range(self.num_devices)]
    self._collected: dict[str, Any] | None = None  # every process's part (`collect`)
    self.exchange = make_exchange(Links(self.store, self.outboxes, self.peers, options,
                                        self._stop.is_set, run_devices, self._remote))
    self._fused = self.exchange.fuses_local_step and options.fuse_local_step
    self._clocks = [IterationClock(options.delay_of(i), options.straggler_mode, device)
                    for i, device in enumerate(devices)]
    self._losses: list[list[float]] = [[] for _ in devices]
    self._checks = [_Checks() for _ in devices]
    # Every `latency_every`-th iteration of a device each stage is timed from gradient ready to
    # update landed (0 = never): the updater hands (stage, start, landing) to its device's
    # watcher thread, which records samples (stage, seconds).
    self._latencies: list[collections.deque] = [collections.deque() for _ in devices]
    self._landings = [queue.Queue() for _ in devices]
    # Stage each thread is at, to name it when it fails: (role, device) -> stage index.
    self._position: dict[tuple[str, int], int | None] = {}
    self._grad_queues = [queue.Queue(maxsize=self.num_stages * options.max_dispatch_ahead)
                         for _ in devices]
    self._budget = Budget(self.num_devices)
    self._failures: list[tuple[str, int, int | None, BaseException]] = []
    self._threads: list[threading.Thread] = []

  @property
  def replicas(self):
    return self.store.replicas

  # --- one iteration's pieces, shared by the serial and the threaded modes --------------------

  def _compute_iteration(self, i: int, index: int,
                         emit: Callable[[int, PyTree, Any, Any], None]):
    """Forward and backward pass of device i, the run's iteration `index`; `emit(stage,
    grads, step, closed)` as each gradient appears (with fused local steps: the updated params,
    and with stage 0 the iteration's closed finiteness check; else `_UPDATER_CLOSES`). Returns
    the loss and stage 0's output."""
    store, replica = self.store, self.store.replicas[i]
    batch = next(self._train_batches[i])
    step = (replica.iteration if self.exchange.schedule_by_own_iteration
            else index // self.num_devices)
    x, labels, iteration, step = transfer.to_device(
        (batch.inputs, batch.targets, np.int32(replica.iteration), np.int32(step)),
        replica.device)
    replica.iteration += 1

    def at_stage(stage_idx: int) -> None:
      self._position["compute", i] = stage_idx

    def emit_stage(s: int, out: PyTree) -> None:
      closed = store.close_checks(i) if self._fused and s == 0 else _UPDATER_CLOSES
      emit(s, out, step, closed)

    return staged_pass(self._model, store.steps, lambda s: store.params(i, s),
                       lambda s, forward: store.run_forward(i, s, forward), x, labels,
                       replica.stage_keys, iteration, emit_stage, on_stage=at_stage,
                       local_step=store.local_steps(i, step) if self._fused else None)

  def _apply_iteration(self, i: int, next_gradient: Callable[[], tuple]) -> None:
    """Updater i's part of one iteration: the exchange's begin, on_stage per gradient, end."""
    checks = self._checks[i]
    timed = bool(self.options.latency_every) and checks.applied % self.options.latency_every == 0
    self.outboxes[i].watch = timed
    context = None
    for count in range(self.num_stages):
      s, out, step, closed = next_gradient()
      if count == 0:
        context = self.exchange.begin(i)
      self._position["updater", i] = s
      if timed:
        jax.block_until_ready(out)  # the gradient, or the updated stage
        start = time.perf_counter()
      landed = self.exchange.on_stage(i, context, s, None if self._fused else out, step)
      if timed and landed is not None:
        self._landings[i].put((s, start, landed))
    self.exchange.end(i, context)
    self._position["updater", i] = None
    if closed is _UPDATER_CLOSES:
      closed = self.store.close_checks(i)
    if closed is not None:
      checks.pending.append((checks.applied, *closed))
    checks.applied += 1

  def _check_finite(self, i: int, wait: bool = True) -> None:
    """Reads device i's gradient checks, counts skipped iterations, or raises NonFiniteError
    naming device, stage and step. Without `wait` it stops at the first check not yet computed
    (an updater never waits for its device)."""
    checks = self._checks[i]
    while checks.pending and (wait or checks.pending[0][2].is_ready()):
      iteration, order, first_nonfinite = checks.pending.popleft()
      position = int(first_nonfinite)
      if position < 0:
        continue
      if self.options.nonfinite != "skip":
        raise NonFiniteError(
            f"non-finite gradient of stage {order[position]} on device {i} at its step "
            f"{iteration} (backward order: the first stage found non-finite)")
      checks.skipped += 1

  def _record_loss(self, i: int, iteration: int, loss: float) -> None:
    """Keeps a finite loss; raises NonFiniteError unless non-finite steps are skipped."""
    if math.isfinite(loss):
      self._losses[i].append(loss)
    elif self.options.nonfinite != "skip":
      raise NonFiniteError(
          f"non-finite training loss ({loss}) on device {i} at its step {iteration}, in stage "
          f"{self.num_stages - 1} (the loss stage)")

  def iterate_serial(self, i: int, peer: int | None | str = "random") -> float:
    """One whole iteration of device i on the calling thread: the deterministic mode for exact
    tests. `peer` scripts device i's next peer (None: no peer; "random": the sampler's pick, as
    in the threaded mode). Returns the loss."""
    if peer != "random":
      self.peers.script(i, peer)
    self.exchange.before_iteration(i, wait=False)
    index = self._budget.start_now()
    grads: dict[int, tuple] = {}
    iteration = self.store.replicas[i].iteration
    loss, _ = self._compute_iteration(i, index, lambda s, *out: grads.__setitem__(s, out))
    self._record_loss(i, iteration, float(loss))
    in_backward_order = iter([(s, *grads[s]) for s in reversed(range(self.num_stages))])
    self._apply_iteration(i, lambda: next(in_backward_order))
    while not self._landings[i].empty():  # no watcher thread here: record on this one
      self._record_landing(i, *self._landings[i].get())
    self._budget.finish()
    self._budget.record()
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
    outputs = []
    for i, replica in enumerate(self.store.replicas):
      inputs, targets = jax.device_put(example, replica.device)
      iteration = jax.device_put(np.int32(0), replica.device)
      grads: list[PyTree] = [None] * self.num_stages
      state = list(replica.state)  # the warm-up leaves the replica as it is
      # Only the functions an iteration runs (each compiles per device): with fused local
      # steps the fused backward-and-update, and no separate update per stage.
      local_step = self.store.compile_local_steps(i, iteration, outputs) if self._fused else None
      loss, _ = staged_pass(self._model, self.store.steps, replica.params.__getitem__,
                            states_in(state), inputs, targets, replica.stage_keys, iteration,
                            grads.__setitem__, local_step=local_step)
      outputs += [loss, state]  # not the gradients: their updates take them
      outputs += self.store.compile_writes(i, iteration, None if self._fused else grads)
    if self.options.max_sends_in_flight:
      outputs += outbox.compile_landed(self.store)
    jax.block_until_ready(outputs)
    # Every process here before the first collective: gloo forms its context on the first
    # all-reduce and gives up after 30 s, less than a loaded host's compilation may differ by.
    distributed.all_gather_json(None)
    self.exchange.compile()

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
      self._record_loss(i, iteration, float(loss))
      self._budget.record()

  def _compute_loop(self, i: int) -> None:
    pending: collections.deque = collections.deque()
    clock = self._clocks[i]
    while True:
      if self.exchange.may_wait_before_iteration(i):  # for other devices: read every loss first
        self._record_losses(i, pending, keep=0)
      self.exchange.before_iteration(i, wait=True)
      own = self.store.replicas[i].iteration if self.exchange.equal_shares else None
      index = self._budget.try_acquire(own)
      if index is None:
        self._record_losses(i, pending, keep=0)  # nothing to dispatch now: read every loss
        index = self._budget.acquire(own)
        if index is None:
          return
      clock.start_iteration(idle=self._stop.wait)
      iteration = self.store.replicas[i].iteration

      def emit(s: int, out: PyTree, step, closed) -> None:
        if s == 0:  # the backward pass's last output
          clock.end_iteration(out)
        self._hand_over(i, (s, out, step, closed))

      loss = self._compute_iteration(i, index, emit)[0]  # holds no stage past the iteration
      pending.append((iteration, loss))
      # Bound how far this thread dispatches ahead of its device (the loss is ready once the
      # forward pass of that iteration has run).
      self._record_losses(i, pending, keep=self.options.max_dispatch_ahead - 1)

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

  def _latency_loop(self, i: int) -> None:
    """Waits for each timed stage to land (a future of a send not yet made, or an array) and
    records its latency."""
    while True:
      try:
        s, start, landed = self._landings[i].get(timeout=_POLL_S)
      except queue.Empty:
        if self._stop.is_set():
          return
        continue
      self._record_landing(i, s, start, landed)

  def _record_landing(self, i: int, s: int, start: float, landed: Any) -> None:
    try:
      while isinstance(landed, Future):
        try:
          landed = landed.result(timeout=_POLL_S)
        except FutureTimeout:
          if self._stop.is_set():
            raise _Stopped() from None
      if landed is not None:  # None: a send to another process, timed there
        jax.block_until_ready(landed)
        self._latencies[i].append((s, time.perf_counter() - start))
    finally:
      self._landings[i].task_done()

  def _landings_recorded(self) -> None:
    """Waits until every watcher has recorded what it was handed (at a consistent point, every
    landing has been handed over)."""
    while any(q.unfinished_tasks for q in self._landings):
      self._raise_if_failed()
      time.sleep(0.001)

  def _updater_loop(self, i: int) -> None:
    while True:
      self._apply_iteration(i, lambda: self._next_gradient(i))
      self._check_finite(i, wait=False)
      self._budget.finish()  # last: the main thread may now read this device

  def _start_threads(self) -> None:
    for sender in self.outboxes:  # threads: a slow peer's full queue must not stall a sender
      sender.reroute_congested = True
    loops = [("compute", self._compute_loop), ("updater", self._updater_loop)]
    if self.options.latency_every:
      loops.append(("latency", self._latency_loop))
    threads = [(role, loop, i) for role, loop in loops for i in range(self.num_devices)]
    if self._remote is not None:  # one receiver per other process, named by that process
      receive = lambda k: self._remote.receive(k, self._stop.is_set)
      threads += [("receiver", receive, k) for k in self._remote.other_processes()]
    for role, loop, i in threads:
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
    if self._remote is not None:
      # Every process idle and every send to another process merged there: then nothing is
      # in flight anywhere, and the push-sum sums are exact again.
      self._remote.quiesce(self._stop.is_set)
      distributed.all_gather_json(None)
      self._raise_if_failed()
    self._landings_recorded()
    self.exchange.settle()
    self.store.settle()
    on_progress(self._budget.finished)

  def iterations_done(self) -> int:
    return self._budget.finished

  def remote_sends(self) -> int:
    """Sends this process made to other processes' devices (0 in one process)."""
    return self._remote.sends() if self._remote is not None else 0

  def stage_params(self, i: int) -> list[PyTree]:
    return self.store.stage_params(i)

  def stage_state(self, i: int) -> list[PyTree]:
    return self.store.stage_state(i)

  def collect(self) -> None:
    """Across processes, brings every process's replicas, weights, losses and counts to every
    process, for the accessors below (a collective: every process calls it at the same
    consistent point); in one process, nothing."""
    if self._remote is None:
      return
    snapshot = self.store.snapshot()
    mine = {"snapshot": {"params": crossprocess.host_tree(snapshot.params),
                         "state": crossprocess.host_tree(snapshot.state),
                         "weights": snapshot.weights, "state_weights": snapshot.state_weights},
            "losses": self._drain_losses(), "latencies": self._drain_latencies(),
            "iterations": [r.iteration for r in self.store.replicas],
            "skipped": [c.skipped for c in self._checks],
            "remote_latencies": self._drain_remote_latencies()}
    parts = distributed.all_gather_pickled(mine)
    joined = lambda key: [x for part in parts for x in part[key]]
    snapshots = [part["snapshot"] for part in parts]
    fields = ("params", "state", "weights", "state_weights")
    self._collected = {
        "snapshot": Snapshot(**{f: [x for sn in snapshots for x in sn[f]] for f in fields}),
        "losses": joined("losses"), "iterations": joined("iterations"),
        "skipped": joined("skipped"), "remote_latencies": joined("remote_latencies"),
        "latencies": [[x for part in parts for x in part["latencies"][s]]
                      for s in range(self.num_stages)],
    }

  def snapshot(self) -> Snapshot:
    if self._collected is not None:
      return self._collected["snapshot"]
    return self.store.snapshot()

  def _drain_losses(self) -> list[float]:
    losses = [loss for per_device in self._losses for loss in per_device]
    for per_device in self._losses:
      per_device.clear()
    return losses

  def train_loss(self) -> float:
    if self._collected is not None:
      return mean_or_nan(self._collected.pop("losses", []))
    return mean_or_nan(self._drain_losses())

  def weight_sums(self) -> list[float]:
    if self._collected is not None:
      return [float(sum(column)) for column in zip(*self._collected["snapshot"].weights)]
    return self.store.weights.sums()

  def skipped_steps(self) -> int:
    if self._collected is not None:
      return sum(self._collected["skipped"])
    return sum(c.skipped for c in self._checks)

  def iterations_per_device(self) -> list[int]:
    if self._collected is not None:
      return list(self._collected["iterations"])
    return [r.iteration for r in self.store.replicas]

  def _drain_latencies(self) -> list[list[float]]:
    per_stage: list[list[float]] = [[] for _ in range(self.num_stages)]
    for samples in self._latencies:
      while samples:
        s, seconds = samples.popleft()
        per_stage[s].append(seconds)
    return per_stage

  def _drain_remote_latencies(self) -> list[float]:
    samples = self._remote.latencies if self._remote is not None else collections.deque()
    return [samples.popleft() for _ in range(len(samples))]

  def remote_send_latencies(self) -> list[float]:
    """Seconds from offer to merge of the sends between processes since the previous call."""
    if self._collected is not None:
      return self._collected.pop("remote_latencies", [])
    return self._drain_remote_latencies()

  def stage_latencies(self) -> list[list[float]]:
    """Update latency samples (seconds) of each stage since the previous call, all devices."""
    if self._collected is not None:
      return self._collected.pop("latencies", [[] for _ in range(self.num_stages)])
    return self._drain_latencies()

  def _iteration_arguments(self) -> tuple:
    """What `flops.staged_calls` needs to replay one iteration of device 0 (its state is not
    changed)."""
    replica = self.store.replicas[0]
    example = jax.device_put((self._example_batch.inputs, self._example_batch.targets),
                             replica.device)
    return (self._model, self.store.steps, self.store.update, replica.params,
            list(replica.state), replica.opt_state, Batch(*example),
            jax.device_put(jax.random.key(0), replica.device),
            jax.device_put(np.int32(0), replica.device))

  def flops_per_iteration(self, analyse: Callable = flops.lowered) -> float:
    """XLA's FLOPs of one device's iteration (stage functions and updates; no gossip), the
    model's FLOPs: counted without the backward's recomputation (`remat`), as MFU counts them;
    `analyse` is `flops.lowered` (no compilation) or `flops.compiled`."""
    model, _, *arguments = self._iteration_arguments()
    steps = make_stage_steps(model, packings=self.store.packings,
                             state_packings=self.store._state_packings)
    return flops.staged_flops(model, steps, *arguments, analyse=analyse)

  def temp_bytes(self) -> int:
    """The largest scratch memory XLA allocates for one of this runtime's functions (a merge
    needs none beyond its output)."""
    return flops.staged_temp_bytes(*self._iteration_arguments())

  # --- checkpoints (at a consistent point: every thread idle between iterations) --------------

  def state_dict(self) -> tuple[PyTree, dict[str, Any]]:
    # Each device's replica and keys: rows of the checkpoint's arrays that this process writes.
    arrays = {key: DeviceRows(value, self.first, self.total_devices, self._run_devices)
              for key, value in self.store.arrays().items()}
    exchange_arrays, exchange_meta = self.exchange.state_dict()
    arrays.update(exchange_arrays)
    meta = {
        "format": CHECKPOINT_FORMAT,
        "num_devices": self.num_devices,
        "iterations_done": self._budget.finished,
        "iterations": [r.iteration for r in self.store.replicas],
        "weights": [list(row) for row in self.store.weights.values],
        "peer_rngs": self.peers.get_state(),
        "clocks": [c.get_state() for c in self._clocks],
        "losses": [list(per_device) for per_device in self._losses],
        "skipped": [c.skipped for c in self._checks],
        "exchange": exchange_meta,
    }
    if self._remote is not None:
      return self._whole_run_state(arrays, meta)
    return arrays, meta

  # Per-device entries of the checkpoint metadata (each process holds its devices' part).
  _PER_DEVICE_META = ("iterations", "weights", "peer_rngs", "clocks", "losses", "skipped")

  def _whole_run_state(self, arrays: PyTree, meta: dict[str, Any]) -> tuple[PyTree, dict]:
    """Across processes: the whole run's state, of which each process writes its own devices'
    replicas (`DeviceRows`) and process 0 the rest, which every process holds the same: the
    metadata of every process and the exchange's state, gathered (host copies of what differs
    between processes; what the exchange holds the same on every process is this process's
    copy). A collective, at a consistent point."""
    exchange_arrays = _exchange_arrays(arrays)
    same = set(self.exchange.same_on_every_process)
    own_copy = crossprocess.host_tree({k: v for k, v in exchange_arrays.items() if k in same})
    parts = distributed.all_gather_pickled({
        "arrays": crossprocess.host_tree({k: v for k, v in exchange_arrays.items()
                                          if k not in same}),
        "meta": meta, "first": self.first})
    whole = {key: arrays[key] for key in _OWN_ARRAYS}
    exchange_arrays, exchange_meta = self.exchange.whole_run_state(
        [({**own_copy, **part["arrays"]}, part["meta"]["exchange"], part["first"])
         for part in parts])
    whole.update(exchange_arrays)
    whole_meta = {**meta, "num_devices": self.total_devices, "exchange": exchange_meta,
                  "iterations_done": sum(part["meta"]["iterations_done"] for part in parts)}
    for key in self._PER_DEVICE_META:
      whole_meta[key] = [x for part in parts for x in part["meta"][key]]
    return whole, whole_meta

  def _own_part(self, arrays: PyTree, meta: dict[str, Any]) -> tuple[PyTree, dict]:
    """This process's devices' part of a whole-run checkpoint (`_whole_run_state`); its
    replicas are this process's already (`restore_template`)."""
    self._check_same_devices(meta)
    own = slice(self.first, self.first + self.num_devices)
    part = {key: arrays[key] for key in _OWN_ARRAYS}
    if any(len(part[key]) != self.num_devices for key in _OWN_ARRAYS):
      raise ValueError("across processes a state holds this process's replicas only")
    exchange_arrays, exchange_meta = self.exchange.own_part(
        _exchange_arrays(arrays), meta["exchange"], self.first, self.num_devices)
    part.update(exchange_arrays)
    part_meta = {**meta, "num_devices": self.num_devices, "exchange": exchange_meta,
                 "iterations_done": meta["iterations_done"] // self.total_devices
                 * self.num_devices}
    for key in self._PER_DEVICE_META:
      part_meta[key] = meta[key][own]
    return part, part_meta

  def _check_same_devices(self, meta: dict[str, Any]) -> None:
    if meta["num_devices"] != self.total_devices:
      raise ConfigError(f"this checkpoint holds {meta['num_devices']} devices' replicas; across "
                        f"processes a run resumes on as many ({self.total_devices} here)")

  def _check_format(self, meta: dict[str, Any]) -> None:
    if meta.get("format") != CHECKPOINT_FORMAT:
      raise ConfigError(
          f"this checkpoint was written by an earlier layup_jax (checkpoint format "
          f"{meta.get('format', 1)}, this version's: {CHECKPOINT_FORMAT}); resume it with the "
          f"version that wrote it, or start the run in a new workdir")

  def restore_template(self, meta: dict[str, Any]) -> PyTree:
    """Across processes, this process's devices' replicas (their rows of the checkpoint); in
    one process, every saved replica (remapped by `load_state_dict` to another count)."""
    self._check_format(meta)
    if self._remote is not None:
      self._check_same_devices(meta)
      template = {key: DeviceRows(value, self.first, self.total_devices, self._run_devices)
                  for key, value in self.store.restore_template(self.num_devices).items()}
    else:
      template = {key: DeviceRows(value) for key, value in
                  self.store.restore_template(meta["num_devices"]).items()}
    template.update(self.exchange.restore_template(meta["exchange"]))
    return template

  def load_state_dict(self, arrays: PyTree, meta: dict[str, Any]) -> None:
    self._check_format(meta)
    if self._remote is not None:
      arrays, meta = self._own_part(arrays, meta)
    saved = meta["num_devices"]
    source = self.store.load(arrays, meta["weights"], meta["iterations"])
    for k in range(self.num_devices):
      self._checks[k].applied = self.store.replicas[k].iteration
      if k < saved:  # a device that existed keeps its clock and skip count
        self._clocks[k].set_state(meta["clocks"][k])
        self._checks[k].skipped = int(meta["skipped"][source[k]])
        if saved == self.num_devices:
          self._losses[k] = list(meta["losses"][k])
    if saved == self.num_devices:
      self.peers.set_state(meta["peer_rngs"])
    else:
      self.peers.set_state(meta["peer_rngs"][:self.num_devices] + self.peers.get_state()[saved:])
    self.exchange.load_state_dict(arrays, meta["exchange"], saved)
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
