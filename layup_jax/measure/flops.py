"""FLOPs per iteration from XLA's cost analysis, and model FLOPs utilization (MFU).

XLA counts the FLOPs of a lowered or compiled program (`cost_analysis()`); the staged step's
count is the sum over its stage functions and per-stage optimizer updates
(layup_jax/runtime/costs.py). XLA leaves out work
done in library calls (cuDNN convolutions, some cuBLAS GEMMs), so on GPUs the count, and the
MFU computed from it, can be low; `scripts/bench_step.py` prints a 6NT estimate beside it for
GPT-2. Peaks are dense bf16 vendor figures by `device_kind`; CPUs have none, so no MFU there.
"""

from typing import Any

import jax

PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA H100": 989e12,
              "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12,
              "NVIDIA A100 80GB PCIe": 312e12}


def peak_flops(device: jax.Device) -> float | None:
  """The device's peak FLOP/s, or None when the table does not know its kind."""
  return PEAK_FLOPS.get(device.device_kind)


def flops_of(lowered_or_compiled: Any) -> float:
  """XLA's FLOP count of a `jax.stages.Lowered` or `Compiled` program."""
  analysis = lowered_or_compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax returns one dict per computation
    analysis = analysis[0]
  return float((analysis or {}).get("flops", 0.0))


def lowered(fn, *args) -> Any:
  return fn.lower(*args)


def compiled(fn, *args) -> Any:
  return fn.lower(*args).compile()
