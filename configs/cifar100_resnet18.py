"""CIFAR-100, ResNet-18 (CIFAR stem), 8 devices: the paper's Section 5 vision task.

Hyper-parameters from the paper's appendix table for CIFAR-100 (batch 128 per worker, SGD,
cosine schedule over 100 epochs, warm-up 5 epochs for LayUp); momentum 0.9 (not stated).
Needs `cifar100` prepared in the TFDS data dir (the error says how when it is not).
`--config configs/cifar100_resnet18.py:ddp` takes DDP's column (also `:gosgd`, `:slowmo`,
`:co2`).
"""

from configs import base

PAPER = {
    "layup": {"optimizer.learning_rate": 0.035, "optimizer.warmup_epochs": 5.0,
              "optimizer.warmup_init_lr": 0.012, "optimizer.weight_decay": 0.003},
    "ddp": {"optimizer.learning_rate": 0.045, "optimizer.weight_decay": 0.005},
    "gosgd": {"optimizer.learning_rate": 0.045, "optimizer.warmup_epochs": 5.0,
              "optimizer.warmup_init_lr": 0.015, "optimizer.weight_decay": 0.005},
    "slowmo": {"optimizer.learning_rate": 0.045, "optimizer.weight_decay": 0.005,
               "baselines.tau": 12, "baselines.out_freq": 48},
    "co2": {"optimizer.learning_rate": 0.045, "optimizer.weight_decay": 0.005,
            "baselines.tau": 12, "baselines.out_freq": 48},
}


def get_config(algorithm=None):
  config = base.get_config()
  base.set_values(config, {
      "model.name": "resnet18", "model.num_classes": 100, "model.variant": "cifar",
      "data.name": "cifar100", "data.batch_size": 128, "data.eval_batch_size": 500,
      "optimizer.name": "sgd", "optimizer.momentum": 0.9, "optimizer.schedule": "cosine",
      "num_epochs": 100, "eval_every": 390,
  })
  return base.paper_config(config, PAPER, algorithm)
