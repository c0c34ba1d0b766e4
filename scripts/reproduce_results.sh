#!/usr/bin/env bash
# Reruns every sweep and benchmark behind docs/results.md, then regenerates it (about 2.5 h on
# a 2-core CPU machine with 8 fake devices). Sweeps skip runs already finished in runs/sweeps;
# delete that folder to start afresh. Needs the report extra: pip install -e '.[report]'.
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"

# The digits task: every method without a straggler; then device 0 delayed 1, 2, 4 iterations
# for LayUp, DDP, GoSGD and Local SGD; three seeds each.
python scripts/sweep.py --config configs/digits.py --workdir runs/sweeps/digits \
    --algorithms layup ddp gosgd adpsgd local_sgd slowmo co2 diloco --seeds 0 1 2 --delays 0 \
    --set num_epochs=20 --set eval_every=10 --set metrics.target_accuracy=0.95
python scripts/sweep.py --config configs/digits.py --workdir runs/sweeps/digits \
    --algorithms layup ddp gosgd local_sgd --seeds 0 1 2 --delays 1 2 4 \
    --set num_epochs=20 --set eval_every=10 --set metrics.target_accuracy=0.95

# CIFAR-100 ResNet-18 (the paper's hyper-parameters per method) on mocked records of CIFAR's
# shapes, batch 32 per device, 6 steps: timings only (accuracies are those of random labels).
python scripts/sweep.py --config configs/cifar100_resnet18.py \
    --workdir runs/sweeps/cifar100_resnet18 --algorithms layup ddp --seeds 0 --delays 0 2 \
    --mock-tfds 512 --set data.batch_size=32 --set data.eval_batch_size=256 \
    --set num_steps=6 --set eval_every=3

python scripts/bench_step.py --cases digits resnet18-cifar gpt2-tiny --repeats 41 \
    --out docs/results/bench_step.json
python scripts/bench_runtime.py --repeats 15 --gossip-cases digits resnet18-cifar \
    --out docs/results/bench_runtime.json
python scripts/bench_runtime.py --repeats 3 --gossip-cases digits --ahead 1 2 4 \
    --out docs/results/bench_ahead.json
python scripts/bench_straggler.py --num-devices 8 --delays 0 1 2 4 --repeats 5 --num-steps 300 \
    --out docs/results/bench_straggler_8dev.json
python scripts/bench_memory.py --cases digits resnet18-cifar --num-devices 8 \
    --out docs/results/bench_memory.json

python scripts/report.py --sweep digits=runs/sweeps/digits \
    --sweep cifar100_resnet18=runs/sweeps/cifar100_resnet18 --out docs/results.md
