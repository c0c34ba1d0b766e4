"""The paper's run-level measurements, computed from a run's evaluation records (pure functions).

Time to target (TTA): the training time (`time_s`, evaluation excluded) of the first evaluation
that reaches the target (accuracy at least, or loss or perplexity at most, the target), and the
samples (a language model: tokens) trained by then. Time to
convergence (TTC): the training time of the first evaluation that reaches the best value the
run ever reaches (the paper's "convergence accuracy"). Both are resolved to the evaluation
interval (`eval_every`).
"""

import statistics
from collections.abc import Sequence
from typing import Any

Record = dict[str, Any]


def _reached(value: float | None, target: float, higher_is_better: bool) -> bool:
  if value is None:
    return False
  return value >= target if higher_is_better else value <= target


def time_to_target(records: Sequence[Record], target: float, key: str = "accuracy",
                   higher_is_better: bool = True) -> Record | None:
  """`{"time_s", "step"}` of the first test record whose `key` reaches `target`, or None."""
  for record in records:
    if _reached(record.get(key), target, higher_is_better):
      return {"time_s": record["time_s"], "step": record["step"]}
  return None


def convergence(records: Sequence[Record], key: str = "accuracy",
                higher_is_better: bool = True) -> Record | None:
  """`{"best", "time_s", "step"}`: the best `key` and the first test record reaching it."""
  values = [r[key] for r in records if r.get(key) is not None]
  if not values:
    return None
  best = max(values) if higher_is_better else min(values)
  first = time_to_target(records, best, key, higher_is_better)
  return {"best": best, **first}


def run_measurements(records: Sequence[Record], *, language_model: bool, target: float,
                     steps_per_epoch: int, target_key: str | None = None,
                     samples_per_step: int = 0, tokens_per_sample: int = 0) -> Record:
  """Summary fields: convergence value (perplexity for a language model, else accuracy), TTC
  and its epoch; with `target`, TTA on `target_key` (lower is better for "loss" and
  "perplexity"; default: the convergence key), its step, epoch and the samples (tokens, for a
  language model) trained to it."""
  key, higher = ("perplexity", False) if language_model else ("accuracy", True)
  tests = [r for r in records if r.get("split") == "test"]
  summary: Record = {}
  best = convergence(tests, key, higher)
  if best is not None:
    summary.update({f"best_eval_{key}": best["best"], "time_to_convergence_s": best["time_s"],
                    "convergence_step": best["step"],
                    "convergence_epoch": best["step"] / steps_per_epoch})
  losses = [r["loss"] for r in tests if r.get("loss") is not None]
  if language_model and losses:
    summary["best_eval_loss"] = min(losses)
  if target:
    target_key = target_key or key
    reached = time_to_target(tests, target, target_key, target_key == "accuracy")
    step = reached["step"] if reached else None
    summary.update({f"target_{target_key}": target,
                    "time_to_target_s": reached["time_s"] if reached else None,
                    "target_step": step,
                    "target_epoch": step / steps_per_epoch if reached else None})
    if samples_per_step:
      summary["samples_to_target"] = step * samples_per_step if reached else None
      if tokens_per_sample:
        summary["tokens_to_target"] = step * samples_per_step * tokens_per_sample \
            if reached else None
  return summary


def stage_latency_ms(per_stage: Sequence[Sequence[float]] | None) -> list[float | None] | None:
  """Median update latency of each stage in ms (None for a stage without samples); None when
  the runtime does not time stages or took no sample at all."""
  if per_stage is None or not any(per_stage):
    return None
  return [1e3 * statistics.median(samples) if samples else None for samples in per_stage]


def send_latency_ms(samples: Sequence[float]) -> Record | None:
  """Median, 90th percentile and count of send latencies (seconds) in ms; None without any."""
  if not samples:
    return None
  ordered = sorted(samples)
  return {"median": 1e3 * statistics.median(ordered),
          "p90": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
          "count": len(ordered)}


def throughput(iterations_per_device: Sequence[int], batch_size: int, train_time_s: float,
               flops_per_iteration: float | None, peak_flops: float | None) -> Record:
  """Samples/s per device, achieved TFLOP/s per device and MFU (None where unknown)."""
  time_s = max(train_time_s, 1e-9)
  per_device = [n * batch_size / time_s for n in iterations_per_device]
  tflops = None
  if flops_per_iteration:
    tflops = flops_per_iteration * sum(iterations_per_device) / len(iterations_per_device) \
        / time_s / 1e12
  mfu = tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None
  return {"device_samples_per_s": per_device, "tflops_per_s_per_device": tflops, "mfu": mfu}


def mean_or_nan(values: Sequence[float]) -> float:
  """The mean of recorded values (training losses), NaN when there are none."""
  return float(statistics.fmean(values)) if len(values) else float("nan")
