"""Synchronous data-parallel SGD, the JAX way: one jitted step over a device mesh.

Params, BatchNorm state and Optax state are replicated over a one-axis `Mesh` of the M devices,
the global batch (M per-device batches, device i's in the i-th slice) is sharded along it, and
XLA inserts the gradient mean.

BatchNorm (`baselines.ddp_batch_norm`) follows the paper's DDP, PyTorch's
`DistributedDataParallel`, by default ("replica"): each replica normalizes with its own batch's
statistics (BatchNorm is not synchronized unless it is `SyncBatchNorm`), and with
`broadcast_buffers=True` (the default) rank 0's buffers are broadcast to every replica before
each forward (torch/nn/parallel/distributed.py, `_sync_buffers` -> `_sync_module_buffers` with
`authoritative_rank=0`), so the running statistics that persist are rank 0's, updated from rank
0's batch. Here the loss is vmapped over the M per-device batches and the running statistics
kept are device 0's. "global" normalizes over the global batch (`torch.nn.SyncBatchNorm`'s
semantics): one step on M devices then equals one step on one device with the concatenated
batch. Models without BatchNorm state take the same step either way.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from layup_jax.algorithms.base import init_model
from layup_jax.data import Dataset, TrainStreams
from layup_jax.errors import NonFiniteError
from layup_jax.measure import flops
from layup_jax.models.staged import StagedModel
from layup_jax.multiprocess import gathers, setup, traffic
from layup_jax.runtime import programs
from layup_jax.runtime.scheduler import drive
from layup_jax.runtime.stats import RunStats, Snapshot
from layup_jax.runtime.straggler import IterationClock

BATCH_NORM = ("replica", "global")  # config.baselines.ddp_batch_norm


def replica_loss(model: StagedModel, num_replicas: int, params, state, inputs, targets, key,
                 iteration):
  """The mean over `num_replicas` equal slices of the batch of each slice's own loss, every
  slice normalized with its own batch statistics; the new state is slice 0's (PyTorch DDP with
  its default `broadcast_buffers`: rank 0's buffers overwrite the others' before each forward).
  Slice i draws its randomness from `fold_in(key, i)`."""
  split = lambda a: a.reshape(num_replicas, a.shape[0] // num_replicas, *a.shape[1:])
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_replicas))
  losses, states = jax.vmap(model.loss, in_axes=(None, None, 0, 0, 0, None))(
      params, state, split(inputs), split(targets), keys, iteration)
  return jnp.mean(losses), jax.tree.map(lambda a: a[0], states)


def train_step(model: StagedModel, tx: optax.GradientTransformation, params, state, opt_state,
               inputs, targets, key, iteration, skip_nonfinite: bool = False,
               num_replicas: int = 1):
  """One fused `value_and_grad` + Optax step: `(params, state, opt_state, loss, finite)`, where
  `finite[s]` says whether stage s's (device-averaged) gradient is finite. With
  `skip_nonfinite` a step with any non-finite gradient changes nothing. With `num_replicas`
  > 1 BatchNorm statistics are per replica (`replica_loss`); with 1, of the whole batch."""
  loss_fn = (functools.partial(replica_loss, model, num_replicas) if num_replicas > 1
             else model.loss)
  (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, state, inputs, targets, key, iteration
  )
  finite = jnp.stack([programs.all_finite(stage_grads) for stage_grads in grads])
  updates, new_opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params,
                                                                     step=iteration)
  new = (optax.apply_updates(params, updates), new_state, new_opt_state)
  if skip_nonfinite:
    new = programs.select(jnp.all(finite) & jnp.isfinite(loss), new, (params, state, opt_state))
  return (*new, loss, finite)


class DDPRuntime:
  """The synchronous baseline behind the same interface as LayUp's runtime."""

  arrays_stay_valid = False  # each step donates params, state and Optax state (checkpoints)

  def __init__(self, model, tx, devices, train_batches, params, state, example_batch, *,
               seed: int, straggler_delay_iters: float = 0.0, straggler_mode: str = "host",
               straggler_device: int = 0, nonfinite_policy: str = "stop",
               batch_norm: str = "replica"):
    if batch_norm not in BATCH_NORM:
      raise ValueError(f"batch_norm must be one of {BATCH_NORM}, not {batch_norm!r}")
    self.num_devices = len(devices)
    mesh = Mesh(np.asarray(devices), ("data",))
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self._sharded = NamedSharding(mesh, PartitionSpec("data"))
    # This process feeds its own devices' slices of the global batch (all of them in one process).
    self._local = setup.local_positions(devices)
    batches = list(train_batches)  # one iterator per device (none: a runtime that never trains)
    self._train_batches = [batches[i] for i in self._local] if batches else []
    self._example_batch = example_batch
    self.params = setup.put(params, self._replicated)
    self.state = setup.put(state, self._replicated)
    self.opt_state = jax.jit(tx.init, out_shardings=self._replicated)(self.params)
    self._key = setup.put(jax.random.key(seed), self._replicated)
    self._skip_nonfinite = nonfinite_policy == "skip"
    # Per-replica statistics only change something where there is BatchNorm state.
    per_replica = batch_norm == "replica" and bool(jax.tree.leaves(state))
    step = functools.partial(train_step, model, tx, skip_nonfinite=self._skip_nonfinite,
                             num_replicas=self.num_devices if per_replica else 1)
    # One device's iteration, for FLOPs: the same step on one device's batch, unsharded.
    self._one_device_step = jax.jit(functools.partial(
        train_step, model, tx, skip_nonfinite=self._skip_nonfinite))
    self._step = jax.jit(
        step,
        out_shardings=self._replicated,
        donate_argnums=(0, 1, 2),
    )
    self._steps_done = 0
    self._clock = IterationClock(straggler_delay_iters, straggler_mode, devices[straggler_device])
    # Every process holds the whole (replicated) model: nothing to collect across processes.
    self.stats = RunStats(1, model.num_stages, self._snapshot,
                          lambda: [[1.0] * model.num_stages],
                          lambda: [self._steps_done] * self.num_devices, timed=False,
                          bytes_sent=lambda: int(self._bytes_per_step * self._steps_run),
                          identical_processes=jax.process_count())
    # What each process sends to the others per step (set by `compile`), and the steps it has
    # run since it was built (a resumed run counts from its resumption, as the gossip's count).
    self._bytes_per_step, self._steps_run = 0.0, 0
    self.checkpoint = self  # one replicated model: `state_dict` and its kin are the runtime's

  def _global_batch(self):
    batches = [next(it) for it in self._train_batches]
    return self._shard(np.concatenate([b.inputs for b in batches]),
                       np.concatenate([b.targets for b in batches]))

  def _shard(self, inputs, targets):
    """The global batch from this process's slices (its devices' batches, in device order)."""
    return tuple(jax.make_array_from_process_local_data(self._sharded, a)
                 for a in (inputs, targets))

  def compile(self) -> None:
    """Replaces the jitted step by its compiled executable, so the loop cannot recompile."""
    example = self._example_batch
    args = self._shard(np.concatenate([example.inputs] * len(self._local)),
                       np.concatenate([example.targets] * len(self._local)))
    iteration = setup.put(np.int32(0), self._replicated)
    avals = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        (self.params, self.state, self.opt_state),
    )
    self._step = self._step.lower(*avals, *args, self._key, iteration).compile()
    self._bytes_per_step = traffic.compiled_share(self._step, jax.process_count())
    self._clock.compile()
    # Every process here before the first step's all-reduce: gloo forms its context then and
    # gives up after 30 s, less than a loaded host's compilation may differ by.
    gathers.all_gather_json(None)

  def _check(self, step: int, loss: jax.Array, finite: jax.Array) -> None:
    """Reads one step's loss and gradient flags: records, skips or raises NonFiniteError."""
    value, finite = float(loss), np.asarray(finite)
    if math.isfinite(value) and finite.all():
      self.stats.record_loss(0, value)
    elif self._skip_nonfinite:
      self.stats.skipped[0] += 1
    else:
      where = (f"gradient of stage {int(np.argmin(finite))} (the first non-finite)"
               if not finite.all() else f"loss ({value}), stage {len(finite) - 1}")
      raise NonFiniteError(
          f"non-finite {where} at step {step} (DDP averages the {self.num_devices} devices' "
          f"gradients inside one step, so the device is not known)")

  def run_until(self, iterations: int, on_progress: Callable[[int], None],
                should_stop: Callable[[], bool] = lambda: False) -> None:
    pending = None
    while self.iterations_done() < iterations and not should_stop():
      drive(self._clock.start_iteration())
      inputs, targets = self._global_batch()
      iteration = setup.put(np.int32(self._steps_done), self._replicated)
      self.params, self.state, self.opt_state, loss, finite = self._step(
          self.params, self.state, self.opt_state, inputs, targets, self._key, iteration
      )
      self._steps_done += 1
      self._steps_run += 1
      if pending is not None:  # one step of dispatch ahead, as LayUp's default
        self._check(*pending)
      pending = (self._steps_done - 1, loss, finite)
      drive(self._clock.end_iteration(loss))
      on_progress(self.iterations_done())
    if pending is not None:
      self._check(*pending)

  def iterations_done(self) -> int:
    return self._steps_done * self.num_devices

  def own_iterations(self) -> int:
    return self.iterations_done()

  def _snapshot(self) -> Snapshot:
    ones = [[1.0] * len(self.params)]
    # This process's copy of the replicated model (in a multi-process run the global arrays
    # span devices it cannot read).
    local = lambda tree: jax.tree.map(lambda a: a.addressable_data(0), list(tree))
    return Snapshot(params=[local(self.params)], state=[local(self.state)], weights=ones,
                    state_weights=ones)

  def flops_per_iteration(self) -> float:
    """XLA's FLOPs of one device's iteration: the step on one device's batch, lowered (as
    LayUp's count, `AsyncRuntime.flops_per_iteration`), without the gradient all-reduce."""
    example = self._example_batch
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         (self.params, self.state, self.opt_state))
    return flops.flops_of(self._one_device_step.lower(
        *avals, example.inputs, example.targets, jax.random.key(0), np.int32(0)))

  def temp_bytes(self) -> int:
    """Scratch memory per device of the compiled step (activations, gradients, all-reduce
    buffers), beyond its live arrays (call `compile()` first)."""
    return self._step.memory_analysis().temp_size_in_bytes

  # --- checkpoints: one replicated model, so a changed device count only re-shards it ---------

  def _arrays(self) -> dict[str, Any]:
    return {"params": self.params, "state": self.state, "opt_state": self.opt_state,
            "key": jax.random.key_data(self._key)}

  def state_dict(self):
    meta = {"num_devices": self.num_devices, "steps_done": self._steps_done,
            "iterations_done": self.iterations_done(), "losses": list(self.stats.losses[0]),
            "clock": self._clock.get_state(), "skipped": self.stats.skipped[0]}
    return self._arrays(), meta

  def restore_template(self, meta):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        self._arrays())

  def load_state_dict(self, arrays, meta) -> None:
    arrays = setup.put(arrays, self._replicated)
    self.params, self.state = arrays["params"], arrays["state"]
    self.opt_state = arrays["opt_state"]
    self._key = setup.put(jax.random.wrap_key_data(arrays["key"]), self._replicated)
    self._steps_done, self.stats.skipped[0] = int(meta["steps_done"]), int(meta["skipped"])
    self.stats.losses[0] = list(meta["losses"])
    self._clock.set_state(meta["clock"])

  def close(self) -> None:
    pass


def build(config: ml_collections.ConfigDict, model: StagedModel,
          tx: optax.GradientTransformation, devices: Sequence[jax.Device],
          dataset: Dataset | TrainStreams) -> DDPRuntime:
  params, state = init_model(config, model, dataset.example_batch)
  delay = config.straggler.delay_iters if config.straggler.device >= 0 else 0.0
  straggler_device = max(config.straggler.device, 0)
  if config.straggler.process >= 0:  # this process's step waits: every process's waits with it
    slow = config.straggler.process == jax.process_index()
    delay = config.straggler.delay_iters if slow else 0.0
    straggler_device = next(i for i, d in enumerate(devices)
                            if d.process_index == jax.process_index())
  return DDPRuntime(model, tx, devices, dataset.train, params, state, dataset.example_batch,
                    seed=config.seed, straggler_delay_iters=delay,
                    straggler_mode=config.straggler.mode,
                    straggler_device=straggler_device,
                    nonfinite_policy=config.faults.nonfinite,
                    batch_norm=config.baselines.ddp_batch_norm)
