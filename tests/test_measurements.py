"""The paper's measurements: time to target and to convergence, throughput per device, MFU,
per-stage update latency."""

import functools
import math

import jax
import numpy as np
import optax
import pytest

from layup_jax import models
from layup_jax.algorithms import ddp
from layup_jax.data.pipeline import Batch
from layup_jax.measure import flops
from layup_jax.measure import run_figures as measurements
from layup_jax.run import runner
from layup_jax.run.records import read_metrics
from layup_jax.runtime import costs, programs
from layup_jax.runtime.programs import local_update
from tests.helpers import backend_compilations, make_layup_runtime, plain_mlp

RECORDS = [
    {"split": "test", "step": 0, "time_s": 0.0, "accuracy": 0.1, "perplexity": 90.0},
    {"split": "train", "step": 10, "time_s": 1.0, "accuracy": 0.99},  # not a test record
    {"split": "test", "step": 10, "time_s": 1.0, "accuracy": 0.6, "perplexity": 20.0},
    {"split": "test", "step": 20, "time_s": 2.5, "accuracy": 0.8, "perplexity": 9.0},
    {"split": "test", "step": 30, "time_s": 4.0, "accuracy": 0.75, "perplexity": 9.5},
]


def test_time_to_target_and_to_convergence_take_the_first_evaluation_that_reaches_them():
  tests = [r for r in RECORDS if r["split"] == "test"]
  assert measurements.time_to_target(tests, 0.6) == {"time_s": 1.0, "step": 10}
  assert measurements.time_to_target(tests, 0.81) is None
  assert measurements.time_to_target(tests, 10.0, "perplexity", higher_is_better=False) == {
      "time_s": 2.5, "step": 20}
  summary = measurements.run_measurements(RECORDS, language_model=False, target=0.7,
                                          steps_per_epoch=5)
  assert summary["best_eval_accuracy"] == 0.8 and summary["time_to_convergence_s"] == 2.5
  assert summary["convergence_epoch"] == 4.0
  assert summary["time_to_target_s"] == 2.5 and summary["target_step"] == 20
  lm = measurements.run_measurements(RECORDS, language_model=True, target=5.0, steps_per_epoch=5)
  assert lm["best_eval_perplexity"] == 9.0 and lm["time_to_target_s"] is None


def test_a_loss_target_is_met_from_above_and_reports_the_samples_and_tokens_trained_to_it():
  records = [{**r, "loss": math.log(r["perplexity"])} for r in RECORDS if "perplexity" in r]
  lm = measurements.run_measurements(records, language_model=True, target=math.log(10.0),
                                     target_key="loss", steps_per_epoch=5,
                                     samples_per_step=8 * 16, tokens_per_sample=128)
  assert lm["target_loss"] == math.log(10.0) and lm["best_eval_perplexity"] == 9.0
  assert (lm["time_to_target_s"], lm["target_step"]) == (2.5, 20)
  assert lm["samples_to_target"] == 20 * 128 and lm["tokens_to_target"] == 20 * 128 * 128
  missed = measurements.run_measurements(records, language_model=True, target=2.0,
                                         target_key="loss", steps_per_epoch=5,
                                         samples_per_step=128, tokens_per_sample=128)
  assert missed["time_to_target_s"] is None and missed["tokens_to_target"] is None


def test_staged_flops_equal_the_fused_step_flops():
  # The staged backward reuses each stage's VJP residuals: nothing is recomputed.
  model, tx = plain_mlp((32, 32)), optax.sgd(0.1, momentum=0.9)
  inputs = np.random.default_rng(0).normal(size=(16, 8, 8)).astype(np.float32)
  batch = Batch(inputs, np.arange(16, dtype=np.int32) % 10)
  params, state = model.init(jax.random.key(0), batch.inputs)
  opt_state = [tx.init(p) for p in params]
  key, iteration = jax.random.key(1), np.int32(0)
  staged = costs.staged_flops(model, programs.make_stage_steps(model),
                              jax.jit(functools.partial(local_update, tx)), params, state,
                              opt_state, batch, key, iteration)
  fused = flops.flops_of(jax.jit(functools.partial(ddp.train_step, model, tx)).lower(
      params, state, tx.init(params), batch.inputs, batch.targets, key, iteration))
  # Matmul FLOPs: forward, weight gradients, and input gradients except stage 0's (dropped).
  analytic = 2 * 16 * (3 * (32 * 32 + 32 * 10) + 2 * 64 * 32)
  assert staged == pytest.approx(fused, rel=0.05)
  assert analytic <= staged <= 1.3 * analytic


