"""`scripts/bench_step.py --trace`: a device's busy time read back from a profiler trace."""

import gzip
import importlib.util
import json
import pathlib

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def _bench_step():
  spec = importlib.util.spec_from_file_location("script_bench_step", SCRIPTS / "bench_step.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_devices_busy_time_counts_overlapping_events_once():
  bench_step = _bench_step()
  # Two streams overlapping on [5, 10), a gap, then one event inside another.
  assert bench_step.covered_us([(0, 10), (5, 10), (20, 5), (21, 1)]) == 20
  assert bench_step.covered_us([]) == 0


def test_a_trace_is_summarised_per_process_and_per_iteration(tmp_path):
  bench_step = _bench_step()
  events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  for i in range(2):  # two iterations, each a 3 ms kernel and an overlapping 2 ms one (us in traces)
    events += [{"ph": "X", "pid": 1, "tid": 7, "ts": 100 * i, "dur": 3000.0, "name": "conv"},
               {"ph": "X", "pid": 1, "tid": 8, "ts": 100 * i + 1000, "dur": 2000.0,
                "name": "fusion"}]
  events.append({"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 500.0, "name": "Execute"})
  folder = tmp_path / "plugins" / "profile" / "run"
  folder.mkdir(parents=True)
  with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  summary = bench_step.trace_summary(tmp_path, iters=2)
  gpu = summary["/device:GPU:0"]
  # Spans [0, 3000) and [1000, 3000), then [100, 3100) and [1100, 3100): 3,100 us in all.
  assert abs(gpu["busy_ms_per_iteration"] - 1.55) < 1e-9
  assert gpu["events_per_iteration"] == 2
  assert gpu["top"][0] == ["conv", 3.0, 1.0] and gpu["top"][1] == ["fusion", 2.0, 1.0]
  assert summary["/host:CPU"]["busy_ms_per_iteration"] == 0.25
