#!/usr/bin/env bash
# Reruns every sweep and benchmark behind docs/results.md, then regenerates it (about 10 h on
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

# Fashion-MNIST: the search, every method x 3 seeds, stragglers on both sides, LayUp's
# ablations (about 8 h here; scripts/sweep_fashion_mnist.sh, resumable). The mock-CIFAR timing
# sweep (6 steps on random labels) is no longer part of the page: it said nothing the digits
# and Fashion-MNIST sweeps do not.
bash scripts/sweep_fashion_mnist.sh

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
    --sweep fashion_mnist_search=runs/sweeps/fashion_mnist_search \
    --sweep fashion_mnist=runs/sweeps/fashion_mnist \
    --sweep fashion_mnist_stragglers=runs/sweeps/fashion_mnist_stragglers --out docs/results.md
