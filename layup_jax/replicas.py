"""Every device's replica, and every write to it.

Device i's replica holds, per stage s, params, BatchNorm state and Optax state (one flat vector
each with `pack_stages`, layup_jax/packing.py; else a pytree) and the push-sum weight w_{i,s}.
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
The lock type is given by the runtime (layup_jax/runtime.py owns the threads).
"""

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from layup_jax import nonfinite, pushsum, remap, transfer
from layup_jax.options import RuntimeOptions
from layup_jax.packing import StagePacking
from layup_jax.snapshot import Snapshot
from layup_jax.stages import StagedModel, make_stage_steps, stage_key

PyTree = Any


@dataclasses.dataclass
class Replica:
  device: jax.Device
  params: list[PyTree]
  state: list[PyTree]
  opt_state: list[PyTree]
  stage_keys: list[jax.Array]  # stages.stage_key of this replica's key, one per stage
  iteration: int = 0  # iterations this device has started


def _copy(tree: PyTree) -> PyTree:
  """Copies of a tree's arrays, to pass as donated arguments when compiling: not the replica's."""
  return jax.tree.map(jnp.copy, tree)


def local_update(tx: optax.GradientTransformation, params, opt_state, grads, step: jax.Array,
                 first_nonfinite: jax.Array | None = None, skip_nonfinite: bool = False):
  """One Optax step of one stage: `(new_params, new_opt_state, first_nonfinite)`.

  `step` is the run's global step when the gradient's iteration began; it reaches every
  transformation that takes a `step` extra argument (layup_jax/optim.py's learning-rate
  schedule). `first_nonfinite` follows the updates of one iteration in the order they are
  applied, so that the host reads one scalar per iteration rather than a flag per stage:
  `-(n + 1)` while the n gradients so far were finite (start with -1, the default), else the
  position n of the first non-finite one. With `skip_nonfinite`, a non-finite gradient leaves
  params and optimizer state as they were.
  """
  finite = nonfinite.all_finite(grads)
  updates, new_opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params,
                                                                     step=step)
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
    self.packings = self._state_packings = None
    if options.pack_stages:
      self.packings = [StagePacking.of(p) for p in init_params]
      self._state_packings = [StagePacking.of(st) if has else None
                              for st, has in zip(init_state, self._has_state)]
      init_params = [jax.jit(k.pack)(p) for k, p in zip(self.packings, init_params)]
      init_state = [jax.jit(k.pack)(st) if k else st
                    for k, st in zip(self._state_packings, init_state)]
      self._unpack = [jax.jit(k.unpack) for k in self.packings]
      self._unpack_state = [jax.jit(k.unpack) if k else (lambda st: st)
                            for k in self._state_packings]
    # Whatever the policy, a non-finite gradient or statistic never reaches the replica: it
    # would travel to peers with the next send, and under `stop` the run's error would then
    # name whichever device read its loss first rather than the one it appeared on. The
    # policy decides only whether the run goes on (the runtime reads the checks).
    step_fn = functools.partial(local_update, tx, skip_nonfinite=True)
    self.steps = make_stage_steps(model, keep_finite_state=True,
                                  packings=self.packings, state_packings=self._state_packings,
                                  remat=options.remat, update=step_fn)
    # Donated: the Optax state and the gradient, which only the update reads (the new params
    # take the gradient's buffer), and the received copy of a peer's stage (the merge's output
    # takes its buffer). Params are never donated: forwards, backwards and sends read them.
    self.update = jax.jit(step_fn, donate_argnums=(1, 2))
    self.merge_fn = jax.jit(pushsum.merge, donate_argnums=(1,))
    self._toward_average = jax.jit(pushsum.toward_average)
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
    self.weights = pushsum.PushSumWeights(self.num_devices, self.num_stages, total_devices)
    self._locks = [[lock() for _ in range(self.num_stages)] for _ in devices]
    self._state_locks = [[lock() for _ in range(self.num_stages)] for _ in devices]
    # Merges dispatched into each device and not yet seen computed (`pending_merges`): their
    # outputs, dropped once computed. A merged stage superseded before it is computed is still
    # in the device's queue; held here, it stays alive no longer than until that point is seen.
    self._merges_into = [collections.deque() for _ in devices]
    # The finiteness of the updates device i applied in the iteration under way: (stages in
    # the order updated, `local_update`'s first_nonfinite). Only device i's updater touches it.
    self._no_check = [jax.device_put(np.int32(-1), d) for d in devices]
    self._open_checks = [([], start) for start in self._no_check]

  # --- reads (no lock: a reference is always a complete stage) -------------------------------

  def device(self, i: int) -> jax.Device:
    return self.replicas[i].device

  def params(self, i: int, s: int) -> PyTree:
    return self.replicas[i].params[s]

  def part_template(self, s: int) -> PyTree:
    """Shapes and dtypes of what a send of stage s carries (`take`'s part)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._mixed_part(0, s))

  def _mixed_part(self, i: int, s: int) -> PyTree:
    """What a merge of stage s mixes: its params, and its BatchNorm statistics under "mix"."""
    replica = self.replicas[i]
    if self.bn_policy == "mix" and self._has_state[s]:
      return replica.params[s], replica.state[s]
    return replica.params[s]

  @contextlib.contextmanager
  def _writing(self, i: int, s: int):
    """Holds the locks of what a merge of stage s of device i writes."""
    with self._locks[i][s]:
      if self.bn_policy == "mix" and self._has_state[s]:
        with self._state_locks[i][s]:
          yield
      else:
        yield

  def _store_mixed_part(self, i: int, s: int, part: PyTree) -> None:
    replica = self.replicas[i]
    if isinstance(part, tuple):
      replica.params[s], replica.state[s] = part
    else:
      replica.params[s] = part

  # --- writes ----------------------------------------------------------------------------------

  def run_forward(self, i: int, s: int, forward: Callable[[PyTree], tuple[Any, PyTree]]) -> Any:
    """`forward(state of stage s) -> (outputs, new state)`, storing the new BatchNorm state
    in the same atomic write (a merge of the statistics that lands meanwhile is not lost)."""
    replica = self.replicas[i]
    if not self._has_state[s]:
      return forward(replica.state[s])[0]
    with self._state_locks[i][s]:
      outputs, replica.state[s] = forward(replica.state[s])
    return outputs

  def local_step(self, i: int, s: int, grads: PyTree, step: jax.Array) -> PyTree:
    """Paper Algorithm 1, local update: `x_{i,s} <- x_{i,s} - eta grad`, applied to the newest
    x_{i,s} (whatever peers merged into it since the gradient's forward). Returns the new
    params; their gradient's finiteness is read later (`close_checks`)."""
    replica = self.replicas[i]
    order, so_far = self._open_checks[i]
    with self._locks[i][s]:
      replica.params[s], replica.opt_state[s], so_far = self.update(
          replica.params[s], replica.opt_state[s], grads, step, so_far)
      new_params = replica.params[s]
    order.append(s)
    self._open_checks[i] = (order, so_far)
    return new_params

  def backward_step(self, i: int, s: int, vjp: PyTree, x: PyTree, dy: PyTree,
                    tied_grad: PyTree | None, step: jax.Array) -> tuple[PyTree, PyTree]:
    """Stage s's backward and Algorithm 1's local update in one program (s below the loss
    stage): the backward reads the newest x_{i,s}, as `staged_pass` always has it read, and the
    update applies to that same version in the same atomic write, so it is `local_step` on the
    newest params with the gradient computed in place. Returns `(new params, dx)`."""
    replica = self.replicas[i]
    order, so_far = self._open_checks[i]
    with self._locks[i][s]:
      replica.params[s], replica.opt_state[s], so_far, dx = self.steps.backward_update[s](
          vjp, (replica.params[s], x), dy, replica.opt_state[s], step, so_far, tied_grad)
      new_params = replica.params[s]
    order.append(s)
    self._open_checks[i] = (order, so_far)
    return new_params, dx

  def local_steps(self, i: int, step: jax.Array) -> "StoreLocalSteps":
    """`staged_pass`'s `local_step` for device i's iteration at the run's `step`."""
    return StoreLocalSteps(self, i, step)

  def take(self, i: int, s: int, halve: bool) -> tuple[PyTree, float | None]:
    """Stage s of device i as it is now, to send, and (`halve`: per-stage push-sum) the amount
    of weight that travels with it: w_{i,s} is halved in the same atomic step, so the stage
    and its weight leave together."""
    with self._locks[i][s]:
      return self._mixed_part(i, s), (self.weights.halve(i, s) if halve else None)

  def merge(self, j: int, s: int, received: PyTree, sent: float, add_weight: bool) -> PyTree:
    """Paper Algorithm 1, peer update: `x_{j,s} <- (w_j x_{j,s} + a x_{i,s}) / (w_j + a)` for a
    received stage (on device j, computed) that carries weight `sent`; with `add_weight`
    (per-stage push-sum) also `w_{j,s} += a`, in the same atomic write. Returns the merged
    stage."""
    with self._writing(j, s):
      share = np.float32(self.weights.receiver_share(j, s, sent))
      merged = self.merge_fn(self._mixed_part(j, s), received, share)
      self._store_mixed_part(j, s, merged)
      if add_weight:
        self.weights.add(j, s, sent)
    self._merges_into[j].append(jax.tree.leaves(merged)[0])
    return merged

  def pending_merges(self, j: int) -> int:
    """How many merges into device j are dispatched and not yet computed, as far as seen: the
    oldest are dropped once computed. Updaters of several devices share the count; two
    dropping at once may drop one too many, which only undercounts."""
    pending = self._merges_into[j]
    while pending and pending[0].is_ready():
      try:
        pending.popleft()
      except IndexError:
        break
    return len(pending)

  def settle(self) -> None:
    """Waits until every merge dispatched so far is computed and drops its output (at a
    consistent point: no thread is sending)."""
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

  def average_pair(self, i: int, j: int, s: int) -> None:
    """AD-PSGD's pairwise average of stage s: `x_i, x_j <- (x_i + x_j) / 2`.

    Both versions are read together, waited for (the average needs both models computed; the
    calling thread waits, no device does), copied across, and each side then receives the
    correction `(other - mine) / 2` on its newest version (`pushsum.toward_average`), so the
    sum of the two models is kept whatever landed meanwhile.
    """
    first, second = sorted((i, j))
    with self._locks[first][s], self._locks[second][s]:
      mine, theirs = self._mixed_part(i, s), self._mixed_part(j, s)
    jax.block_until_ready((mine, theirs))
    theirs_here = transfer.to_device(theirs, self.device(i))
    mine_there = transfer.to_device(mine, self.device(j))
    self.correct_toward(i, s, mine, theirs_here)
    self.correct_toward(j, s, theirs, mine_there)

  def correct_toward(self, i: int, s: int, before: PyTree, other: PyTree) -> None:
    """One side of a pairwise average: stage s of device i, read as `before`, receives
    `(other - before) / 2` on its newest version (`pushsum.toward_average`); `other` is the
    peer's version, on device i."""
    with self._writing(i, s):
      self._store_mixed_part(i, s, self._toward_average(self._mixed_part(i, s), before, other))

  def reset(self, i: int, params: Sequence[PyTree], state: Sequence[PyTree] | None) -> None:
    """Device i's model <- given per-stage params and state (a period's result); `state`
    None keeps the device's own BatchNorm state."""
    replica = self.replicas[i]
    for s in range(self.num_stages):
      with self._locks[i][s], self._state_locks[i][s]:
        replica.params[s] = params[s]
        if state is not None:
          replica.state[s] = state[s]

  # --- finiteness of the local updates --------------------------------------------------------

  def close_checks(self, i: int) -> tuple[list[int], jax.Array] | None:
    """The finiteness check of device i's iteration just applied (stages in update order,
    `local_update`'s first_nonfinite), or None if it applied no update; starts the next."""
    order, so_far = self._open_checks[i]
    self._open_checks[i] = ([], self._no_check[i])
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

  def compile_writes(self, i: int, step: jax.Array, grads: Sequence[PyTree] | None) -> list:
    """Runs the update (with `grads`, one per stage; None: fused local steps, whose updates
    `compile_local_steps` runs) and the merge once per stage on device i, leaving the replica
    as it is; returns the outputs to wait for."""
    replica = self.replicas[i]
    outputs = []
    for s in range(self.num_stages):
      if grads is not None:
        outputs.append(self.update(replica.params[s], _copy(replica.opt_state[s]), grads[s],
                                   step, self._no_check[i]))
      part = self._mixed_part(i, s)  # the form `merge` mixes
      outputs.append(self.merge_fn(part, _copy(part), np.float32(0.5)))
    return outputs

  def compile_local_steps(self, i: int, step: jax.Array, outputs: list) -> "CompileLocalSteps":
    """A `local_step` for `staged_pass` that runs the fused backward-and-update functions on
    device i without changing the replica, appending their outputs to `outputs`."""
    return CompileLocalSteps(self, i, step, outputs)

  def compile_pair_average(self) -> list:
    """Runs `average_pair`'s correction once per stage on every device."""
    return [self._toward_average(part, part, part)
            for i in range(self.num_devices) for s in range(self.num_stages)
            for part in [self._mixed_part(i, s)]]

  def replica_arrays(self, i: int) -> dict[str, list]:
    r = self.replicas[i]
    return {"params": list(r.params), "state": list(r.state), "opt_state": list(r.opt_state)}

  def restore_template(self, saved_devices: int) -> PyTree:
    """Shapes, dtypes and target devices of `saved_devices` replicas (device k % M each)."""
    device_of = lambda j: self.device(j % self.num_devices)
    return {
        "replicas": device_arrays_like(self.replica_arrays(0), device_of, saved_devices),
        "stage_keys": device_arrays_like([jax.random.key_data(k)
                                          for k in self.replicas[0].stage_keys],
                                         device_of, saved_devices),
    }

  def arrays(self) -> PyTree:
    return {"replicas": [self.replica_arrays(i) for i in range(self.num_devices)],
            "stage_keys": [[jax.random.key_data(k) for k in r.stage_keys]
                           for r in self.replicas]}

  def load(self, arrays: PyTree, weights: Sequence[Sequence[float]],
           iterations: Sequence[int]) -> list[int]:
    """Replaces every replica and weight by saved ones (remapped when they were saved on
    another number of devices, `layup_jax.remap`); returns, per device, the saved replica whose
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


@dataclasses.dataclass(frozen=True)
class StoreLocalSteps:
  """Device i's local updates dispatched from its backward pass (`stages.LocalStep`)."""

  store: ReplicaStore
  i: int
  step: jax.Array

  def backward(self, s, vjp, x, dy, tied_grad):
    return self.store.backward_step(self.i, s, vjp, x, dy, tied_grad, self.step)

  def apply(self, s, grads):
    return self.store.local_step(self.i, s, grads, self.step)


@dataclasses.dataclass(frozen=True)
class CompileLocalSteps:
  """The fused functions, and the loss stage's update, run once on copies (donated
  arguments), the replica unchanged."""

  store: ReplicaStore
  i: int
  step: jax.Array
  outputs: list

  def backward(self, s, vjp, x, dy, tied_grad):
    replica = self.store.replicas[self.i]
    opt_state = _copy(replica.opt_state[s])
    params, opt_state, so_far, dx = self.store.steps.backward_update[s](
        vjp, (replica.params[s], x), dy, opt_state, self.step, self.store._no_check[self.i],
        tied_grad)
    self.outputs.extend([params, opt_state, so_far])
    return params, dx

  def apply(self, s, grads):
    replica = self.store.replicas[self.i]
    opt_state = _copy(replica.opt_state[s])
    params, opt_state, so_far = self.store.update(replica.params[s], opt_state, grads,
                                                  self.step, self.store._no_check[self.i])
    self.outputs.extend([params, opt_state, so_far])
    return params
