"""The embedded default task: scikit-learn's handwritten digits, small ResNet, 8 devices.

Runs offline in about a minute on a 2-core CPU with 8 fake devices.
"""

from configs import base


def get_config():
  config = base.get_config()
  return config
