"""CIFAR-100, ResNet-18 (CIFAR stem): the paper's Section 5 vision task, on 3 devices.

The paper's appendix table for CIFAR-100 (ResNet-18 columns): batch 128 per worker, SGD, cosine
schedule with T_max 100 epochs, warm-up 5 epochs for LayUp and GoSGD; momentum 0.9 (not stated).
Vision ran on the paper's C1, 3 GPUs, and its learning rates were tuned for 3 workers, so the
config trains on 3 devices; float32, as every model in the paper.
The run ends at T_max: the paper reports convergence at epochs 103-106, past T_max, where
PyTorch's cosine schedule rises again from 0; here the learning rate decays to 0 at the end of
`num_epochs`, and a longer `num_epochs` stretches the schedule with it.
Needs `cifar100` prepared in the TFDS data dir (the error says how when it is not).
`--config configs/cifar100_resnet18.py:ddp` takes DDP's column (also `:gosgd`, `:slowmo`,
`:co2`).
"""

from layup_jax import defaults

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
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": 3, "model.dtype": "float32",
      "model.name": "resnet18", "model.num_classes": 100, "model.variant": "cifar",
      "data.name": "cifar100", "data.batch_size": 128, "data.eval_batch_size": 500,
      "optimizer.name": "sgd", "optimizer.momentum": 0.9, "optimizer.schedule": "cosine",
      "num_epochs": 100, "eval_every": 390,
  })
  return defaults.paper_config(config, PAPER, algorithm)
