"""The asynchronous runtime's compilation before training: every per-stage program an iteration
runs, run once on every device, so that none compiles inside the timed loop (concurrent first
compilations race, and a compilation there would be timed as training)."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from layup_jax.multiprocess import gathers, membership
from layup_jax.runtime import sends
from layup_jax.runtime.replicas import ReplicaStore
from layup_jax.runtime.staged_pass import backward_grads, chain_forwards, staged_pass

PyTree = Any


def compile_runtime(rt) -> None:
  """Runs every program of `rt` (an `AsyncRuntime`) once on every device, discarding results."""
  example = (rt.example_batch.inputs, rt.example_batch.targets)
  for clock in rt.clocks:
    clock.compile()
  outputs = []
  mixes = rt.options.gossip and rt.total_devices > 1
  for i, replica in enumerate(rt.store.replicas):
    inputs, targets = jax.device_put(example, replica.device)
    iteration = jax.device_put(np.int32(0), replica.device)
    grads = [None] * rt.num_stages
    # Only the programs an iteration runs (each compiles per device): with fused local steps
    # the fused backward-and-update, and no separate update per stage.
    ops = CompileStages(rt.store, i, iteration, rt.fuses_local_step, mixes, outputs)
    staged_pass(rt.model, rt.store.steps, ops, inputs, targets, replica.stage_keys, iteration,
                grads.__setitem__)
    outputs += compile_writes(rt.store, i, iteration, None if rt.fuses_local_step else grads)
  if rt.options.max_sends_in_flight:
    outputs += sends.compile_landed(rt.store)
  outputs += rt.transport.compile()
  jax.block_until_ready(outputs)
  # Every process here before the first collective: gloo forms its context on the first
  # all-reduce and gives up after 30 s, less than a loaded host's compilation may differ by.
  if not membership.members.rejoining:  # (one that rejoins meets the others later)
    gathers.all_gather_json(None)
  rt.exchange.compile()


def _copy(tree: PyTree) -> PyTree:
  """Copies of a tree's arrays, to pass as donated arguments when compiling: not the replica's."""
  return jax.tree.map(jnp.copy, tree)



def compile_writes(store: ReplicaStore, i: int, step: jax.Array, grads: Sequence[PyTree] | None) -> list:
  """Runs the update (with `grads`, one per stage; None: fused local steps, whose updates
  `compile_stages` runs) and the merge once per stage on device i, leaving the replica
  as it is; returns the outputs to wait for."""
  replica = store.replicas[i]
  outputs = []
  for s in range(store.num_stages):
    if grads is not None:
      outputs.append(store.update(replica.params[s], _copy(replica.opt_state[s]), grads[s],
                                 step, store.no_check[i], store.update_scale(i, s)))
    part = store.mixed_part(i, s)  # the form `merge` mixes
    outputs.append(store.merge_fn(part, _copy(part), np.float32(0.5)))
  return outputs

def compile_pair_average(store: ReplicaStore) -> list:
  """Runs `average_pair`'s correction once per stage on every device."""
  return [store.toward_average_fn(part, part, part)
          for i in range(store.num_devices) for s in range(store.num_stages)
          for part in [store.mixed_part(i, s)]]


class CompileStages:
  """Device i's stage programs run once each on copies (donated arguments), the replica
  unchanged: the plain ones, and with `mixes` those that mix a received stage in (a copy of
  the stage's own version stands for it). Outputs are appended to `outputs`."""

  def __init__(self, store: ReplicaStore, i: int, step: jax.Array, fused: bool, mixes: bool,
               outputs: list):
    self.store, self.i, self.step, self.fused = store, i, step, fused
    self.mixes, self.outputs = mixes and fused, outputs
    self.replica, self.steps = store.replicas[i], store.steps
    self.no_check = store.no_check[i]

  def read(self, s):
    return self.replica.params[s]

  def _received(self, s):
    return _copy(self.store.mixed_part(self.i, s)), np.float32(0.5)

  def forward(self, s, x, key, iteration):
    y, new_state, vjp = self.steps.forward[s](self.replica.params[s], self.replica.state[s], x,
                                              key, iteration)
    self.outputs.append(new_state)
    return y, vjp

  def forward_chain(self, x, keys, iteration):
    last = self.store.num_stages - 1
    inputs, y, states, vjps = chain_forwards(self.steps, self.replica.params[:last],
                                             self.replica.state[:last], x, keys, iteration)
    self.outputs.extend(states)
    return inputs, y, vjps

  def loss(self, x, labels, key, iteration):
    s = self.store.num_stages - 1
    params, state = self.replica.params[s], self.replica.state[s]
    if not self.fused:
      value, new_state, grads, dx = self.steps.loss(params, state, x, labels, key, iteration)
      self.outputs += [value, new_state]
      return value, grads, dx
    args = lambda: (x, labels, key, iteration, _copy(self.replica.opt_state[s]), self.step,
                    self.no_check, self.store.update_scale(self.i, s))
    value, new_state, new_params, *rest, dx = self.steps.loss_update(params, state, *args())
    self.outputs += [value, new_state, new_params, *rest]
    if self.mixes:
      self.outputs.append(self.steps.loss_update_mix(params, state, *self._received(s),
                                                     *args()))
    return value, new_params, dx

  def backward(self, s, vjp, x, dy, tied_grad):
    params = self.replica.params[s]
    if not self.fused:
      return backward_grads(self.steps, s, vjp, params, x, dy, tied_grad)
    args = lambda: (vjp, (params, x), dy, _copy(self.replica.opt_state[s]), self.step,
                    self.no_check, self.store.update_scale(self.i, s), tied_grad)
    if self.mixes:
      self.outputs.append(self.steps.backward_update_mix[s](*args(), self.replica.state[s],
                                                            *self._received(s)))
    new_params, opt_state, so_far, dx = self.steps.backward_update[s](*args())
    self.outputs += [new_params, opt_state, so_far]
    return new_params, dx
