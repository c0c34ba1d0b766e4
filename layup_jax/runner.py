"""Builds a run from its config, trains with evaluations at fixed steps, and writes the records.

The only orchestrator: it never looks at which algorithm runs; each one is a `Runtime`.
"""

import dataclasses
import math
import pathlib
import sys
import time
from typing import Any

import jax
import ml_collections
import tqdm

from layup_jax import algorithms, data, models, optim
from layup_jax.config_validation import resolve_num_steps, validate_config
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


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, Any]:
  """Trains `config` and returns the summary also written to `workdir/summary.json`."""
  validate_config(config, len(jax.devices()))
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  num_devices = config.num_devices
  devices = jax.devices()[:num_devices]
  dataset = data.make_dataset(config.data, num_devices, config.seed)
  model = models.make_model(config.model)
  num_steps = resolve_num_steps(config, dataset.steps_per_epoch)
  tx = optim.make_optimizer(config.optimizer, num_steps, dataset.steps_per_epoch)
  runtime = algorithms.build_runtime(config, model, tx, devices, dataset)
  evaluator = Evaluator(model, dataset.test, devices[0])
  writer = MetricsWriter(workdir)
  train_time = 0.0

  def evaluate(step: int) -> dict[str, Any]:
    train_loss = runtime.train_loss()
    common = {"step": step, "time_s": train_time, "weight_sum": runtime.weight_sum()}
    if step > 0:
      writer.write({**common, "split": "train", "loss": train_loss,
                    "samples_per_s": runtime.iterations_done() * config.data.batch_size
                    / max(train_time, 1e-9)})
    record = {**common, "split": "test", **evaluator.evaluate(runtime.snapshot())}
    if dataset.kind == "language_model":  # accuracy is next-token accuracy
      record["perplexity"] = math.exp(min(record["loss"], 50.0))
    writer.write(record)
    return record

  try:
    runtime.compile()
    record = evaluate(0)
    bar = tqdm.tqdm(total=num_steps, desc=f"{config.algorithm} x{num_devices}", unit="step",
                    disable=not config.progress_bar, file=sys.stderr, dynamic_ncols=True)
    with bar:
      for step in eval_steps(num_steps, config.eval_every):
        start = time.perf_counter()
        runtime.run_until(step * num_devices, _Progress(bar, num_devices))
        train_time += time.perf_counter() - start
        record = evaluate(step)
        bar.set_postfix(acc=f"{record['accuracy']:.3f}", loss=f"{record['loss']:.3f}")
  finally:
    runtime.close()
    dataset.close()
    writer.close()

  summary = {
      "algorithm": config.algorithm,
      "num_devices": num_devices,
      "num_steps": num_steps,
      "final_eval_accuracy": record["accuracy"],
      "final_eval_loss": record["loss"],
      "final_device0_accuracy": record["device0_accuracy"],
      **({"final_eval_perplexity": record["perplexity"]} if "perplexity" in record else {}),
      "consensus_distance": record["consensus_distance"],
      "weight_sum": record["weight_sum"],
      "wall_time_s": train_time,
      "train_samples_per_s": runtime.iterations_done() * config.data.batch_size / train_time,
      "straggler_device": config.straggler.device,
      "straggler_delay_iters": config.straggler.delay_iters,
  }
  writer.write_summary(summary)
  return summary
