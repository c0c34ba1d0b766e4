"""8 fake CPU devices for every test; set before JAX is first imported."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import pytest

from configs import base

assert len(jax.devices()) == 8, jax.devices()


@pytest.fixture
def tiny_config():
  """The digits task shrunk for tests: narrow ResNet, few steps, no progress bar."""
  config = base.get_config()
  config.model.widths = (4, 8, 8)
  config.num_steps = 20
  config.eval_every = 10
  config.progress_bar = False
  return config
