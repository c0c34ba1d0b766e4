#!/usr/bin/env bash
# Two checkouts alternated round by round on a lent GPU machine (docs/host.md), for a difference
# that one run each cannot decide:
#   host  bench_host --cases resnet18-cifar --algorithms layup: the host's time per device-
#         iteration (8 fake CPU devices on that machine's cores), this tree against HOST_BEFORE
#   step  bench_step --cases resnet18-cifar-b128 --sides runtime fused: one device's staged
#         runtime against the fused step on the GPU, this tree against STEP_BEFORE
# Every tree is measured with this tree's bench scripts (copied into the others). Each command
# has its own time limit. Each run writes into a scratch folder; after every run the finished
# runs' JSON are merged into $OUT/host_rounds.json and $OUT/step_rounds.json and the logs into
# $OUT/logs.tar.gz (or ./bench_gpu_out): the device tool brings back at most 8 files, also
# from a call that ran out of time, so $OUT never holds more than these three. A run takes
# about a minute on a 16-core host (most of it compilation): 3 host rounds and 2 step rounds
# (10 runs) did not fit in one 10-minute call (2026-11-27).
#
#   bash scripts/bench_gpu_rounds.sh HOST_BEFORE HOST_ROUNDS STEP_BEFORE STEP_ROUNDS
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:-bench_gpu_out}"
out=$(cd "${OUT:-bench_gpu_out}" && pwd)
work=$(mktemp -d)
host_before=$1 host_rounds=$2 step_before=$3 step_rounds=$4
for tree in "$host_before" "$step_before"; do
  cp scripts/bench_host.py scripts/bench_step.py "$tree/scripts/"
done
export PYTHONUNBUFFERED=1

collect() {  # every finished run's JSON into one file per benchmark, the logs into one archive
  python3 - "$work" "$out" <<'PY'
import glob, json, os, sys
work, out = sys.argv[1:]
for bench in ("host", "step"):
  rounds = {}
  for path in sorted(glob.glob(os.path.join(work, f"{bench}_*_*.json"))):
    with open(path) as f:
      rounds[os.path.basename(path)[:-5]] = json.load(f)
  if rounds:
    with open(os.path.join(out, f"{bench}_rounds.json"), "w") as f:
      json.dump(rounds, f, indent=1)
PY
  (cd "$work" && tar czf "$out/logs.tar.gz" ./*.log)
}

run() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "exit $? after ${SECONDS}s"
  tail -n 3 "$work/$name.log"
  collect
}

for round in $(seq "$host_rounds"); do
  for tree in . "$host_before"; do
    tag=$([[ "$tree" == "." ]] && echo head || echo before)
    (cd "$tree" && JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      run "host_${tag}_$round" 90 python3 scripts/bench_host.py --cases resnet18-cifar \
      --algorithms layup --repeats 10 --steps 15 --out "$work/host_${tag}_$round.json")
  done
done
for round in $(seq "$step_rounds"); do
  for tree in . "$step_before"; do
    tag=$([[ "$tree" == "." ]] && echo head || echo before)
    (cd "$tree" && run "step_${tag}_$round" 90 python3 scripts/bench_step.py \
      --cases resnet18-cifar-b128 --sides runtime fused --repeats 5 \
      --out "$work/step_${tag}_$round.json")
  done
done
