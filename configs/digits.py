"""The embedded default task: scikit-learn's handwritten digits, small ResNet, 8 devices.

Runs offline in about a minute on a 2-core CPU with 8 fake devices.
"""

from configs import base

PAPER = {"layup": {}, "ddp": {}}  # not a paper experiment: the same values for every algorithm


def get_config(algorithm=None):
  return base.paper_config(base.get_config(), PAPER, algorithm)
