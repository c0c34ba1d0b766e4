"""Fashion-MNIST (real data, offline): the digits ResNet on 28x28x1 images, 8 devices.

The data: Debian's `dataset-fashion-mnist` (apt-get install dataset-fashion-mnist), or the four
official idx files in a folder given as data.data_dir (layup_jax/data/fashion_mnist.py).
An epoch is 234 steps of 8 x 32 samples; 8 epochs (at 5, DDP reached 0.8961). Not a paper experiment: the same values for every
algorithm until a per-algorithm search has been run (see the README).
"""

from configs import base

PAPER = {name: {} for name in ("layup", "ddp", "gosgd", "adpsgd", "local_sgd", "slowmo", "co2",
                               "diloco")}


def get_config(algorithm=None):
  config = base.get_config()
  config.data.name = "fashion_mnist"
  config.data.batch_size = 32
  config.data.read_threads = 0  # in memory: a batch is one gather
  config.data.eval_batch_size = 1000
  config.model.widths = (16, 32, 64)
  config.optimizer.learning_rate = 0.05
  config.optimizer.schedule = "cosine"
  config.num_epochs = 8
  config.eval_every = 234  # once per epoch
  config.metrics.target_accuracy = 0.88
  return base.paper_config(config, PAPER, algorithm)
