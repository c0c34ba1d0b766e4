"""The asynchronous runtime: every device's compute and updater work (paper Section 3), driven
as cooperative tasks (layup_jax/runtime/scheduler.py) by two threads per process.

Compute task i dispatches device i's forward stage by stage (each stage reading the device's
current params), the loss and the backwards, each with its stage's local update where the
exchange allows it (`Exchange.fuses_local_step`), and hands each stage to updater task i as it
is dispatched. Updater task i runs the algorithm's hooks per iteration (`begin`, `on_stage` per
stage, `end`; layup_jax/runtime/exchange.py), then the iteration counts as finished. A task yields what
it waits for, so the thread running every device's tasks never blocks on one device: compute
tasks run on the dispatcher thread, updater (and latency) tasks on the updater thread
(`tuning.updater_thread=False`: on the dispatcher's). A compute task dispatches at most
`max_dispatch_ahead` iterations ahead of its device and of its updater.

`iterate_serial` runs one whole iteration of one device on the calling thread, blocking on each
wait: the deterministic mode for exact tests; `grant` and `step` drive the same tasks from a
test's thread. docs/concepts/runtime.md walks through one iteration and the invariants the tests hold.
"""

import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax

from layup_jax.data.pipeline import Batch
from layup_jax.errors import NonFiniteError
from layup_jax.measure import flops
from layup_jax.models.staged import StagedModel
from layup_jax.multiprocess import gathers, membership, setup
from layup_jax.multiprocess.elastic import Elastic
from layup_jax.runtime import costs, transfer
from layup_jax.runtime.exchange import Exchange, Links
from layup_jax.runtime.options import RuntimeOptions
from layup_jax.runtime.pace import Pace, rate_by_speed
from layup_jax.runtime.replicas import ReplicaStore
from layup_jax.runtime.scheduler import (
  Budget,
  Ready,
  Scheduler,
  Task,
  Threads,
  Turns,
  Until,
  awaited,
  drive,
  idle_poll_s,
  pin_calling_thread,
  pins_threads,
  shared_core,
)
from layup_jax.runtime.sends import Outbox, PeerSampler, Transport
from layup_jax.runtime.staged_pass import staged_pass
from layup_jax.runtime.state import RuntimeCheckpoint
from layup_jax.runtime.stats import FiniteChecks, RunStats, StageTimer
from layup_jax.runtime.straggler import IterationClock
from layup_jax.runtime.warmup import compile_runtime

PyTree = Any
_UPDATER_CLOSES = object()  # a handed-over stage whose iteration's checks the updater closes


class WorkerError(RuntimeError):
  """A compute or updater task failed; the message names its device and stage."""


