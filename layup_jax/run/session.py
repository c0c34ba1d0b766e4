"""One run's session: what `runner.run` builds (data, model, runtime, evaluator, checkpoints,
records), the training loop with its hooks, and the hooks' actions (evaluate, save).

`Session.train` is the loop: it asks the runtime to train until the next step a hook is due at
(`Runtime.run_until`), then runs the hooks there; the runtime returns at a consistent point.
Process 0 evaluates and writes the records.

Why one module of this size: a run's life in order (build, resume, compile, train with its
hooks, evaluate, save, stop or finish, summarise) over one set of objects; the pieces that stand
alone are elsewhere (resume, validation, evaluation, records).
"""

import contextlib
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

from layup_jax import algorithms, data, models, optim
from layup_jax.checkpoint import checks, layout
from layup_jax.checkpoint.manager import Checkpoints
from layup_jax.errors import StorageError
from layup_jax.measure import flops
from layup_jax.measure import run_figures as measurements
from layup_jax.multiprocess import gathers, membership, setup
from layup_jax.platform import allocator
from layup_jax.run import resume
from layup_jax.run.evaluation import Evaluator
from layup_jax.run.records import MetricsWriter, ProgressLog
from layup_jax.run.validation import resolve_num_steps


def eval_steps(num_steps: int, eval_every: int) -> list[int]:
  """Steps after which to evaluate: every `eval_every` steps and at the end."""
  steps = list(range(eval_every, num_steps, eval_every)) if eval_every else []
  return steps + [num_steps]



@dataclasses.dataclass(frozen=True)
class Every:
  """A hook the training loop runs after every `steps` steps and after the last (0: after the
  last only), with the step reached."""

  steps: int
  action: Callable[[int], None]

  def due(self, num_steps: int) -> list[int]:
    return eval_steps(num_steps, self.steps)


@dataclasses.dataclass
class _Progress:
  """A tqdm bar in global steps (the run's device iterations / M), and with `log` this
  process's own iterations over time (`metrics.progress_every_s`)."""

  bar: tqdm.tqdm
  num_devices: int
  own_iterations: Callable[[], int]
  log: "ProgressLog | None" = None

  def __call__(self, iterations: int) -> None:
    step = iterations // self.num_devices
    membership.members.step = step  # the step a lost process is declared at
    self.bar.update(step - self.bar.n)
    if self.log is not None:
      self.log.write(self.own_iterations(), step)


@contextlib.contextmanager
def _training():
  """This process trains (between consistent points): the watchdogs judge it by its progress
  meanwhile (`distributed.progress_timeout_s`); outside, it waits on the others."""
  membership.members.training = True
  try:
    yield
  finally:
    membership.members.training = False


def _stop_checks(should_stop: Callable[[], bool]) -> tuple[Callable[[], bool], Callable[[], bool]]:
  """(checked between targets, checked within one by the runtime). Across processes they stop
  together, at the next evaluation or checkpoint: one that stopped alone would leave the others
  waiting in a collective (a stop request reaches each process at its own moment; they agree
  on it here)."""
  if jax.process_count() == 1:
    return should_stop, should_stop
  return (lambda: any(gathers.all_gather_json(bool(should_stop())))), (lambda: False)


