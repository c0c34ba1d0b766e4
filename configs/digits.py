"""The embedded default task: scikit-learn's handwritten digits, small ResNet, 8 devices.

Runs offline in about a minute on a 2-core CPU with 8 fake devices.
"""

from layup_jax import defaults

PAPER: dict = {}  # not a paper experiment: every algorithm runs with the same values


def get_config(algorithm=None):
  config = defaults.get_config()
  config.data.read_threads = 0  # in memory: a batch is one gather, cheaper than a thread hand-off
  return defaults.paper_config(config, PAPER, algorithm)
