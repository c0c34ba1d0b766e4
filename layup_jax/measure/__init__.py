"""What runs and benchmarks measure, and how.

Owns: XLA's FLOP counts and the devices' peak rates (`flops`), a run's figures for its summary
(time to a target, convergence, throughput, latencies: `run_figures`), timing alternatives side
by side for the benchmarks (`sidebyside`), the benchmarks' shared options (`bench_options`) and
what a measurement was made with (`provenance`).
Imports `models` (FLOP counts trace a staged model) and `platform`; nothing above them.
"""
