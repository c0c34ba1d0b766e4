"""CIFAR-100, ResNet-50 (CIFAR stem): the paper's Section 5 vision task, on 3 devices.

The paper's appendix table for CIFAR-100 (ResNet-50 columns): batch 128 per worker, SGD, cosine
schedule with T_max 100 epochs, warm-up 5 epochs for LayUp and GoSGD; momentum 0.9 (not stated).
3 devices (the paper's C1, where its learning rates were tuned), float32. Past T_max: as
`cifar100_resnet18.py` says, the run ends at T_max.
Needs `cifar100` prepared in the TFDS data dir.
`:ddp`, `:gosgd`, `:slowmo`, `:co2` take the other columns.
"""

from layup_jax import defaults

PAPER = {
    "layup": {"optimizer.learning_rate": 0.035, "optimizer.warmup_epochs": 5.0,
              "optimizer.warmup_init_lr": 0.01, "optimizer.weight_decay": 0.005},
    "ddp": {"optimizer.learning_rate": 0.045, "optimizer.weight_decay": 0.005},
    "gosgd": {"optimizer.learning_rate": 0.022, "optimizer.warmup_epochs": 5.0,
              "optimizer.warmup_init_lr": 0.0073, "optimizer.weight_decay": 0.014},
    "slowmo": {"optimizer.learning_rate": 0.045, "optimizer.weight_decay": 0.0,
               "baselines.tau": 12, "baselines.out_freq": 48},
    "co2": {"optimizer.learning_rate": 0.045, "optimizer.weight_decay": 0.005,
            "baselines.tau": 12, "baselines.out_freq": 48},
}


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": 3, "model.dtype": "float32",
      "model.name": "resnet50", "model.num_classes": 100, "model.variant": "cifar",
      "data.name": "cifar100", "data.batch_size": 128, "data.eval_batch_size": 500,
      "optimizer.name": "sgd", "optimizer.momentum": 0.9, "optimizer.schedule": "cosine",
      "num_epochs": 100, "eval_every": 390,
  })
  return defaults.paper_config(config, PAPER, algorithm)
