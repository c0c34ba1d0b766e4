"""Resuming a run: its newest readable checkpoint (or `config.restore`'s) loaded into the
runtime, and every device's data iterator put back where it stopped."""

import jax
from absl import logging

from layup_jax import data
from layup_jax.checkpoint import manager
from layup_jax.checkpoint.checks import check_compatible
from layup_jax.checkpoint.manager import Checkpoints, Peers
from layup_jax.errors import ConfigError
from layup_jax.multiprocess import gathers, membership


def restore_data(dataset: data.Dataset, saved: list[dict], step: int, exact: bool = True) -> None:
  """Each device's iterator where it stopped; on another device count, or from a checkpoint
  that an elastic run wrote after losing a process (not `exact`: its devices read shards of
  another count), every device at the same share of the data order (the samples already seen
  are skipped, not their exact order)."""
  if exact and len(saved) == len(dataset.train):
    for iterator, state in zip(dataset.train, saved):
      iterator.set_state(state)
    return
  consumed = step * len(saved)  # batches taken over all saved devices
  for iterator in dataset.train:
    iterator.set_state({**saved[0], "next_index": consumed // len(dataset.train)})


def run_peers() -> Peers:
  """This run's processes, which restore together: every process's value through the
  coordination service's store, the run's leader moving damaged checkpoints aside."""
  if jax.process_count() == 1:
    return Peers.alone()
  return Peers(gathers.all_gather_json, membership.members.leader == jax.process_index())


def restore(config, runtime, dataset, checkpoints: Checkpoints) -> tuple[int, float] | None:
  """Loads the newest checkpoint of the workdir that every process reads, else
  `config.restore`'s; (step, time)."""
  current = config.to_json_best_effort()
  peers = run_peers()

  def template_of(where):
    def template(meta):
      check_compatible(meta["config"], current, where)
      return runtime.checkpoint.restore_template(meta["runtime"])
    return template

  restored = checkpoints.restore(template_of(checkpoints.directory), peers=peers)
  source = checkpoints.directory
  if restored is None and config.restore:
    external, step = manager.open_restore_path(config.restore, config.checkpoint.keep)
    try:
      restored = external.restore(template_of(external.directory), step, quarantine=False,
                                  peers=peers)
    finally:
      external.close()
    if restored is None:
      raise ConfigError(f"config.restore={config.restore!r}: no readable checkpoint there")
    source = external.directory
  if restored is None:
    return None
  step, arrays, meta = restored
  runtime.checkpoint.load_state_dict(arrays, meta["runtime"])
  saved = meta["runtime"]  # written on fewer devices than its run had: after a loss
  restore_data(dataset, meta["data"], step,
                exact=saved.get("devices_of_run") in (None, saved.get("num_devices")))
  logging.warning("resumed from the checkpoint %s/%d (step %d)", source, step, step)
  return step, float(meta["train_time_s"])
