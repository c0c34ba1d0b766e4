"""Per-device iteration time of LayUp's staged step against one fused jitted step.

Staged: the per-stage jitted forwards (each returning its VJP), the per-stage VJPs in reverse,
and one Optax update per stage, dispatched from Python as LayUp's threads do (serial mode, one
device, no peer). Fused: one jitted `value_and_grad` + Optax step of the same model, batch and
optimizer. Both wait for the loss every iteration. Repeats alternate between the two, so each
ratio is measured side by side; medians are reported. FLOPs per iteration come from XLA's
`compiled.cost_analysis()` (summed over the stage functions for the staged step); MFU is given
where the device's peak is known.

  python scripts/bench_step.py --cases digits resnet18-cifar gpt2-tiny --out bench_step.json
  python scripts/bench_step.py --cases gpt2-124m-bf16     # on a GPU
"""

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from configs import base
from layup_jax import data, models, optim, stages
from layup_jax.algorithms import ddp
from layup_jax.algorithms.base import init_model
from layup_jax.data.pipeline import Batch
from layup_jax.flops import PEAK_FLOPS, compiled, flops_of, staged_flops
from layup_jax.runtime import LayUpRuntime, local_update

CASES = {
    "digits": {"data.batch_size": 16},
    "resnet18-cifar": {"model.name": "resnet18", "model.num_classes": 100, "data.batch_size": 32,
                       "input_size": 32},
    "gpt2-tiny": {"model.name": "gpt2", "model.size": "tiny", "model.vocab_size": 256,
                  "model.max_len": 128, "data.batch_size": 8, "seq_len": 128,
                  "optimizer.name": "adamw"},
    "gpt2-124m-bf16": {"model.name": "gpt2", "model.size": "gpt2", "model.dtype": "bfloat16",
                       "model.max_len": 1024, "data.batch_size": 8, "seq_len": 1024,
                       "optimizer.name": "adamw"},
}


def case_config(case: str):
  config = base.get_config()
  extras = {}
  for key, value in CASES[case].items():
    if "." not in key:
      extras[key] = value
      continue
    section, name = key.split(".")
    config[section][name] = value
  return config, extras


def synthetic_batches(config, extras, seed: int):
  """Endless random batches of the model's input shape (the digits case reads the digits)."""
  rng = np.random.default_rng(seed)
  batch, model = config.data.batch_size, config.model
  while True:
    if model.name == "gpt2":
      tokens = rng.integers(0, model.vocab_size, (batch, extras["seq_len"] + 1), dtype=np.int32)
      yield Batch(tokens[:, :-1], tokens[:, 1:])
    else:
      size = extras["input_size"]
      yield Batch(rng.normal(size=(batch, size, size, 3)).astype(np.float32),
                  rng.integers(0, model.num_classes, batch).astype(np.int32))


def transformer_flops(config, params, batch: int, seq_len: int) -> float | None:
  """nanoGPT's estimate for GPT-2: (6 N + 12 L D T) FLOPs per token, N without `wpe`.

  A cross-check on XLA's count, which leaves out work done in library calls (cuDNN, cuBLAS).
  """
  if config.model.name != "gpt2":
    return None
  leaves = jax.tree.leaves(params)
  n = sum(leaf.size for leaf in leaves) - params[0]["wpe"]["embedding"].size
  spec = models.gpt2.SIZES[config.model.size]
  return batch * seq_len * (6 * n + 12 * spec.num_layers * spec.embed_dim * seq_len)


def time_iterations(step, iters: int) -> float:
  start = time.perf_counter()
  for _ in range(iters):
    step()
  return (time.perf_counter() - start) / iters


