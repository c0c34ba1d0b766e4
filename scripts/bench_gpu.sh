#!/usr/bin/env bash
# The GPU checks of the runtime's speed, in one run on a lent GPU machine (docs/host.md):
#   bench_step  --cases resnet18-cifar-b128 gpt2-124m-bf16  the runtime (and the same stages
#               dispatched serially from one thread) against the fused step on the GPU, MFU,
#               and one traced block of each (`--trace`: the GPU's busy time and kernels per
#               iteration); STEP_SIDES overrides the sides (e.g. "runtime ahead2 fused"),
#               STEP_ITERS the iterations per timed block (default: the case's own)
#   bench_host  --cases resnet18-cifar --algorithms layup   the host's time per device-iteration on
#               that machine's CPU cores (8 fake CPU devices: the host's dispatch cost where the
#               cores are not shared with the device work, as they are on a 2-core machine); this
#               tree with and without the updater thread, its two threads pinned to one core (what
#               `tuning.pin_host_threads="auto"` does on a GPU node), then the updater thread again
#               as a second round; with PER_LAYER=1 also at per_layer granularity
#   allocator   with ALLOCATOR=1: bench_host under the C library's malloc (`--allocator system`)
#               between the two rounds under the default (TCMalloc where found; a copy carried as
#               .whl/libtcmalloc_minimal.so.4 is found through LD_LIBRARY_PATH); with STEP_SYSTEM=1
#               bench_step's ResNet-18 case under it too
#   GPU client  with GPU_CLIENT=1: bench_host with one device on the GPU's own client and on
#               the CPU client of the same host (what a dispatch costs there, docs/host.md)
#   command buffers  with CMDBUF=1: the GPU client's bench_host and bench_step's ResNet-18 case
#               under XLA's default command buffers, with graphs of any size
#               (--xla_gpu_graph_min_graph_size=1) and with none (--xla_gpu_enable_command_buffer=)
#   remat       with REMAT=1: bench_step's runtime with `tuning.remat="none"` beside the default
#               ("dots") and the fused step, both cases (is the staged step's device time on the
#               GPU the backward's recomputation?)
#   chained     with CHAIN=1: `tuning.chain_forwards` on and off, side by side: the GPU client's
#               bench_host (one device) and on 8 fake CPU devices, and bench_step's side
#               `chained` beside the runtime and the fused step (ResNet-18 b128, GPT-2 124M)
#   DEFAULTS=0  leaves out bench_step and bench_host above (the device tool brings back 8 files:
#               CMDBUF=1 alone writes 7)
#   attention   with ATTENTION=1: cuDNN's flash attention against XLA's on GPT-2 124M (cuDNN's
#               bf16 logits no further from XLA's float32 ones than XLA's bf16 logits, then
#               the fused and staged steps with each, `gpt2-124m-bf16` (auto: cuDNN) beside
#               `gpt2-124m-bf16-xla`), and the batch that fills the GPU with the vocabulary
#               padded to 50,304 (`gpt2-124m-bf16-b32`)
#   dispatch    with DISPATCH=1: each program's dispatch cost inside a run against alone
#               (`bench_host.py dispatch`), on the same fake devices (is the 2-core machine's
#               1.5-3.8x the CPU client's?)
# for this tree and, given BEFORE (another checkout of the project), for that one too, with this
# tree's benchmark scripts copied into it so that both are measured by the same harness. Each
# command has its own time limit, so that one overrun leaves the others' figures; the JSON go to
# $OUT (or ./bench_gpu_out), the logs into one logs.tar.gz there (the device tool brings back at
# most 8 files).
#
#   bash scripts/bench_gpu.sh [BEFORE]
#
# Mode `rounds` (was scripts/bench_gpu_rounds.sh): two checkouts alternated round by round, for a
# difference that one run each cannot decide:
#   host  bench_host --cases resnet18-cifar --algorithms layup: the host's time per device-
#         iteration (8 fake CPU devices on that machine's cores), this tree against HOST_BEFORE
#   step  bench_step --cases resnet18-cifar-b128 --sides runtime fused: one device's staged
#         runtime against the fused step on the GPU, this tree against STEP_BEFORE
# Each run writes into a scratch folder; after every run the finished runs' JSON are merged into
# $OUT/host_rounds.json and $OUT/step_rounds.json and the logs into $OUT/logs.tar.gz: the device
# tool brings back at most 8 files, also from a call that ran out of time, so $OUT never holds
# more than these three. A run takes about a minute on a 16-core host (most of it
# compilation): 3 host rounds and 2 step rounds (10 runs) did not fit in one 10-minute call
# (2026-11-27).
#
#   bash scripts/bench_gpu.sh rounds HOST_BEFORE HOST_ROUNDS STEP_BEFORE STEP_ROUNDS
#
# Either way, every other tree is measured with this tree's bench_host.py and bench_step.py, and
# the module they import (layup_jax/measure/bench_options.py, copied into that tree's
# layup_jax/measure/ where it has that folder: an older checkout has no copy of its own).
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above is the usage
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
  exit 0
