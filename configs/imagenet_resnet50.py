"""ImageNet-1k, ResNet-50, 3 devices: the paper's Section 5 large vision task.

3 devices, as the paper's C1 that ran every vision task (its learning rates were tuned for 3
workers); float32. Batch 256 per worker, SGD, 90 epochs, 2 warm-up epochs, weight decay 1e-4 (appendix table);
the learning rate decays linearly to zero after warm-up as Section 5's setup says (the table
lists a cosine T_max of 90 epochs; set optimizer.schedule=cosine for that reading). Momentum
0.9 (not stated). Needs `imagenet2012` prepared in the TFDS data dir, which needs the manual
download from image-net.org (the error says how).
`:ddp`, `:gosgd`, `:slowmo`, `:co2` take the other columns.
"""

from layup_jax import defaults

PAPER = {
    "layup": {"optimizer.learning_rate": 0.1, "optimizer.warmup_init_lr": 0.03},
    "ddp": {"optimizer.learning_rate": 0.3, "optimizer.warmup_init_lr": 0.1},
    "gosgd": {"optimizer.learning_rate": 0.1, "optimizer.warmup_init_lr": 0.03},
    "slowmo": {"optimizer.learning_rate": 0.3, "optimizer.warmup_init_lr": 0.1,
               "baselines.tau": 12, "baselines.out_freq": 48},
    "co2": {"optimizer.learning_rate": 0.3, "optimizer.warmup_init_lr": 0.1,
            "baselines.tau": 12, "baselines.out_freq": 48},
}


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": 3, "model.dtype": "float32",
      "model.name": "resnet50", "model.num_classes": 1000, "model.variant": "imagenet",
      "data.name": "imagenet2012", "data.batch_size": 256, "data.eval_batch_size": 250,
      "data.read_threads": 8,
      "optimizer.name": "sgd", "optimizer.momentum": 0.9, "optimizer.schedule": "linear",
      "optimizer.warmup_epochs": 2.0, "optimizer.weight_decay": 1e-4,
      "num_epochs": 90, "eval_every": 625,
  })
  return defaults.paper_config(config, PAPER, algorithm)