class AsyncRuntime:
  """An algorithm's `Exchange` on the given devices: as tasks on two threads, or one iteration
  at a time with `iterate_serial`."""

  def __init__(self, model: StagedModel, tx: optax.GradientTransformation,
               devices: Sequence[jax.Device], train_batches: Sequence[Iterator[Batch]],
               init_params: list[PyTree], init_state: list[PyTree], example_batch: Batch,
               make_exchange: Callable[[Links], Exchange], options: RuntimeOptions):
    self.options = options
    # Across processes, this process runs its own devices only (global positions first ..
    # first + num_devices - 1 of the run's `total_devices`); every index below is a position
    # among them, except peers, which are global.
    positions = setup.local_block(devices)
    self.first, self.total_devices = positions[0], len(devices)
    self.run_devices = tuple(devices)
    devices = [devices[p] for p in positions]
    self.train_batches = [list(train_batches)[p] for p in positions]
    self.num_devices, self.num_stages = len(devices), model.num_stages
    self.model, self.example_batch = model, example_batch
    self.store = ReplicaStore(model, tx, devices, init_params, init_state, options,
                              lock=threading.Lock, first=self.first,
                              total_devices=self.total_devices)
    self.peers = PeerSampler(self.total_devices, options.seed, options.gossip, self.first,
                             self.num_devices, options.remote_peer_probability)
    self.threads = Threads(on_failure=lambda: self._budget.close())
    stopped = self.threads.stopped
    self.transport = Transport(self.store, self.first, self.total_devices,
                               options.transfer_host, stopped, options.max_remote_backlog)
    self.across_processes = self.transport.across_processes
    self.elastic = Elastic(self)  # an elastic run trains on when a process is lost
    self.outboxes = [Outbox(self.store, i, self.transport, self.peers.choose,
                            options.max_sends_in_flight) for i in range(self.num_devices)]
    self.exchange = make_exchange(Links(self.store, self.outboxes, self.peers, options,
                                        stopped, self.run_devices, self.transport))
    if self.exchange.sends_stages:  # only pushed stages are compressed between processes
      self.transport.compress_sends(options.compression)
    self.fuses_local_step = self.exchange.fuses_local_step and options.fuse_local_step
    self.store.defer_merges = self.fuses_local_step
    self.clocks = [IterationClock(options.delay_of(i, jax.process_index()),
                                  options.straggler_mode, device)
                   for i, device in enumerate(devices)]
    self.stats = RunStats(
        self.num_devices, self.num_stages, self.store.snapshot, lambda: self.store.weights.values,
        lambda: [r.iteration - at for r, at in zip(self.store.replicas, self.elastic.joined_at)],
        gather=gathers.all_gather_data if self.across_processes else None,
        remote_latencies=self.transport.latencies,
        host_cpu=lambda: sum(s.cpu_s for s in {self.dispatcher, self.updater}),
        bytes_sent=lambda: self.transport.sent.total,
        sends_dropped=lambda: self.transport.sends_dropped)
    self._checks = FiniteChecks(self.num_devices, options.nonfinite, self.stats,
                                self.num_stages - 1)
    self.checkpoint = RuntimeCheckpoint(self)
    self._timer = StageTimer(self.num_devices, self.stats)  # update latencies
    # Stage each task is at, to name it when it fails: (role, device) -> stage index.
    self._position: dict[tuple[str, int], int | None] = {}
    # What compute task i handed to updater i, in order: (stage, output, step, checks).
    self._handed = [collections.deque() for _ in devices]
    # The dispatcher's thread runs the compute tasks; the updater tasks run on a thread of
    # their own (the two take turns, `scheduler.Turns`) or on the dispatcher's.
    turns = Turns()
    poll = idle_poll_s(options.idle_poll_s, self.run_devices[0].platform)
    self.dispatcher = Scheduler("dispatcher", turns, poll)
    self.updater = (Scheduler("updater", turns, poll) if options.updater_thread
                    else self.dispatcher)
    self._budget = Budget(self.num_devices, on_grant=self.dispatcher.wake)
    # The run's iterations against this process's: one to one until a lost process's share of
    # the samples falls to this one (`Elastic`).
    self.pace = Pace(self.num_devices)
    if self.across_processes:
      self.elastic.listen()

  @property
  def replicas(self):
    return self.store.replicas

  # --- one iteration's pieces, shared by the serial and the threaded modes --------------------

  def _compute_iteration(self, i: int, index: int,
                         emit: Callable[[int, PyTree, Any, Any], None]):
    """Dispatches the forward and backward pass of device i, the run's iteration `index`
    (nothing waits); `emit(stage, grads, step, closed)` as each gradient appears (with fused
    local steps: the updated params, and with stage 0 the iteration's closed finiteness check;
    else `_UPDATER_CLOSES`). Returns the loss and stage 0's output."""
    store, replica, fused = self.store, self.store.replicas[i], self.fuses_local_step
    batch = next(self.train_batches[i])
    step = (replica.iteration if self.exchange.schedule_by_own_iteration
            else self.pace.nominal(index) // self.num_devices)
    x, labels, iteration, step = transfer.to_device(
        (batch.inputs, batch.targets, np.int32(replica.iteration), np.int32(step)),
        replica.device)
    replica.iteration += 1

    def at_stage(s: int) -> None:  # names the stage if a program of it fails
      self._position["compute", i] = s

    def emit_stage(s: int, out: PyTree) -> None:
      closed = store.close_checks(i) if fused and s == 0 else _UPDATER_CLOSES
      emit(s, out, step, closed)

    return staged_pass(self.model, store.steps, store.device_stages(i, step, fused),
                       x, labels, replica.stage_keys, iteration, emit_stage, on_stage=at_stage)

  def _apply_iteration(self, i: int) -> Task:
    """Updater i's part of one iteration: the exchange's begin, on_stage per stage handed over
    by compute task i, end (a task: it waits for the hand-overs and whatever the hooks wait
    for)."""
    handed = self._handed[i]
    every = self.options.latency_every
    timed = bool(every) and self._checks.applied[i] % every == 0
    self.outboxes[i].watch = timed
    context = None
    for count in range(self.num_stages):
      if not handed:
        yield Until(lambda: handed, f"device {i}'s next stage")
      s, out, step, closed = handed.popleft()
      if count == 0:
        context = yield from awaited(self.exchange.begin(i))
      self._position["updater", i] = s
      if timed:
        yield Ready(out)  # the gradient, or the updated stage
        start = time.perf_counter()
      landed = yield from awaited(
          self.exchange.on_stage(i, context, s, None if self.fuses_local_step else out, step))
      if timed and landed is not None:
        self._timer.hand(i, s, start, landed)
    yield from awaited(self.exchange.end(i, context))
    self._position["updater", i] = None
    if closed is _UPDATER_CLOSES:
      closed = self.store.close_checks(i)
    self._checks.applied_one(i, closed)

  def iterate_serial(self, i: int, peer: int | None | str = "random") -> float:
    """One whole iteration of device i on the calling thread: the deterministic mode for exact
    tests. `peer` scripts device i's next peer (None: no peer; "random": the sampler's pick, as
    in the threaded mode). Returns the loss."""
    if peer != "random":
      self.peers.script(i, peer)
    if self.exchange.before_iteration is not None:
      drive(awaited(self.exchange.before_iteration(i)))
    index = self._budget.start_now()
    iteration = self.store.replicas[i].iteration
    handed: list[tuple] = []
    loss, _ = self._compute_iteration(i, index, lambda *item: handed.append(item))
    self._checks.record_loss(i, iteration, float(loss))
    self._handed[i].extend(handed)  # last stage first, as the backward emits them
    drive(self._apply_iteration(i))
    self.store.merge_waiting()  # as it would be had every send been merged on arrival
    self._timer.record_now(i)  # no latency task here
    self._budget.finish()
    self._budget.record()
    self._checks.read(i)
    return float(loss)

  # --- compilation ----------------------------------------------------------------------------

  def compile(self) -> None:
    """Runs every per-stage program once on every device (layup_jax/runtime/warmup.py)."""
    compile_runtime(self)

  # --- the tasks ------------------------------------------------------------------------------

  def _read_losses(self, i: int, pending: collections.deque, keep: int) -> Task:
    """Reads device i's oldest dispatched losses until `keep` are left (each is ready once its
    iteration's forward pass has run)."""
    while len(pending) > keep:
      iteration, loss = pending[0]
      yield Ready(loss)
      pending.popleft()
      self._checks.record_loss(i, iteration, float(loss))
      self._budget.record()

  def _compute_task(self, i: int) -> Task:
    pending: collections.deque = collections.deque()
    clock, budget, ahead = self.clocks[i], self._budget, self.options.max_dispatch_ahead
    slowed = clock.delay_iters > 0  # only a straggler's clock measures and delays
    before_iteration = self.exchange.before_iteration
    replica, applied = self.store.replicas[i], self._checks.applied
    behind = lambda: replica.iteration - applied[i]  # dispatched, not applied by the updater
    while True:
      waits = before_iteration(i) if before_iteration is not None else None
      if waits is not None:  # for other devices: read every loss first
        yield from self._read_losses(i, pending, keep=0)
        yield from awaited(waits)
      own = self.store.replicas[i].iteration if self.exchange.equal_shares else None
      index = budget.try_acquire(own)
      while index is None:
        yield from self._read_losses(i, pending, keep=0)  # nothing to dispatch: read them all
        if budget.closed:
          return
        yield Until(lambda own=own: budget.may_start(own) or budget.closed, "a granted iteration")
        index = budget.try_acquire(own)
      if behind() >= ahead:
        yield Until(lambda: behind() < ahead, "the updater")
      if slowed:
        yield from clock.start_iteration()
      iteration = self.store.replicas[i].iteration
      held = []  # stage 0, the backward's last: the clock may wait for it before its updater
      hand_over = lambda *item, held=held: (held.append(item) if item[0] == 0
                                            else self._hand_over(i, item))
      loss, last = self._compute_iteration(i, index, hand_over)
      if slowed:
        yield from clock.end_iteration(last)  # (an unfused updater would donate the gradient)
      self._hand_over(i, held.pop())
      pending.append((iteration, loss))
      last = loss = None  # holds no stage past the iteration
      # Bound how far this task dispatches ahead of its device.
      yield from self._read_losses(i, pending, keep=ahead - 1)

  def _hand_over(self, i: int, item: tuple) -> None:
    self._handed[i].append(item)
    self.updater.wake()

  def _updater_task(self, i: int) -> Task:
    while True:
      yield from self._apply_iteration(i)
      self._checks.read(i, wait=False)
      self._budget.finish()  # last: the main thread may now read this device
      self.dispatcher.wake()

  def _spawn_tasks(self) -> None:
    if self._spawned:
      return
    self._spawned = True
    for sender in self.outboxes:  # tasks: a slow peer's full queue must not stall a sender
      sender.reroute_congested = True
    for i in range(self.num_devices):
      self.dispatcher.spawn(f"compute:{i}", self._compute_task(i))
      self.updater.spawn(f"updater:{i}", self._updater_task(i))
      if self.options.latency_every:
        self.updater.spawn(f"latency:{i}", self._timer.task(i))

  _spawned = False

  def grant(self, iterations: int) -> None:
    """Lets the compute tasks start iterations until `iterations` have started in total."""
    self._budget.grant(iterations)

  def step(self) -> bool:
    """Runs every task that can go on, once, on the calling thread, before any thread of the
    runtime runs them: the deterministic seam for tests (`grant`, then `step` until a
    condition holds). Returns whether any task ran; raises what a task raised."""
    if self.threads.started:
      raise RuntimeError("step() drives the tasks only while the runtime's threads do not")
    self._spawn_tasks()
    ran = self.dispatcher.step()
    if self.updater is not self.dispatcher:
      ran = self.updater.step() or ran
    self.raise_if_failed()
    return ran

  def start_threads(self) -> None:
    self._spawn_tasks()
    stopped = self.threads.stopped
    pinned = pins_threads(self.options.pin_host_threads, self.updater is not self.dispatcher,
                          self.run_devices[0].platform)
    core = shared_core(jax.process_index()) if pinned else None

    def run(scheduler: Scheduler) -> None:
      pin_calling_thread(core)
      scheduler.run(stopped)
      if scheduler.failure is not None:  # stops the other threads too (named by the task)
        raise scheduler.failure.error

    self.threads.start([(f"layup-{s.name}", lambda s=s: run(s))
                         for s in dict.fromkeys((self.dispatcher, self.updater))]
                        + self.transport.loops())  # a receiver, a notice writer per other process

  def raise_if_failed(self) -> None:
    """Raises the first failure, naming its task, device and stage (or its thread)."""
    failed = [s.failure for s in (self.dispatcher, self.updater) if s.failure is not None]
    if failed:
      role, i = failed[0].name.split(":")
      what, stage, exc = (f"{role} task of device {i}", self._position.get((role, int(i))),
                          failed[0].error)
    elif self.threads.failure is not None:
      name, exc = self.threads.failure
      what, stage = f"thread {name}", None
    else:
      return
    self.close()
    if isinstance(exc, NonFiniteError):
      raise exc
    raise WorkerError(f"{what} failed at stage {stage}: {type(exc).__name__}: {exc}") from exc

  # --- the Runtime interface ------------------------------------------------------------------

  def run_until(self, iterations: int, on_progress: Callable[[int], None],
                should_stop: Callable[[], bool] = lambda: False) -> None:
    if self.threads.stopped():
      self.raise_if_failed()
      raise RuntimeError("the runtime was closed")
    if not self.threads.started:
      self.start_threads()
    # `iterations` is the run's count (steps x this process's devices); this process's own
    # is `pace.actual` of it, and grows while the wait lasts if a process is lost meanwhile.
    target, held = self.pace.actual(iterations), False
    began, finished_before = time.monotonic(), self._budget.finished
    self._budget.grant(target)
    while not self._budget.wait_finished(target, timeout=0.1):
      self.raise_if_failed()
      on_progress(self.pace.nominal(self._budget.finished))
      if not held and should_stop():
        # No new iterations beyond the next whole step; those under way finish.
        target, held = self._budget.hold(self.num_devices), True
      elif not held and (stretched := self.pace.actual(iterations)) != target:
        target = stretched
        self._budget.grant(target)
    self.raise_if_failed()
    # This process's speed over the interval: its iterations per second per device until it
    # had done its share (not the wait for the others' that follows).
    own, seconds = self._budget.finished - finished_before, time.monotonic() - began
    speed = own / seconds / self.num_devices if own >= 2 * self.num_devices else None
    for i in range(self.num_devices):  # every task is idle: read the last flags
      self._checks.read(i)
    reports = []
    if self.across_processes:
      # Every process idle and every send to another process merged there: then nothing is
      # in flight anywhere, and the push-sum sums are exact again.
      self.transport.quiesce()
      reports = gathers.all_gather_json({"process": jax.process_index(), "speed": speed})
      self.raise_if_failed()
    while not self._timer.idle():  # every landing handed over is recorded
      self.raise_if_failed()
      time.sleep(0.001)
    if self.exchange.state is not None:
      self.exchange.state.settle()
    self.transport.settle()
    self.store.settle()
    if self.across_processes and membership.members.elastic:
      self.elastic.at_consistent_point(iterations // self.num_devices)
    if (self.across_processes and self.options.share_by_speed
        and not self.exchange.equal_shares):  # (a periodic average needs equal shares)
      self._share_by_speed(reports, iterations)
    on_progress(self.pace.nominal(self._budget.finished))

  def _share_by_speed(self, reports: list, iterations: int) -> None:
    """At a consistent point (the run's count `iterations` of this process's), with
    `distributed.share_by_speed`: this process's rate until the next one, its share of the
    run's iterations in proportion to its devices' speed in the interval just ended, from every
    live process's report (`reports`, as gathered: checked and bounded, `rate_by_speed`); a
    lost process's share goes to the survivors as without it (`Elastic._pace`)."""
    devices = self.elastic.live_devices_by_process()
    planned = (self.total_devices if self.options.survivors_train_lost_share
               else sum(devices.values()))
    rate = rate_by_speed(reports, devices, jax.process_index(), planned)
    if rate is not None:
      self.pace.set_rate(rate, self.iterations_started(), iterations)

  def iterations_started(self) -> int:
    """This process's iterations begun (its own count, not the run's)."""
    return self._budget.started

  def iterations_done(self) -> int:
    """The run's count (`pace.nominal` of this process's own)."""
    return self.pace.nominal(self._budget.finished)

  def own_iterations(self) -> int:
    return self._budget.finished

  def restored(self, iterations_done: int) -> None:
    """Counts a restored checkpoint's iterations as done (`RuntimeCheckpoint`)."""
    self._budget.reset(iterations_done)
    self.pace = Pace(self.num_devices, iterations_done)
    for i, replica in enumerate(self.store.replicas):
      self._checks.applied[i] = replica.iteration

  def flops_per_iteration(self, analyse: Callable = flops.lowered) -> float:
    return costs.replica_flops(self.model, self.store, self.example_batch, analyse)

  def temp_bytes(self) -> int:
    """The largest scratch memory XLA allocates for one of this runtime's functions (a merge
    needs none beyond its output)."""
    return costs.staged_temp_bytes(*costs.replica_calls(self.model, self.store,
                                                        self.example_batch))

  def close(self) -> None:
    self.threads.stop()
    self._budget.close()
    self.dispatcher.wake()
    self.updater.wake()
    self.threads.join()
