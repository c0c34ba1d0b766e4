"""The events of the newest perfetto trace `jax.profiler.trace` wrote under a folder, for the
scripts that read a profile back (`profile_step.py`, `bench_step.py --trace`)."""

import gzip
import json
import os
import pathlib


def newest(trace_dir: pathlib.Path) -> tuple[pathlib.Path, list[dict]]:
  """`(path, events)` of the newest `perfetto_trace.json.gz` under `trace_dir`."""
  path = max(trace_dir.glob("plugins/profile/*/perfetto_trace.json.gz"), key=os.path.getmtime)
  with gzip.open(path) as f:
    trace = json.load(f)
  return path, trace["traceEvents"] if isinstance(trace, dict) else trace