class Session:
  """One run: what `run` builds (data, model, runtime, evaluator, checkpoints, records), the
  training time so far, and the hooks' actions. Process 0 evaluates and writes the records."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path):
    self.config, self.workdir = config, pathlib.Path(workdir)
    try:
      self.workdir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
      raise StorageError(f"cannot create the workdir {self.workdir} "
                         f"({error.strerror or error})") from error
    self.devices = jax.devices()[:config.num_devices]
    self.dataset = data.make_dataset(config.data, config.num_devices, config.seed)
    self.model = models.make_model(config.model)
    self.num_steps = resolve_num_steps(config, self.dataset.steps_per_epoch)
    tx = optim.make_optimizer(config.optimizer, self.num_steps, self.dataset.steps_per_epoch)
    try:
      self.runtime = algorithms.build_runtime(config, self.model, tx, self.devices, self.dataset)
    except BaseException:
      self.dataset.close()
      raise
    self.evaluator: Evaluator | None = None  # built by the leader when it first evaluates
    # The iterations of one step that this process's runtime counts: its own devices' (a
    # gossip runtime across processes), else every device's.
    self.per_step = self.runtime.num_devices
    self.checkpoints: Checkpoints | None = None
    self.writer: MetricsWriter | None = None
    self.start_step, self.train_time, self.compile_s = 0, 0.0, 0.0
    self.flops_per_iteration, self.peak = None, flops.peak_flops(self.devices[0])
    self.record: dict[str, Any] | None = None  # the latest test record (the leader)
    self.latencies: list[list[float]] | None = None  # every sample of this process, per stage
    self.remote_latencies: list[float] = []  # every send between processes (the leader)
    self._saved_step: int | None = None
    self._said_no_checkpoints = False  # "checkpoint not written" is said once
    self.checkpoints_given_up: list[int] = []  # saves under way when a process was lost
    self.stopped_at_target = False  # `metrics.stop_at_target` ended the run early
    self.rejoined_at: int | None = None  # the step at which this process rejoined its run
    self._bar: tqdm.tqdm | None = None

  @property
  def devices_here(self) -> list:
    """The run's devices that this process drives."""
    return [d for d in self.devices if d.process_index == jax.process_index()]

  @property
  def primary(self) -> bool:
    """Whether this process leads the run: evaluates, writes the records and the summary
    (process 0, or after its loss the lowest live process, `multiprocess.membership`)."""
    return setup.is_primary()

  # --- build, restore, compile ----------------------------------------------------------------

  def restore(self) -> None:
    """Opens the checkpoints (after a storage check) and resumes from the newest readable one,
    else from `config.restore`; opens the records, kept up to the step resumed from."""
    config = self.config
    # A process that rejoins a running run takes its state from live peers (`_rejoin`) and
    # saves no checkpoints (`save`).
    if config.checkpoint.enabled and not membership.members.rejoining:
      checks.check_storage(
          self.workdir, layout.tree_bytes(self.runtime.checkpoint.state_dict()[0]),
          config.checkpoint.keep)
      self.checkpoints = Checkpoints(self.workdir / "checkpoints", config.checkpoint.keep,
                                     config.checkpoint.async_save)
      restored = resume.restore(config, self.runtime, self.dataset, self.checkpoints)
      if restored is not None:
        self.start_step, self.train_time = restored
    self.writer = MetricsWriter(self.workdir,
                                keep_through_step=self.start_step if self.start_step else None,
                                tensorboard=config.metrics.get("tensorboard", False),
                                files=self.primary)

  def compile(self) -> None:
    """Compiles the runtime's programs before the timed loop; a run resumed at its end (every
    step already trained: it is only evaluated) compiles none: the digits command rerun at
    its end took 8.5 s instead of 15.0 s (2026-11-27, 2 cores, compilation cache warm)."""
    if self.start_step >= self.num_steps and not membership.members.rejoining:
      return
    started = time.perf_counter()
    self.runtime.compile()
    self.compile_s = time.perf_counter() - started
    if not self.primary:  # only process 0 reports throughput (a process that rejoins is sooner)
      return
    try:
      self.flops_per_iteration = self.runtime.flops_per_iteration()
    except Exception as error:  # noqa: BLE001 - a missing count must not stop training
      logging.warning("no FLOP count for this run (%s: %s); MFU is not reported",
                      type(error).__name__, error)

  # --- the loop -------------------------------------------------------------------------------

  def train(self, hooks: list[Every], should_stop: Callable[[], bool]) -> int:
    """Trains to the end, running each hook at its steps; returns the step reached (short of
    the end if a stop was requested). A fresh run is evaluated at step 0 first."""
    stop_now, stop_within = _stop_checks(should_stop)
    due: dict[int, list[Every]] = {}
    for hook in hooks:
      for step in hook.due(self.num_steps):
        due.setdefault(step, []).append(hook)
    if membership.members.rejoining:
      step = self._rejoin()
      for hook in due.get(step, []):  # where the others are: right after this step's training
        hook.action(step)
      if self._ends_at_target(due.get(step, [])):
        self.stopped_at_target = True
        return step
    elif self.start_step == 0:
      self.evaluate(0)
    step = self.start_step
    self._bar = tqdm.tqdm(total=self.num_steps, initial=self.start_step,
                          desc=f"{self.config.algorithm} x{self.config.num_devices}", unit="step",
                          disable=not (self.config.progress_bar and self.primary),
                          file=sys.stderr, dynamic_ncols=True)
    every_s = self.config.metrics.get("progress_every_s", 0.0)
    log = ProgressLog(self.workdir, every_s) if every_s else None
    progress = _Progress(self._bar, self.per_step, self.runtime.own_iterations, log)
    membership.members.own_iterations = self.runtime.own_iterations  # its heartbeat carries it
    with self._bar, contextlib.closing(log) if log else contextlib.nullcontext():
      for target in sorted(s for s in due if s > self.start_step):
        if stop_now():
          break
        started = time.perf_counter()
        with _training():
          self.runtime.run_until(target * self.per_step, progress, stop_within)
        self.train_time += time.perf_counter() - started
        step = self.runtime.iterations_done() // self.per_step
        if step < target:
          break
        for hook in due[target]:
          hook.action(step)
        if self._ends_at_target(due[target]):
          self.stopped_at_target = True
          break
    return step

  def _rejoin(self) -> int:
    """This process was started again into its running run: it waits to be admitted back at a
    consistent point (`Elastic.rejoin`, layup_jax/multiprocess/elastic.py), and its devices' data resume
    their shards at the run's step there, which this returns (as the start step)."""
    self.start_step = self.rejoined_at = self.runtime.elastic.rejoin()
    for iterator in self.dataset.train:
      iterator.set_state({**iterator.get_state(), "next_index": self.start_step})
    print(f"process {jax.process_index()} rejoined the run at step {self.start_step}",
          file=sys.stderr, flush=True)
    return self.start_step

  def _ends_at_target(self, hooks: list[Every]) -> bool:
    """Whether `metrics.stop_at_target` ends the run here: this step was evaluated and reached
    the target. Only the leader evaluates; every process takes its answer."""
    metrics = self.config.metrics
    if not metrics.get("stop_at_target", False) or not any(
        hook.action == self.evaluate for hook in hooks):
      return False
    reached = False
    if self.primary:
      key, target, higher = self._target()
      reached = measurements.time_to_target([self.record], target, key, higher) is not None
    if jax.process_count() > 1:
      reached = any(gathers.all_gather_json(reached))  # the leader's answer
    return reached

  def _target(self) -> tuple[str, float, bool]:
    """(metric, `metrics.target_*` value, whether higher is better) of this run: the test loss
    where `metrics.target_loss` is set, else the task's own (perplexity or accuracy)."""
    metrics = self.config.metrics
    if metrics.get("target_loss", 0.0):
      return "loss", metrics.target_loss, False
    if self.dataset.kind == "language_model":
      return "perplexity", metrics.target_perplexity, False
    return "accuracy", metrics.target_accuracy, True

  # --- the hooks' actions ---------------------------------------------------------------------

  def samples_per_s(self) -> float:
    iterations = sum(self.runtime.stats.iterations_per_device())
    return iterations * self.config.data.batch_size / max(self.train_time, 1e-9)

  def throughput(self) -> dict[str, Any]:
    return measurements.throughput(self.runtime.stats.iterations_per_device(),
                                   self.config.data.batch_size, self.train_time,
                                   self.flops_per_iteration, self.peak)

  def traffic(self) -> dict[str, Any]:
    """Across processes, the bytes all processes have sent to each other since this one
    started (layup_jax/multiprocess/traffic.py), in total and per device-iteration; nothing in one."""
    if jax.process_count() == 1:
      return {}
    stats = self.runtime.stats
    sent = stats.bytes_between_processes()
    iterations = sum(stats.iterations_per_device()) - self.start_step * self.config.num_devices
    return {"bytes_between_processes": sent,
            "bytes_between_processes_per_device_iteration": sent / max(iterations, 1)}

  def _stage_latencies(self) -> list[float | None] | None:
    recent = self.runtime.stats.stage_latencies()
    if recent is not None:
      self.latencies = [old + new for old, new in
                        zip(self.latencies or [[] for _ in recent], recent)]
    return measurements.stage_latency_ms(recent)

  def _take_the_lead(self, step: int) -> None:
    """This process leads from now on (the leader before it was lost): it writes the records
    from here, keeping those written before `step`, and evaluates on its own first device."""
    self.writer.close()
    self.writer = MetricsWriter(self.workdir, keep_through_step=step - 1,
                                tensorboard=self.config.metrics.get("tensorboard", False))
    print(f"process {jax.process_index()} leads the run from step {step}: it evaluates and "
          f"writes the records", file=sys.stderr, flush=True)

  def evaluate(self, step: int, write: bool = True) -> None:
    """Every process collects the run's statistics (a collective); the leader evaluates the
    consensus model and writes the train row since the last one and the test row.

    Every process then waits for the leader's evaluation (a gather), so that no device trains
    while it lasts: otherwise an asynchronous run's other processes would train on meanwhile,
    outside the training time the leader records, and on cores the evaluation shares."""
    self.runtime.stats.collect()
    if self.primary:
      self._evaluate_here(step, write)
    if jax.process_count() > 1:
      gathers.all_gather_json(None)

  def _evaluate_here(self, step: int, write: bool) -> None:
    if not self.writer.files:
      self._take_the_lead(step)
    if self.evaluator is None:
      statistics = self.dataset.statistics_inputs(
          self.config.precise_bn_batches, self.config.data.eval_batch_size, self.config.seed)
      self.evaluator = Evaluator(self.model, self.dataset.test, self.devices_here[0], statistics)
    stats = self.runtime.stats
    train_loss, sums = stats.train_loss(), stats.weight_sums()
    common = {"step": step, "time_s": self.train_time, "weight_sum_min": min(sums),
              "weight_sum_max": max(sums), "devices_in_average": stats.devices_in_average()}
    if step > 0 and write:
      self.writer.write({**common, "split": "train", "loss": train_loss,
                         "samples_per_s": self.samples_per_s(), **self.throughput(),
                         "stage_update_latency_ms": self._stage_latencies(),
                         "skipped_steps": stats.skipped_steps(),
                         "sends_dropped": stats.sends_dropped(), **self.traffic()})
    self.remote_latencies.extend(stats.remote_send_latencies())
    record = {**common, "split": "test", **self.evaluator.evaluate(stats.snapshot())}
    if self.dataset.kind == "language_model":  # accuracy is next-token accuracy
      record["perplexity"] = math.exp(min(record["loss"], 50.0))
    if write:
      self.writer.write(record)
    self.record = record
    if self._bar is not None:
      self._bar.set_postfix(acc=f"{record['accuracy']:.3f}", loss=f"{record['loss']:.3f}")

  def save(self, step: int) -> None:
    """A checkpoint at `step` (once); the time training waits for it counts as training time.
    After an elastic run lost a process, the live processes save their devices' replicas
    (`RuntimeCheckpoint`), Orbax's barriers waiting for them alone; a process that rejoined
    takes part in the checkpoint's gathers but saves nothing."""
    if step == self._saved_step:
      return
    self._saved_step = step
    started = time.perf_counter()
    arrays, runtime_meta = self.runtime.checkpoint.state_dict()
    if runtime_meta is None:  # every live process rejoined the run: none writes
      if self.primary and not self._said_no_checkpoints:
        print(f"checkpoint {step} not written: every live process rejoined the run, and a "
              f"process that rejoined writes no checkpoint; the run trains on, and its last "
              f"checkpoint stays the one before", file=sys.stderr, flush=True)
      self._said_no_checkpoints = True
      return
    elastic = getattr(self.runtime, "elastic", None)  # (DDP: not elastic)
    lost = elastic is not None and elastic.processes_lost
    members = runtime_meta["processes"] if lost else None
    data_states = gathers.data_states(self.dataset.train, self.devices, members)
    if self.checkpoints is None:  # this process rejoined: it took part, and writes nothing
      return
    if lost:
      patience_s = self.config.distributed.heartbeat_timeout_s
      given_up = self.checkpoints.limit_to(members, step, patience_s)
      self.checkpoints_given_up += given_up
      if given_up and self.primary:
        print(f"checkpoint {', '.join(map(str, given_up))} given up: it was under way when a "
              f"process was lost and still waited for it after {patience_s:g} s; the "
              f"checkpoints from step {step} on are the live processes'", file=sys.stderr,
              flush=True)
    self.checkpoints.save(step, arrays, {
        "step": step, "train_time_s": self.train_time, "runtime": runtime_meta,
        "data": data_states, "config": self.config.to_json_best_effort(),
        "saved_at": time.time()},
        arrays_stay_valid=self.runtime.checkpoint.arrays_stay_valid)
    self.train_time += time.perf_counter() - started

  # --- the end --------------------------------------------------------------------------------

  def stop(self, step: int) -> dict[str, Any]:
    """A stopped run: a checkpoint at the step reached (unless just saved), written out."""
    checkpoints = self.checkpoints
    if checkpoints is not None:
      if step > self.start_step:
        self.save(step)
      checkpoints.wait()
    return {"stopped": True, "primary": self.primary, "step": step,
            "num_steps": self.num_steps, "checkpoints_given_up": self.checkpoints_given_up,
            "checkpoint": str(checkpoints.directory / str(step))
            if checkpoints is not None and step in checkpoints.steps() else None}

  def finish(self, step: int) -> None:
    """A run resumed from its final checkpoint is evaluated (nothing written); one ended at its
    target saves the model there; the last checkpoint is waited for."""
    if 0 < self.num_steps <= self.start_step and self.rejoined_at is None:
      self.evaluate(self.num_steps, write=False)
    if self.checkpoints is not None:
      if self.stopped_at_target:
        self.save(step)
      self.checkpoints.wait()

  def close(self) -> None:
    self.runtime.close()
    self.dataset.close()
    if self.writer is not None:
      self.writer.close()
    if self.checkpoints is not None:
      self.checkpoints.close()

  def summary(self, code_version: str | None) -> dict[str, Any]:
    """The run's summary (process 0 writes it to summary.json)."""
    config, record, stats = self.config, self.record, self.runtime.stats
    if not self.primary:
      return {"primary": False, "algorithm": config.algorithm, "num_steps": self.num_steps,
              "wall_time_s": self.train_time, "compile_s": self.compile_s,
              "checkpoints_given_up": self.checkpoints_given_up}
    language_model = self.dataset.kind == "language_model"
    samples_per_step = config.num_devices * config.data.batch_size
    target_key, target, _ = self._target()
    summary = {
        "algorithm": config.algorithm,
        "num_devices": config.num_devices,
        "num_steps": self.num_steps,
        "final_eval_accuracy": record["accuracy"],
        "final_eval_loss": record["loss"],
        "final_device0_accuracy": record["device0_accuracy"],
        **({"final_eval_perplexity": record["perplexity"]} if "perplexity" in record else {}),
        **{f"final_eval_{name}": record[name] for name, _ in self.model.metrics},
        "consensus_distance": record["consensus_distance"],
        "weight_sum_min": record["weight_sum_min"],
        "weight_sum_max": record["weight_sum_max"],
        "wall_time_s": self.train_time,
        "compile_s": self.compile_s,
        "checkpoints_given_up": self.checkpoints_given_up,
        "train_samples_per_s": self.samples_per_s(),
        "samples_per_step": samples_per_step,
        **({"tokens_per_sample": config.data.seq_len} if language_model else {}),
        "device_iterations": stats.iterations_per_device(),
        "skipped_steps": stats.skipped_steps(),
        "host_threads_cpu_s": stats.host_cpu_s(),
        "host_allocator": allocator.in_use(),
        "stage_update_latency_ms": measurements.stage_latency_ms(self.latencies),
        "remote_send_latency_ms": measurements.send_latency_ms(self.remote_latencies),
        **self.traffic(),
        "flops_per_iteration": self.flops_per_iteration,
        "peak_flops": self.peak,
        **self.throughput(),
        **measurements.run_measurements(
            self.writer.records, language_model=language_model,
            target=target, target_key=target_key,
            steps_per_epoch=self.dataset.steps_per_epoch, samples_per_step=samples_per_step,
            tokens_per_sample=config.data.seq_len if language_model else 0),
        "resumed_from_step": self.start_step,
        "stopped_at_target": self.stopped_at_target,
        "straggler_device": config.straggler.device,
        "straggler_process": config.straggler.process,
        "straggler_delay_iters": config.straggler.delay_iters,
        "code_version": code_version,
    }
    self.writer.write_summary(summary)
    return summary
