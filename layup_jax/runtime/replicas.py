"""Every device's replica, and every write to it.

Device i's replica holds, per stage s, params, BatchNorm state and Optax state (one flat vector
each with `pack_stages`, layup_jax/runtime/packing.py; else a pytree) and the push-sum weight w_{i,s}.
Stages are kept as references in Python lists and replaced, never mutated, so a reader takes
the current reference without a lock and always gets a complete stage.

Every write goes through this module: the owner's forward pass (new BatchNorm statistics), its
local Optax step, a peer's merge, AD-PSGD's pairwise average, a period's reset, a restore. A
write reads the newest version, dispatches the jitted function that computes the next one and
stores the result (with w_{i,s} where the weight changes) while holding the lock of stage s of
device i. Writers of one stage therefore take turns and none is lost, which a bare
read-dispatch-store is not: jit dispatch releases the GIL, and another thread's write between
the read and the store would be overwritten. The lock is held while dispatching only
(microseconds: dispatch returns before the device computes anything), never while waiting for a
device, so no thread waits for another thread's computation; the paper's own implementation
likewise locks around the initiation of its NCCL calls (Appendix, "Updater thread").

Each (device, stage) has two locks: one for its params, Optax state and push-sum weight, one
for its BatchNorm state, so that the owner's forward (statistics) and its updater (params)
never wait for each other; a merge that mixes both takes both. Any write that needs several
takes params locks before state locks, and devices in index order, so writes cannot deadlock.
The lock type is given by the runtime (layup_jax/runtime/engine.py owns the threads).

Where the local updates are fused into the backward (`defer_merges`), a peer's stage received
under per-stage push-sum is not merged by a program of its own: it waits in the receiving
stage's inbox (with its push-sum amount) and the stage's next backward-and-update program (or
the loss stage's) mixes it in first, then updates the mixed stage, adding the amount to the
weight in the same atomic write (`DeviceStages`). Until then the stage and its inbox together
hold the stage's push-sum mass, so every sum stays exact; a stage's own send takes the stage
without its inbox (which then arrived, as far as the push-sum is concerned, just after). At
most one received stage waits per stage: an earlier one is merged by a program when a second
arrives, and at a consistent point (`settle`) every one is.

Why one module of this size: every write of a replica takes the same locks in the same order
(params before state, devices in index order), and `DeviceStages` is the store's writes as the
staged pass dispatches them; kept apart, the locking discipline would be read in two places.
"""

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from layup_jax.models.staged import StagedModel, stage_key
from layup_jax.pushsum import mixing, remap
from layup_jax.runtime import transfer
from layup_jax.runtime.options import RuntimeOptions
from layup_jax.runtime.packing import StagePacking
from layup_jax.runtime.programs import local_update, make_stage_steps
from layup_jax.runtime.scheduler import Ready, Task
from layup_jax.runtime.staged_pass import backward_grads, chain_forwards
from layup_jax.runtime.stats import Snapshot

PyTree = Any


class _BothLocks:
  """A stage's params lock and its BatchNorm state lock, held as one (params first). A plain
  class rather than a generator-based context manager, which took four to eight Python calls
  each time: every stage write takes its locks (docs/records/host.md, "Less Python per stage write")."""

  __slots__ = ("first", "second")

  def __init__(self, first: contextlib.AbstractContextManager,
               second: contextlib.AbstractContextManager):
    self.first, self.second = first, second

  def __enter__(self) -> None:
    self.first.__enter__()
    try:
      self.second.__enter__()
    except BaseException:
      self.first.__exit__(None, None, None)
      raise

  def __exit__(self, *exc) -> None:
    self.second.__exit__(*exc)
    self.first.__exit__(*exc)


_NO_LOCK = contextlib.nullcontext()


@dataclasses.dataclass
class Replica:
  device: jax.Device
  params: list[PyTree]
  state: list[PyTree]
  opt_state: list[PyTree]
  stage_keys: list[jax.Array]  # stages.stage_key of this replica's key, one per stage
  iteration: int = 0  # iterations this device has started


