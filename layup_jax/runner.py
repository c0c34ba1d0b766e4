"""Builds a run from its config, trains with evaluations at fixed steps, and writes the records.

The only orchestrator: it never looks at which algorithm runs; each one is a `Runtime`.
"""

import dataclasses
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import tqdm
from absl import logging

from layup_jax import (
  algorithms,
  checkpointing,
  compile_cache,
  data,
  distributed,
  flops,
  measurements,
  models,
  optim,
  provenance,
)
from layup_jax.checkpointing import Checkpoints, check_compatible
from layup_jax.config_validation import resolve_num_steps, validate_config
from layup_jax.errors import ConfigError, StorageError
from layup_jax.evaluation import Evaluator
from layup_jax.metrics import MetricsWriter


@dataclasses.dataclass
class _Progress:
  """A tqdm bar in global steps (device iterations / M)."""

  bar: tqdm.tqdm
  num_devices: int

  def __call__(self, iterations: int) -> None:
    self.bar.update(iterations // self.num_devices - self.bar.n)


def eval_steps(num_steps: int, eval_every: int) -> list[int]:
  """Steps after which to evaluate: every `eval_every` steps and at the end."""
  steps = list(range(eval_every, num_steps, eval_every)) if eval_every else []
  return steps + [num_steps]


def _checkpoint_steps(num_steps: int, every: int) -> list[int]:
  return (list(range(every, num_steps, every)) if every else []) + [num_steps]


def _restore_data(dataset: data.Dataset, saved: list[dict], step: int) -> None:
  """Each device's iterator where it stopped; on another device count, every device at the
  same share of the data order (the samples already seen are skipped, not their exact order)."""
  if len(saved) == len(dataset.train):
    for iterator, state in zip(dataset.train, saved):
      iterator.set_state(state)
    return
  consumed = step * len(saved)  # batches taken over all saved devices
  for iterator in dataset.train:
    iterator.set_state({**saved[0], "next_index": consumed // len(dataset.train)})


def _restore(config, runtime, dataset, checkpoints: Checkpoints) -> tuple[int, float] | None:
  """Loads the workdir's newest readable checkpoint, else `config.restore`'s; (step, time)."""
  current = config.to_json_best_effort()

  def template_of(where):
    def template(meta):
      check_compatible(meta["config"], current, where)
      return runtime.checkpoint.restore_template(meta["runtime"])
    return template

  restored = checkpoints.restore(template_of(checkpoints.directory))
  source = checkpoints.directory
  if restored is None and config.restore:
    external, step = checkpointing.open_restore_path(config.restore, config.checkpoint.keep)
    try:
      restored = external.restore(template_of(external.directory), step, quarantine=False)
    finally:
      external.close()
    if restored is None:
      raise ConfigError(f"config.restore={config.restore!r}: no readable checkpoint there")
    source = external.directory
  if restored is None:
    return None
  step, arrays, meta = restored
  runtime.checkpoint.load_state_dict(arrays, meta["runtime"])
  _restore_data(dataset, meta["data"], step)
  logging.warning("resumed from the checkpoint %s/%d (step %d)", source, step, step)
  return step, float(meta["train_time_s"])


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
        should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
  """Trains `config` and returns the summary also written to `workdir/summary.json`.

  Resumes from the newest checkpoint in `workdir/checkpoints` (else from `config.restore`).
  When `should_stop()` turns true (SIGTERM, Ctrl-C) the run stops at the next consistent point,
  saves a checkpoint and returns `{"stopped": True, "step": ...}` without a summary.
  """
  validate_config(config, len(jax.devices()))
  distributed.check_supported(config)
  code_version = provenance.code_version()  # the code that runs (a commit during it changes none)
  compile_cache.enable(config.get("compilation_cache_dir", ""))
  workdir = pathlib.Path(workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise StorageError(f"cannot create the workdir {workdir} ({error.strerror or error})") \
        from error
  num_devices = config.num_devices
  devices = jax.devices()[:num_devices]
  dataset = data.make_dataset(config.data, num_devices, config.seed)
  model = models.make_model(config.model)
  num_steps = resolve_num_steps(config, dataset.steps_per_epoch)
  tx = optim.make_optimizer(config.optimizer, num_steps, dataset.steps_per_epoch)
  runtime = algorithms.build_runtime(config, model, tx, devices, dataset)
  primary = distributed.is_primary()  # process 0 evaluates and writes the records
  evaluator = Evaluator(model, dataset.test, devices[0]) if primary else None
  checkpoints, writer = None, None
  start_step, train_time = 0, 0.0
  flops_per_iteration, peak = None, flops.peak_flops(devices[0])

  def samples_per_s() -> float:
    return sum(runtime.stats.iterations_per_device()) * config.data.batch_size / max(train_time, 1e-9)

  def throughput() -> dict[str, Any]:
    return measurements.throughput(runtime.stats.iterations_per_device(), config.data.batch_size,
                                   train_time, flops_per_iteration, peak)

  latencies: list[list[float]] | None = None  # every sample of this process, per stage
  remote_latencies: list[float] = []  # every send between processes (process 0, gathered)

  def stage_latencies() -> list[float | None] | None:
    nonlocal latencies
    recent = runtime.stats.stage_latencies()
    if recent is not None:
      latencies = [old + new for old, new in zip(latencies or [[] for _ in recent], recent)]
    return measurements.stage_latency_ms(recent)

  def evaluate(step: int, write: bool = True) -> dict[str, Any]:  # process 0 only
    train_loss = runtime.stats.train_loss()
    sums = runtime.stats.weight_sums()
    common = {"step": step, "time_s": train_time, "weight_sum_min": min(sums),
              "weight_sum_max": max(sums)}
    if step > 0 and write:
      writer.write({**common, "split": "train", "loss": train_loss,
                    "samples_per_s": samples_per_s(), **throughput(),
                    "stage_update_latency_ms": stage_latencies(),
                    "skipped_steps": runtime.stats.skipped_steps()})
    remote_latencies.extend(runtime.stats.remote_send_latencies())
    record = {**common, "split": "test", **evaluator.evaluate(runtime.stats.snapshot())}
    if dataset.kind == "language_model":  # accuracy is next-token accuracy
      record["perplexity"] = math.exp(min(record["loss"], 50.0))
    if write:
      writer.write(record)
    return record

  saved_step = None

  def save(step: int) -> None:
    nonlocal saved_step
    if step == saved_step:
      return
    saved_step = step
    arrays, runtime_meta = runtime.checkpoint.state_dict()
    checkpoints.save(step, arrays, {
        "step": step, "train_time_s": train_time, "runtime": runtime_meta,
        "data": distributed.data_states(dataset.train, devices),
        "config": config.to_json_best_effort(), "saved_at": time.time()},
        arrays_stay_valid=runtime.checkpoint.arrays_stay_valid)

  try:
    if config.checkpoint.enabled:
      checkpointing.check_storage(workdir, checkpointing.tree_bytes(runtime.checkpoint.state_dict()[0]),
                                  config.checkpoint.keep)
      checkpoints = Checkpoints(workdir / "checkpoints", config.checkpoint.keep,
                                config.checkpoint.async_save)
      restored = _restore(config, runtime, dataset, checkpoints)
      if restored is not None:
        start_step, train_time = restored
    writer = MetricsWriter(workdir, keep_through_step=start_step if start_step else None,
                           tensorboard=config.metrics.get("tensorboard", False), files=primary)
    compile_start = time.perf_counter()
    runtime.compile()
    compile_s = time.perf_counter() - compile_start
    try:
      flops_per_iteration = runtime.flops_per_iteration()
    except Exception as error:  # noqa: BLE001 - a missing count must not stop training
      logging.warning("no FLOP count for this run (%s: %s); MFU is not reported",
                      type(error).__name__, error)
    # The iterations of one step that this process's runtime counts: its own devices' (a
    # gossip runtime across processes), else every device's.
    per_step = runtime.num_devices
    if start_step == 0:
      runtime.stats.collect()
    record = evaluate(0) if start_step == 0 and primary else None
    checkpoint_at = set(_checkpoint_steps(num_steps, config.checkpoint.every)
                        if checkpoints else [])
    evaluate_at = set(eval_steps(num_steps, config.eval_every))
    step, stopped = start_step, False
    stop_now, stop_within = should_stop, should_stop
    if jax.process_count() > 1:
      # Processes stop together, at the next evaluation or checkpoint: one that stopped alone
      # would leave the others waiting in a collective (a stop request reaches each process
      # at its own moment; they agree on it here).
      stop_now = lambda: any(distributed.all_gather_json(bool(should_stop())))
      stop_within = lambda: False
    bar = tqdm.tqdm(total=num_steps, initial=start_step, desc=f"{config.algorithm} x{num_devices}",
                    unit="step", disable=not (config.progress_bar and primary), file=sys.stderr,
                    dynamic_ncols=True)
    with bar:
      for target in sorted(s for s in evaluate_at | checkpoint_at if s > start_step):
        if stop_now():
          stopped = True
          break
        start = time.perf_counter()
        runtime.run_until(target * per_step, _Progress(bar, per_step), stop_within)
        train_time += time.perf_counter() - start
        step = runtime.iterations_done() // per_step
        if step < target:
          stopped = True
          break
        if target in evaluate_at:
          runtime.stats.collect()
        if target in evaluate_at and primary:
          record = evaluate(step)
          bar.set_postfix(acc=f"{record['accuracy']:.3f}", loss=f"{record['loss']:.3f}")
        if target in checkpoint_at:
          start = time.perf_counter()
          save(step)  # the time training waits for a save counts as training time
          train_time += time.perf_counter() - start
    if stopped:
      if checkpoints is not None and step > start_step:
        save(step)  # unless this step's checkpoint was just saved
      if checkpoints is not None:
        checkpoints.wait()
      return {"stopped": True, "primary": primary, "step": step, "num_steps": num_steps,
              "checkpoint": str(checkpoints.directory / str(step))
              if checkpoints is not None and step in checkpoints.steps() else None}
    if 0 < num_steps <= start_step:  # resumed from the final checkpoint: evaluate, write nothing
      runtime.stats.collect()
      if primary:
        record = evaluate(num_steps, write=False)
    if checkpoints is not None:
      checkpoints.wait()
  finally:
    runtime.close()
    dataset.close()
    if writer is not None:
      writer.close()
    if checkpoints is not None:
      checkpoints.close()

  if not primary:
    return {"primary": False, "algorithm": config.algorithm, "num_steps": num_steps,
            "wall_time_s": train_time, "compile_s": compile_s}
  summary = {
      "algorithm": config.algorithm,
      "num_devices": num_devices,
      "num_steps": num_steps,
      "final_eval_accuracy": record["accuracy"],
      "final_eval_loss": record["loss"],
      "final_device0_accuracy": record["device0_accuracy"],
      **({"final_eval_perplexity": record["perplexity"]} if "perplexity" in record else {}),
      "consensus_distance": record["consensus_distance"],
      "weight_sum_min": record["weight_sum_min"],
      "weight_sum_max": record["weight_sum_max"],
      "wall_time_s": train_time,
      "compile_s": compile_s,
      "train_samples_per_s": samples_per_s(),
      "skipped_steps": runtime.stats.skipped_steps(),
      "stage_update_latency_ms": measurements.stage_latency_ms(latencies),
      "remote_send_latency_ms": measurements.send_latency_ms(remote_latencies),
      "flops_per_iteration": flops_per_iteration,
      "peak_flops": peak,
      **throughput(),
      **measurements.run_measurements(
          writer.records, language_model=dataset.kind == "language_model",
          target=(config.metrics.target_perplexity if dataset.kind == "language_model"
                  else config.metrics.target_accuracy),
          steps_per_epoch=dataset.steps_per_epoch),
      "resumed_from_step": start_step,
      "straggler_device": config.straggler.device,
      "straggler_delay_iters": config.straggler.delay_iters,
      "code_version": code_version,
  }
  writer.write_summary(summary)
  return summary
