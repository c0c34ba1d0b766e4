"""8 fake CPU devices for every test; set before JAX is first imported."""

import os
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ["JAX_PLATFORMS"] = "cpu"
# Tests build many runtimes whose per-stage functions compile to the same programs; a persistent
# compilation cache (shared by xdist workers and the CLI subprocesses) compiles each once.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "layup_jax_test_compilation_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import pytest

from layup_jax import defaults
from layup_jax.platform import compat

# As a run keys them (`compile_cache.enable`): a stage's program compiled for one device is read
# for the others.
compat.key_single_device_programs_without_their_device()

assert len(jax.devices()) == 8, jax.devices()


@pytest.fixture
def tiny_config():
  """The digits task shrunk for tests: narrow ResNet, few steps, no progress bar.

  A stage per residual block (5 stages) rather than the default's per layer (8): the suite
  compiles and dispatches about a third fewer programs per run, which keeps CI within its time.
  Tests of the default granularity set it themselves (test_train.py, test_models.py).
  """
  config = defaults.get_config()
  config.model.widths = (4, 8, 8)
  config.model.granularity = "per_block"
  config.num_steps = 20
  config.eval_every = 10
  config.progress_bar = False
  return config