def test_layup_and_ddp_count_the_same_flops_for_one_device_iteration(tiny_config):
  """MFU compares algorithms only if each counts one device's iteration of the same model:
  DDP's count does not depend on how many devices share its step."""
  model = models.make_model(tiny_config.model)
  layup = make_layup_runtime(8, model=model, batch_size=8)
  train_batch = layup.example_batch
  params, state = jax.device_get(model.init(jax.random.key(0), train_batch.inputs))

  def ddp_count(num_devices):
    runtime = ddp.DDPRuntime(model, optax.sgd(0.05, momentum=0.9), jax.devices()[:num_devices],
                             [], params, state, train_batch, seed=0)
    return runtime.flops_per_iteration()

  on_eight, on_one = ddp_count(8), ddp_count(1)
  assert on_eight == on_one
  assert layup.flops_per_iteration() == pytest.approx(on_eight, rel=0.05)


def test_counting_an_iterations_flops_compiles_nothing():
  """The count traces the staged pass for its functions' arguments (shapes only): a first run
  does not compile every stage function a second time to count its FLOPs."""
  runtime = make_layup_runtime(4)
  try:
    with backend_compilations() as compiles:
      assert runtime.flops_per_iteration() > 0
      assert compiles == []
      # The listener does see compilations: a function never seen before compiles once.
      jax.jit(lambda x: x * 3.0 - 1.0)(jax.device_put(np.ones(5, np.float32), jax.devices()[0]))
      assert compiles
  finally:
    runtime.close()


def test_a_run_reports_throughput_per_device_mfu_and_time_to_target(tiny_config, tmp_path,
                                                                   monkeypatch):
  monkeypatch.setitem(flops.PEAK_FLOPS, jax.devices()[0].device_kind, 1e11)  # a made-up peak
  tiny_config.num_devices, tiny_config.eval_every = 4, 5
  tiny_config.metrics.target_accuracy = 0.2  # a tiny run's evaluations cross it within 20 steps
  tiny_config.metrics.latency_every = 2  # every other iteration: samples in every train row
  summary = runner.run(tiny_config, tmp_path)
  tests = [r for r in read_metrics(tmp_path) if r["split"] == "test"]
  first = next(r for r in tests if r["accuracy"] >= 0.2)
  assert summary["time_to_target_s"] == first["time_s"] and summary["target_step"] == first["step"]
  best = max(r["accuracy"] for r in tests)
  assert summary["best_eval_accuracy"] == best
  assert summary["time_to_convergence_s"] == next(r for r in tests
                                                  if r["accuracy"] == best)["time_s"]
  per_device = summary["device_samples_per_s"]
  assert len(per_device) == 4 and all(v > 0 for v in per_device)
  np.testing.assert_allclose(sum(per_device), summary["train_samples_per_s"], rtol=1e-6)
  assert summary["flops_per_iteration"] > 0
  np.testing.assert_allclose(summary["mfu"], summary["tflops_per_s_per_device"] * 1e12 / 1e11,
                             rtol=1e-9)
  # Update latency per stage, in the summary and in every train row.
  latency = summary["stage_update_latency_ms"]
  num_stages = models.make_model(tiny_config.model).num_stages
  assert len(latency) == num_stages and all(v > 0 for v in latency)
  trains = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
  assert all(len(r["stage_update_latency_ms"]) == num_stages for r in trains)


@pytest.mark.parametrize("gossip", [True, False])
def test_each_stage_update_is_timed_on_every_sampled_iteration(gossip):
  # Every 2nd iteration of each device is timed, once per stage, with or without a peer.
  runtime = make_layup_runtime(num_devices=2, latency_every=2, gossip=gossip)
  try:
    runtime.compile()
    runtime.run_until(12, lambda done: None)
    per_stage = runtime.stats.stage_latencies()
    sampled = sum((n + 1) // 2 for n in runtime.stats.iterations_per_device())
    assert [len(samples) for samples in per_stage] == [sampled] * runtime.num_stages
    assert all(0 < seconds < 10 for samples in per_stage for seconds in samples)
    assert runtime.stats.stage_latencies() == [[]] * runtime.num_stages  # drained by the first call
  finally:
    runtime.close()
  assert measurements.stage_latency_ms([[0.001, 0.003, 0.002], []]) == pytest.approx([2.0, None])
  assert measurements.stage_latency_ms([[], []]) is None