class ReplicaStore:
  """The replicas of all devices, their push-sum weights, and the only code that writes them."""

  def __init__(self, model: StagedModel, tx: optax.GradientTransformation,
               devices: Sequence[jax.Device], init_params: list[PyTree],
               init_state: list[PyTree], options: RuntimeOptions,
               lock: Callable[[], contextlib.AbstractContextManager], first: int = 0,
               total_devices: int | None = None):
    """`devices` are the run's devices `first ..` (all of them in one process); replica i
    draws its randomness as device `first + i` of `total_devices`."""
    self.num_devices, self.num_stages = len(devices), model.num_stages
    self.bn_policy = options.bn_policy
    # A stage without BatchNorm state keeps its empty dict: its forward writes nothing.
    self._has_state = [bool(jax.tree.leaves(st)) for st in init_state]
    self.packings = self.state_packings = None
    if options.pack_stages:
      self.packings = [StagePacking.of(p) for p in init_params]
      self.state_packings = [StagePacking.of(st) if has else None
                              for st, has in zip(init_state, self._has_state)]
      init_params = [jax.jit(k.pack)(p) for k, p in zip(self.packings, init_params)]
      init_state = [jax.jit(k.pack)(st) if k else st
                    for k, st in zip(self.state_packings, init_state)]
      self._unpack = [jax.jit(k.unpack) for k in self.packings]
      self._unpack_state = [jax.jit(k.unpack) if k else (lambda st: st)
                            for k in self.state_packings]
    # Whatever the policy, a non-finite gradient or statistic never reaches the replica: it
    # would travel to peers with the next send, and under `stop` the run's error would then
    # name whichever device read its loss first rather than the one it appeared on. The
    # policy decides only whether the run goes on (the runtime reads the checks).
    self.by_halves = options.by_halves  # gradients per half batch (`make_stage_steps`)
    step_fn = functools.partial(local_update, tx, skip_nonfinite=True, by_halves=self.by_halves)
    self._merge_state = [self.bn_policy == "mix" and has for has in self._has_state]
    self.steps = make_stage_steps(model, keep_finite_state=True,
                                  packings=self.packings, state_packings=self.state_packings,
                                  remat=options.remat, update=step_fn,
                                  merge_state=self._merge_state,
                                  chain_forwards=options.chain_forwards,
                                  by_halves=self.by_halves)
    # Donated: the Optax state and the gradient, which only the update reads (the new params
    # take the gradient's buffer; a gradient per half has no params' shape, so is not given).
    # Params are never donated: forwards, backwards and sends read them; nor is a received
    # stage, which marks its send as landed (`merge`).
    self.update = jax.jit(step_fn, donate_argnums=(1,) if self.by_halves else (1, 2))
    self.merge_fn = jax.jit(mixing.merge)
    self.toward_average_fn = jax.jit(mixing.toward_average)
    self._add = jax.jit(optax.tree.add)
    base_key = jax.random.key(options.seed)
    self.replicas = [
        Replica(
            device=device,
            params=list(jax.device_put(init_params, device)),
            state=list(jax.device_put(init_state, device)),
            opt_state=list(jax.device_put([tx.init(p) for p in init_params], device)),
            stage_keys=jax.device_put(
                [stage_key(jax.random.fold_in(base_key, first + i), s)
                 for s in range(self.num_stages)],
                device),
        )
        for i, device in enumerate(devices)
    ]
    self.weights = mixing.PushSumWeights(self.num_devices, self.num_stages, total_devices)
    # Whether a received stage waits for its stage's next fused program (`merge`): set by the
    # runtime where the local updates are fused into the backward.
    self.defer_merges = False
    # A peer's stage received for (j, s) and not mixed in yet: (received, amount), at most one.
    self._inbox: list[list[tuple | None]] = [[None] * self.num_stages for _ in devices]
    self._locks = [[lock() for _ in range(self.num_stages)] for _ in devices]
    self._state_locks = [[lock() for _ in range(self.num_stages)] for _ in devices]
    self._both_locks = [[_BothLocks(p, st) for p, st in zip(params, states)]
                        for params, states in zip(self._locks, self._state_locks)]
    # Merges dispatched into each device and not yet seen computed (`pending_merges`): their
    # outputs, dropped once computed. A merged stage superseded before it is computed is still
    # in the device's queue; held here, it stays alive no longer than until that point is seen.
    self._merges_into = [collections.deque() for _ in devices]
    # The finiteness of the updates device i applied in the iteration under way: (stages in
    # the order updated, `local_update`'s first_nonfinite). Only device i's updater touches it.
    self.no_check = [jax.device_put(np.int32(-1), d) for d in devices]
    self._unit_scale = [jax.device_put(np.float32(1.0), d) for d in devices]
    self._numerator = options.local_update == "numerator"
    self._max_update_scale = options.max_update_scale
    self._open_checks = [([], start) for start in self.no_check]

  # --- reads (no lock: a reference is always a complete stage) -------------------------------

  def device(self, i: int) -> jax.Device:
    return self.replicas[i].device

  def params(self, i: int, s: int) -> PyTree:
    return self.replicas[i].params[s]

  def part_template(self, s: int) -> PyTree:
    """Shapes and dtypes of what a send of stage s carries (`take`'s part)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.mixed_part(0, s))

  def mixed_part(self, i: int, s: int) -> PyTree:
    """What a merge of stage s mixes: its params, and its BatchNorm statistics under "mix"."""
    replica = self.replicas[i]
    if self.bn_policy == "mix" and self._has_state[s]:
      return replica.params[s], replica.state[s]
    return replica.params[s]

  def _writing(self, i: int, s: int) -> contextlib.AbstractContextManager:
    """The locks of what a merge of stage s of device i writes."""
    return self._stage_locks(i, s, params=True, state=self._merge_state[s])

  def _stage_locks(self, i: int, s: int, params: bool,
                   state: bool) -> contextlib.AbstractContextManager:
    """The lock of stage s's params and of its BatchNorm state, as asked, params first (the
    order every write takes them in)."""
    if params:
      return self._both_locks[i][s] if state else self._locks[i][s]
    return self._state_locks[i][s] if state else _NO_LOCK

  def _store_mixed_part(self, i: int, s: int, part: PyTree) -> None:
    replica = self.replicas[i]
    if isinstance(part, tuple):
      replica.params[s], replica.state[s] = part
    else:
      replica.params[s] = part

  # --- writes ----------------------------------------------------------------------------------

  def local_step(self, i: int, s: int, grads: PyTree | None, step: jax.Array) -> PyTree:
    """Paper Algorithm 1, local update: `x_{i,s} <- x_{i,s} - eta grad`, applied to the newest
    x_{i,s} (whatever peers merged into it since the gradient's forward). `grads` None: the
    runtime fused it into the stage's backward program (`DeviceStages.backward`, under the
    same atomic write), so it is already applied. Returns the new params; their gradient's
    finiteness is read later (`close_checks`)."""
    replica = self.replicas[i]
    if grads is None:
      return replica.params[s]
    order, so_far = self._open_checks[i]
    with self._locks[i][s]:
      replica.params[s], replica.opt_state[s], so_far = self.update(
          replica.params[s], replica.opt_state[s], grads, step, so_far, self.update_scale(i, s))
      new_params = replica.params[s]
    order.append(s)
    self._open_checks[i] = (order, so_far)
    return new_params

  def update_scale(self, i: int, s: int, arriving: float = 0.0) -> np.float32 | jax.Array:
    """The factor of device i's next local update of stage s (the caller holds the stage's
    lock): 1 for the paper's form, `layup.local_update=params`; in the numerator form its equal
    share over its weight (`PushSumWeights.update_scale`), with `arriving` the amount a mix in
    the same program adds to that weight first."""
    if not self._numerator:
      return self._unit_scale[i]
    return np.float32(self.weights.update_scale(i, s, self._max_update_scale, arriving))

  def device_stages(self, i: int, step: jax.Array, fused: bool) -> "DeviceStages":
    """`stages.StageOps` of device i for an iteration at the run's `step`: each stage program
    an atomic write of the replica; with `fused`, the local updates in the loss and backward
    programs."""
    return DeviceStages(self, i, step, fused)

  def take(self, i: int, s: int, halve: bool) -> tuple[PyTree, float | None]:
    """Stage s of device i as it is now, to send, and (`halve`: per-stage push-sum) the amount
    of weight that travels with it: w_{i,s} is halved in the same atomic step, so the stage
    and its weight leave together."""
    with self._locks[i][s]:
      return self.mixed_part(i, s), (self.weights.halve(i, s) if halve else None)

  def merge(self, j: int, s: int, received: PyTree, sent: float, add_weight: bool) -> PyTree:
    """Paper Algorithm 1, peer update: `x_{j,s} <- (w_j x_{j,s} + a x_{i,s}) / (w_j + a)` for a
    received stage (on device j, computed) that carries weight `sent`. With `add_weight`
    (per-stage push-sum) it goes to the stage's inbox, and the stage's next forward mixes it in
    and adds a to w_{j,s} (module docstring); without (per-model weights, added after the last
    stage) it is merged now by a program of its own. Returns an array that is ready once the
    stage is on device j."""
    with self._writing(j, s):
      if not (add_weight and self.defer_merges):
        landed = self._merge_now(j, s, received, sent, add_weight)
      else:
        if self._inbox[j][s] is not None:  # at most one waits: the earlier one goes in now
          self._merge_waiting_one(j, s)
        self._inbox[j][s] = (received, sent)
        landed = jax.tree.leaves(received)[0]
    self._note_merge(j, landed)
    return landed

  def _note_merge(self, j: int, landed: jax.Array) -> None:
    """Counts a merge into device j as dispatched (`pending_merges`), dropping those seen
    computed first: held, their outputs would stay alive, and a run that never asks (the serial
    mode) would keep every merge it ever made."""
    self._drop_computed(j)
    self._merges_into[j].append(landed)

  def _merge_now(self, j: int, s: int, received: PyTree, sent: float,
                 add_weight: bool = True) -> jax.Array:
    """The merge as a program of its own (the caller holds `_writing(j, s)`)."""
    share = np.float32(self.weights.receiver_share(j, s, sent))
    merged = self.merge_fn(self.mixed_part(j, s), received, share)
    self._store_mixed_part(j, s, merged)
    if add_weight:
      self.weights.add(j, s, sent)
    return jax.tree.leaves(merged)[0]

  def merge_waiting(self) -> None:
    """Merges every received stage still in an inbox (at a consistent point, or between
    iterations in the serial mode), each by a program of its own."""
    for j in range(self.num_devices):
      for s in range(self.num_stages):
        if self._inbox[j][s] is not None:
          with self._writing(j, s):
            if self._inbox[j][s] is not None:
              self._merge_waiting_one(j, s)

  def _merge_waiting_one(self, j: int, s: int) -> None:
    """Merges the received stage waiting for (j, s) by a program of its own (the caller holds
    `_writing(j, s)`); the merge, computed after the copy, now marks its send as pending."""
    received, sent = self._inbox[j][s]
    self._inbox[j][s] = None
    merged = self._merge_now(j, s, received, sent)
    pending, copy = self._merges_into[j], jax.tree.leaves(received)[0]
    for back in range(1, len(pending) + 1):  # from the newest: the copy is among them
      try:
        if pending[-back] is copy:
          pending[-back] = merged
          return
      except IndexError:  # another updater dropped computed ones meanwhile
        break
    self._note_merge(j, merged)

  def _take_inbox(self, i: int, s: int) -> tuple | None:
    """The received stage waiting for (i, s), removed, with the receiver's share
    `w_{i,s} / (w_{i,s} + a)` (the caller holds the stage's locks and adds the amount)."""
    held = self._inbox[i][s]
    if held is None:
      return None
    self._inbox[i][s] = None
    received, amount = held
    return received, np.float32(self.weights.receiver_share(i, s, amount)), amount

  def holds_weight(self, j: int, s: int) -> bool:
    """Whether stage s of device j has push-sum weight, merged or waiting in its inbox."""
    with self._locks[j][s]:
      return self.weights.values[j][s] > 0 or self._inbox[j][s] is not None

  def pending_merges(self, j: int) -> int:
    """How many merges into device j are dispatched and not yet computed, as far as seen: the
    oldest are dropped once computed. Updaters of several devices share the count; two
    dropping at once may drop one too many, which only undercounts."""
    self._drop_computed(j)
    return len(self._merges_into[j])

  def _drop_computed(self, j: int) -> None:
    """Drops the oldest merges into device j that are computed."""
    pending = self._merges_into[j]
    while pending and pending[0].is_ready():
      try:
        pending.popleft()
      except IndexError:
        break

  def settle(self) -> None:
    """Merges what waits in the inboxes, waits until every merge dispatched so far is
    computed and drops its output (at a consistent point: no task is sending)."""
    self.merge_waiting()
    for pending in self._merges_into:
      jax.block_until_ready(list(pending))
      pending.clear()

  def halve_model_weight(self, i: int) -> list[float]:
    """Per-model push-sum (Algorithm 1's `w_i <- w_i / 2`): every stage's weight of device i
    halved together; returns the amounts."""
    with contextlib.ExitStack() as held:
      for lock in self._locks[i]:
        held.enter_context(lock)
      return [self.weights.halve(i, s) for s in range(self.num_stages)]

  def add_model_weight(self, j: int, amounts: Sequence[float]) -> None:
    """Per-model push-sum (Algorithm 1's `w_j <- w_j + w_i`), every stage together."""
    with contextlib.ExitStack() as held:
      for lock in self._locks[j]:
        held.enter_context(lock)
      for s, amount in enumerate(amounts):
        self.weights.add(j, s, amount)

  def average_pair(self, i: int, j: int, s: int) -> Task:
    """AD-PSGD's pairwise average of stage s: `x_i, x_j <- (x_i + x_j) / 2`.

    Both versions are read together, waited for (the average needs both models computed; the
    calling task waits, no device does), copied across, and each side then receives the
    correction `(other - mine) / 2` on its newest version (`mixing.toward_average`), so the
    sum of the two models is kept whatever landed meanwhile.
    """
    first, second = sorted((i, j))
    with self._locks[first][s], self._locks[second][s]:
      mine, theirs = self.mixed_part(i, s), self.mixed_part(j, s)
    yield Ready((mine, theirs))
    theirs_here = transfer.to_device(theirs, self.device(i))
    mine_there = transfer.to_device(mine, self.device(j))
    self.correct_toward(i, s, mine, theirs_here)
    self.correct_toward(j, s, theirs, mine_there)

  def correct_toward(self, i: int, s: int, before: PyTree, other: PyTree) -> None:
    """One side of a pairwise average: stage s of device i, read as `before`, receives
    `(other - before) / 2` on its newest version (`mixing.toward_average`); `other` is the
    peer's version, on device i."""
    with self._writing(i, s):
      self._store_mixed_part(i, s, self.toward_average_fn(self.mixed_part(i, s), before, other))

  def add_to_params(self, i: int, s: int, delta: PyTree) -> None:
    """`x_{i,s} <- x_{i,s} + delta` (params only): compressed sends give back the mass they held
    out (layup_jax/pushsum/compression.py), at a consistent point."""
    with self._locks[i][s]:
      replica = self.replicas[i]
      replica.params[s] = self._add(replica.params[s], delta)

  def reset(self, i: int, params: Sequence[PyTree], state: Sequence[PyTree] | None) -> None:
    """Device i's model <- given per-stage params and state (a period's result); `state`
    None keeps the device's own BatchNorm state."""
    replica = self.replicas[i]
    for s in range(self.num_stages):
      with self._locks[i][s], self._state_locks[i][s]:
        self._inbox[i][s] = None  # a reset replaces what a send brought too
        replica.params[s] = params[s]
        if state is not None:
          replica.state[s] = state[s]

  # --- finiteness of the local updates --------------------------------------------------------

  def close_checks(self, i: int) -> tuple[list[int], jax.Array] | None:
    """The finiteness check of device i's iteration just applied (stages in update order,
    `local_update`'s first_nonfinite), or None if it applied no update; starts the next."""
    order, so_far = self._open_checks[i]
    self._open_checks[i] = ([], self.no_check[i])
    return (order, so_far) if order else None

  # --- views ----------------------------------------------------------------------------------

  def stage_params(self, i: int) -> list[PyTree]:
    """Device i's params, one pytree per stage (unpacked where stages are stored packed)."""
    params = list(self.replicas[i].params)
    if self.packings:
      return [unpack(p) for unpack, p in zip(self._unpack, params)]
    return params

  def stage_state(self, i: int) -> list[PyTree]:
    """Device i's BatchNorm state, one pytree per stage (unpacked as `stage_params`)."""
    state = list(self.replicas[i].state)
    if self.packings:
      return [unpack(st) for unpack, st in zip(self._unpack_state, state)]
    return state

  def snapshot(self) -> Snapshot:
    weights = [list(row) for row in self.weights.values]
    uniform = [[1.0] * self.num_stages for _ in range(self.num_devices)]
    return Snapshot(
        params=[self.stage_params(i) for i in range(self.num_devices)],
        state=[self.stage_state(i) for i in range(self.num_devices)],
        weights=weights,
        state_weights=weights if self.bn_policy == "mix" else uniform,
    )

  # --- compilation and checkpoints --------------------------------------------------------------

  # --- checkpoints ----------------------------------------------------------------------------

  def load(self, arrays: PyTree, weights: Sequence[Sequence[float]],
           iterations: Sequence[int]) -> list[int]:
    """Replaces every replica and weight by saved ones (remapped when they were saved on
    another number of devices, `layup_jax.pushsum.remap`); returns, per device, the saved replica whose
    identity (keys, step counter) it inherits."""
    saved = len(arrays["replicas"])
    if saved == self.num_devices:
      trees, new_weights, source = arrays["replicas"], [list(w) for w in weights], list(
          range(saved))
    else:
      host = jax.tree.map(np.asarray, arrays["replicas"])
      trees, new_weights, source = remap.remap_replicas(host, weights, self.num_devices)
    for k, replica in enumerate(self.replicas):
      tree = jax.device_put(trees[k], replica.device)
      with contextlib.ExitStack() as held:
        for lock in self._locks[k] + self._state_locks[k]:
          held.enter_context(lock)
        replica.params, replica.state = list(tree["params"]), list(tree["state"])
        replica.opt_state = list(tree["opt_state"])
        self.weights.values[k] = list(new_weights[k])
      replica.iteration = int(iterations[source[k]])
      if k < saved:  # a device that existed keeps its keys
        replica.stage_keys = [jax.device_put(jax.random.wrap_key_data(d), replica.device)
                              for d in arrays["stage_keys"][k]]
    return source


class DeviceStages:
  """Device i's stage programs for one iteration (`stages.StageOps`), each an atomic write of
  its replica: the program reads the stage's newest version and its result is stored under the
  stage's lock(s). With `fused`, the loss program and each backward also apply the stage's
  local update (Algorithm 1's local update on the newest x_{i,s}, the gradient never a separate
  array) and return the updated params, and they first mix in a received stage waiting in the
  stage's inbox (`ReplicaStore.merge`), in the same program; else they return the gradient,
  which the updater applies."""

  def __init__(self, store: ReplicaStore, i: int, step: jax.Array, fused: bool):
    self.store, self.i, self.step, self.fused = store, i, step, fused
    self.replica = store.replicas[i]
    self.steps = store.steps

  def read(self, s):
    return self.replica.params[s]

  def forward(self, s, x, key, iteration):
    store, replica = self.store, self.replica
    if not store._has_state[s]:  # writes nothing: no lock
      y, _, vjp = self.steps.forward[s](replica.params[s], replica.state[s], x, key, iteration)
      return y, vjp
    with store._state_locks[self.i][s]:
      y, replica.state[s], vjp = self.steps.forward[s](replica.params[s], replica.state[s], x,
                                                       key, iteration)
    return y, vjp

  def forward_chain(self, x, keys, iteration):
    """The forwards as one program, every stage's new state stored under its state lock (the
    locks taken in stage order, as no other writer takes two)."""
    store, replica, last = self.store, self.replica, self.store.num_stages - 1
    locks = [store._state_locks[self.i][s] for s in range(last) if store._has_state[s]]
    for lock in locks:
      lock.acquire()
    try:
      inputs, y, states, vjps = chain_forwards(self.steps, replica.params[:last],
                                               replica.state[:last], x, keys, iteration)
      for s in range(last):
        if store._has_state[s]:
          replica.state[s] = states[s]
    finally:
      for lock in reversed(locks):
        lock.release()
    return inputs, y, vjps

  def loss(self, x, labels, key, iteration):
    store, i, replica, steps = self.store, self.i, self.replica, self.steps
    s = store.num_stages - 1
    if not self.fused:
      with store._stage_locks(i, s, params=False, state=store._has_state[s]):
        value, new_state, grads, dx = steps.loss(replica.params[s], replica.state[s], x,
                                                 labels, key, iteration)
        replica.state[s] = new_state
      return value, grads, dx
    with store._stage_locks(i, s, params=True, state=store._has_state[s]):
      held = store._take_inbox(i, s)
      order, so_far = store._open_checks[i]
      scale = store.update_scale(i, s, held[2] if held else 0.0)
      args = (x, labels, key, iteration, replica.opt_state[s], self.step, so_far, scale)
      if held is None:
        out = steps.loss_update(replica.params[s], replica.state[s], *args)
      else:
        out = steps.loss_update_mix(replica.params[s], replica.state[s], *held[:2], *args)
        store.weights.add(i, s, held[2])
      value, replica.state[s], replica.params[s], replica.opt_state[s], so_far, dx = out
      new_params = replica.params[s]
    order.append(s)
    store._open_checks[i] = (order, so_far)
    return value, new_params, dx

  def backward(self, s, vjp, x, dy, tied_grad):
    store, i, replica, steps = self.store, self.i, self.replica, self.steps
    if not self.fused:
      return backward_grads(steps, s, vjp, replica.params[s], x, dy, tied_grad)
    order, so_far = store._open_checks[i]
    mixing = store._inbox[i][s] is not None  # one arriving now waits for the next program
    with store._stage_locks(i, s, params=True, state=mixing and store._merge_state[s]):
      held = store._take_inbox(i, s) if mixing else None
      scale = store.update_scale(i, s, held[2] if held else 0.0)
      args = (vjp, (replica.params[s], x), dy, replica.opt_state[s], self.step, so_far, scale,
              tied_grad)
      if held is None:
        replica.params[s], replica.opt_state[s], so_far, dx = steps.backward_update[s](*args)
      else:
        replica.params[s], replica.opt_state[s], so_far, dx, state = steps.backward_update_mix[
            s](*args, replica.state[s], *held[:2])
        replica.state[s] = state
        store.weights.add(i, s, held[2])
      new_params = replica.params[s]
    order.append(s)
    store._open_checks[i] = (order, so_far)
    return new_params, dx


