"""The asynchronous runtime's compilation before training: every per-stage program an iteration
runs, run once on every device, so that none compiles inside the timed loop (concurrent first
compilations race, and a compilation there would be timed as training)."""

import jax
import numpy as np

from layup_jax import distributed, transport
from layup_jax.stages import staged_pass


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
    ops = rt.store.compile_stages(i, iteration, rt.fuses_local_step, mixes, outputs)
    staged_pass(rt.model, rt.store.steps, ops, inputs, targets, replica.stage_keys, iteration,
                grads.__setitem__)
    outputs += rt.store.compile_writes(i, iteration, None if rt.fuses_local_step else grads)
  if rt.options.max_sends_in_flight:
    outputs += transport.compile_landed(rt.store)
  outputs += rt.transport.compile()
  jax.block_until_ready(outputs)
  # Every process here before the first collective: gloo forms its context on the first
  # all-reduce and gives up after 30 s, less than a loaded host's compilation may differ by.
  if not distributed.members.rejoining:  # (one that rejoins meets the others later)
    distributed.all_gather_json(None)
  rt.exchange.compile()