fi
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${1:-}" && "$1" != rounds && ! -d "$1/layup_jax" ]]; then
  echo "error: BEFORE must be another checkout of the project (a folder with layup_jax/), not $1; bash scripts/bench_gpu.sh --help says more" >&2
  exit 2
fi
mkdir -p "${OUT:-bench_gpu_out}"
out=$(cd "${OUT:-bench_gpu_out}" && pwd)
export PYTHONUNBUFFERED=1
carry_harness() {  # carry_harness TREE: this tree's benchmark scripts into TREE
  cp scripts/bench_host.py scripts/bench_step.py "$1/scripts/"
  if [[ -d "$1/layup_jax/measure" ]]; then
    cp layup_jax/measure/bench_options.py "$1/layup_jax/measure/"
  fi
}

if [[ "${1:-}" == rounds ]]; then
  if [[ $# -ne 5 ]]; then
    echo "error: usage: bash scripts/bench_gpu.sh rounds HOST_BEFORE HOST_ROUNDS STEP_BEFORE STEP_ROUNDS" >&2
    exit 2
  fi
  host_before=$2 host_rounds=$3 step_before=$4 step_rounds=$5
  for tree in "$host_before" "$step_before"; do
    if [[ ! -d "$tree/layup_jax" ]]; then
      echo "error: $tree is not a checkout of the project (no layup_jax/ in it)" >&2
      exit 2
    fi
  done
  work=$(mktemp -d)
  for tree in "$host_before" "$step_before"; do
    carry_harness "$tree"
  done
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
  round_run() {  # name limit command...
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
        round_run "host_${tag}_$round" 90 python3 scripts/bench_host.py --cases resnet18-cifar \
        --algorithms layup --repeats 10 --steps 15 --out "$work/host_${tag}_$round.json")
    done
  done
  for round in $(seq "$step_rounds"); do
    for tree in . "$step_before"; do
      tag=$([[ "$tree" == "." ]] && echo head || echo before)
      (cd "$tree" && round_run "step_${tag}_$round" 90 python3 scripts/bench_step.py \
        --cases resnet18-cifar-b128 --sides runtime fused --repeats 5 \
        --out "$work/step_${tag}_$round.json")
    done
  done
  exit 0
fi

before="${1:-}"
trees=(".")
if [[ -n "$before" ]]; then
  carry_harness "$before"
  trees+=("$before")
fi
if [[ -f .whl/libtcmalloc_minimal.so.4 ]]; then  # an image without TCMalloc: the carried copy
  export LD_LIBRARY_PATH="$PWD/.whl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
run() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "exit $? after ${SECONDS}s"
  tail -n 4 "$out/$name.log"
}
host() {  # tag limit extra-arguments...: bench_host on ResNet-18's structure, 8 fake CPU devices
  local tag=$1 limit=$2
  shift 2
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    run "host_$tag" "$limit" python3 scripts/bench_host.py --cases resnet18-cifar \
    --algorithms layup --repeats 5 --steps 15 "$@" --out "$out/bench_host_$tag.json"
}
step_iters=()
if [[ -n "${STEP_ITERS:-}" ]]; then step_iters=(--iters "$STEP_ITERS"); fi
if [[ "${DEFAULTS:-1}" == 1 ]]; then  # DEFAULTS=0: only the extras asked for below
  for tree in "${trees[@]}"; do
    tag=$([[ "$tree" == "." ]] && echo after || echo before)
    # shellcheck disable=SC2086  # STEP_SIDES is a list of words
    (cd "$tree" && run "step_$tag" 180 python3 scripts/bench_step.py \
      --cases resnet18-cifar-b128 gpt2-124m-bf16 --sides ${STEP_SIDES:-runtime staged fused} \
      --repeats 7 "${step_iters[@]}" --trace "/tmp/bench_gpu_trace_$tag" \
      --out "$out/bench_step_$tag.json")
  done
  host after 140 --updater-thread on off --pin-threads on
  if [[ -n "$before" ]]; then
    (cd "$before" && host before 60)  # an older checkout may know none of the options above
  fi
  if [[ "${ALLOCATOR:-0}" == 1 ]]; then
    host allocator_system 140 --updater-thread on off --pin-threads on --allocator system
  fi
  host after_round2 80 --updater-thread on --pin-threads on
fi
if [[ "${PER_LAYER:-0}" == 1 ]]; then
  host after_per_layer 110 --granularity per_layer  # 60 s ran out compiling (2026-11-28)
fi
if [[ "${STEP_SYSTEM:-0}" == 1 ]]; then
  run step_system 150 python3 scripts/bench_step.py --cases resnet18-cifar-b128 \
    --sides runtime fused --repeats 7 "${step_iters[@]}" --allocator system \
    --out "$out/bench_step_system.json"
fi
gpu_host() {  # tag limit extra-arguments...: bench_host with one device of the default client
  local tag=$1 limit=$2
  shift 2
  run "host_$tag" "$limit" python3 scripts/bench_host.py --num-devices 1 --cases resnet18-cifar \
    --algorithms layup --repeats 5 --steps 40 --pin-threads on "$@" --out "$out/bench_host_$tag.json"
}
if [[ "${GPU_CLIENT:-0}" == 1 ]]; then
  XLA_FLAGS= gpu_host gpu1 110 --updater-thread on off
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
    gpu_host cpu1 80 --updater-thread on off
fi
if [[ "${CMDBUF:-0}" == 1 ]]; then
  for variant in default:"" min1:--xla_gpu_graph_min_graph_size=1 \
      none:--xla_gpu_enable_command_buffer=; do
    XLA_FLAGS="${variant#*:}" gpu_host "gpu1_cmdbuf_${variant%%:*}" 60 --updater-thread on
    XLA_FLAGS="${variant#*:}" run "step_cmdbuf_${variant%%:*}" 100 python3 scripts/bench_step.py \
      --cases resnet18-cifar-b128 --sides runtime fused --repeats 5 \
      --trace "/tmp/bench_gpu_trace_cmdbuf_${variant%%:*}" \
      --out "$out/bench_step_cmdbuf_${variant%%:*}.json"
  done
fi
if [[ "${CHAIN:-0}" == 1 ]]; then
  XLA_FLAGS= gpu_host gpu1_chain 110 --updater-thread on --chain-forwards on off
  host chain 140 --updater-thread on --pin-threads on --chain-forwards on off
  run step_chain 180 python3 scripts/bench_step.py --cases resnet18-cifar-b128 gpt2-124m-bf16 \
    --sides runtime chained fused --repeats 5 --out "$out/bench_step_chain.json"
fi
if [[ "${REMAT:-0}" == 1 ]]; then
  run step_remat 180 python3 scripts/bench_step.py --cases resnet18-cifar-b128 gpt2-124m-bf16 \
    --sides runtime noremat fused --repeats 5 --out "$out/bench_step_remat.json"
fi
if [[ "${ATTENTION:-0}" == 1 ]]; then
  # Both bf16 paths against XLA's float32 logits (the same parameters: they are float32 in
  # every dtype): cuDNN's may be no further from them than XLA's own bf16 path, 10 % allowed on
  # the max and the mean. A fixed bound between the two bf16 paths does not hold for a 12-layer
  # model: on an H200 (2026-12-04) XLA's bf16 logits were 0.043 from float32's at most and
  # cuDNN's 0.038, and the two bf16 paths 0.040 from each other, over 2e-2.
  run attention_check 90 python3 -c "
import jax, numpy as np
from layup_jax import defaults
from layup_jax import models
config = defaults.get_config().model
config.update({'name': 'gpt2', 'size': 'gpt2', 'max_len': 1024})
tokens = np.random.default_rng(0).integers(0, config.vocab_size, (4, 1024)).astype(np.int32)
out = {}
for name, dtype, attention in (('xla_f32', 'float32', 'xla'), ('xla', 'bfloat16', 'xla'),
                               ('cudnn', 'bfloat16', 'cudnn')):
  config.dtype, config.attention = dtype, attention
  model = models.make_model(config)
  params, state = model.init(jax.random.key(0), tokens)
  out[name] = np.asarray(model.apply(params, state, tokens, jax.random.key(0), 0,
                                     train=False)[0], np.float32)
error = {name: np.abs(out[name] - out['xla_f32']) for name in ('xla', 'cudnn')}
for name, diff in error.items():
  print(name, 'bf16 vs xla float32 logits: max abs diff', diff.max(), 'mean', diff.mean())
print('max abs logit', np.abs(out['xla_f32']).max())
assert error['cudnn'].max() <= 1.1 * error['xla'].max(), 'cuDNN further from float32 than XLA'
assert error['cudnn'].mean() <= 1.1 * error['xla'].mean(), 'cuDNN further from float32 than XLA'
"
  run step_attention 300 python3 scripts/bench_step.py \
    --cases gpt2-124m-bf16-xla gpt2-124m-bf16 gpt2-124m-bf16-b32 --sides runtime fused \
    --repeats 5 --out "$out/bench_step_attention.json"
fi
if [[ "${DISPATCH:-0}" == 1 ]]; then
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    run dispatch 150 python3 scripts/bench_host.py dispatch --repeats 1 --updater-thread on \
    --out "$out/bench_dispatch.json"
fi
(cd "$out" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