def bench_case(case: str, repeats: int, iters: int) -> dict:
  config, extras = case_config(case)
  device = jax.devices()[0]
  if case == "digits":
    train = data.make_dataset(config.data, 1, config.seed).train[0]
  else:
    train = synthetic_batches(config, extras, config.seed)
  example = next(train)
  model = models.make_model(config.model)
  tx = optim.make_optimizer(config.optimizer, 10_000)
  params, state = init_model(config, model, example)

  layup = LayUpRuntime(model, tx, [device], [train], params, state, example, seed=config.seed)
  layup.compile()
  replica = layup.replicas[0]
  key = jax.device_put(jax.random.key(0), device)
  iteration = jax.device_put(np.int32(0), device)
  inputs = Batch(*jax.device_put((example.inputs, example.targets), device))
  flops_staged = staged_flops(model, stages.make_stage_steps(model),
                              jax.jit(functools.partial(local_update, tx)), replica.params,
                              replica.state, replica.opt_state, inputs, key, iteration,
                              analyse=compiled)

  fused_step = jax.jit(functools.partial(ddp.train_step, model, tx), donate_argnums=(0, 1, 2))
  fused = {"carry": jax.device_put((params, state, tx.init(params)), device), "i": 0}
  flops_fused = flops_of(fused_step.lower(*fused["carry"], inputs.inputs, inputs.targets, key,
                                          iteration).compile())

  def fused_iteration():
    batch = next(train)
    batch = Batch(*jax.device_put((batch.inputs, batch.targets), device))
    step_idx = jax.device_put(np.int32(fused["i"]), device)
    *carry, loss, _ = fused_step(*fused["carry"], batch.inputs, batch.targets, key, step_idx)
    fused["carry"], fused["i"] = tuple(carry), fused["i"] + 1
    float(loss)

  def staged_iteration():
    layup.iterate_serial(0, None)

  for step in (staged_iteration, fused_iteration):  # compile and warm up
    time_iterations(step, 3)
  staged_times, fused_times = [], []
  for _ in range(repeats):
    staged_times.append(time_iterations(staged_iteration, iters))
    fused_times.append(time_iterations(fused_iteration, iters))
  staged_s, fused_s = statistics.median(staged_times), statistics.median(fused_times)
  peak = PEAK_FLOPS.get(device.device_kind)
  estimate = transformer_flops(config, params, config.data.batch_size, extras.get("seq_len", 0))
  return {
      "case": case, "model": config.model.name, "num_stages": model.num_stages,
      "batch_size": config.data.batch_size, "device": device.device_kind,
      "staged_ms_median": 1e3 * staged_s, "fused_ms_median": 1e3 * fused_s,
      "throughput_ratio_staged_over_fused_median": statistics.median(
          [f / s for s, f in zip(staged_times, fused_times)]),
      "flops_staged": flops_staged, "flops_fused": flops_fused,
      "mfu_staged": flops_staged / staged_s / peak if peak else None,
      "mfu_fused": flops_fused / fused_s / peak if peak else None,
      "flops_estimate_6nt": estimate,
      "mfu_estimate_staged": estimate / staged_s / peak if peak and estimate else None,
      "mfu_estimate_fused": estimate / fused_s / peak if peak and estimate else None,
      "staged_ms_all": [1e3 * t for t in staged_times],
      "fused_ms_all": [1e3 * t for t in fused_times],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=["digits", "resnet18-cifar", "gpt2-tiny"],
                      choices=sorted(CASES))
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--out", default="bench_step.json")
  args = parser.parse_args()

  rows = [bench_case(case, args.repeats, args.iters) for case in args.cases]
  mfu = lambda v: f"{100 * v:.1f}%" if v is not None else "-"
  print(f"{'case':<16}{'stages':>7}{'batch':>6}{'staged ms':>11}{'fused ms':>10}"
        f"{'staged/fused':>14}{'GFLOP/it':>10}{'MFU st.':>9}{'MFU fu.':>9}")
  for r in rows:
    print(f"{r['case']:<16}{r['num_stages']:>7}{r['batch_size']:>6}{r['staged_ms_median']:>11.3f}"
          f"{r['fused_ms_median']:>10.3f}{r['throughput_ratio_staged_over_fused_median']:>14.3f}"
          f"{r['flops_fused'] / 1e9:>10.2f}{mfu(r['mfu_staged']):>9}{mfu(r['mfu_fused']):>9}")
  for r in rows:
    if r["flops_estimate_6nt"]:
      print(f"{r['case']}: 6NT estimate {r['flops_estimate_6nt'] / 1e9:.0f} GFLOP/it, MFU staged "
            f"{mfu(r['mfu_estimate_staged'])}, fused {mfu(r['mfu_estimate_fused'])}")
  print(f"(throughput ratio: median of {args.repeats} side-by-side repeats of {args.iters} "
        f"iterations; {rows[0]['device']}; jax {jax.__version__}; XLA's FLOPs leave out "
        f"library calls such as cuDNN convolutions)")
  with open(args.out, "w") as f:
    json.dump({"platform": platform.platform(), "jax": jax.__version__, "rows": rows}, f,
              indent=2)


if __name__ == "__main__":
  main()
