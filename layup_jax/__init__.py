"""layup_jax: asynchronous decentralized data-parallel training with layer-wise updates.

The Python API a user's script needs (docs/guide/your_model.md):

  config = layup_jax.get_config()            # every key and its default (layup_jax/defaults.py)
  config = layup_jax.load_config("configs/digits.py", "ddp")   # a config file, a column of it
  layup_jax.register_model(name, builder)    # a StagedModel of one's own (flax linen or NNX)
  layup_jax.register_data(name, build)       # a dataset of one's own
  summary = layup_jax.train(config, workdir) # trains; the summary also in workdir/summary.json
  layup_jax.export_model(workdir, out)       # the consensus model out of the newest checkpoint
  model = layup_jax.load_model(out)          # ... and back, for inference: model(inputs)

The package root imports nothing heavy (names are resolved when first used) so that
`python -m layup_jax.train` can set XLA flags before JAX is first imported. `layup_jax.train`
is the function; the command line is the module `python -m layup_jax.train` runs.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {  # name -> (module, attribute)
    "get_config": ("layup_jax.defaults", "get_config"),
    "register_model": ("layup_jax.models", "register"),
    "register_data": ("layup_jax.data", "register"),
    "StagedModel": ("layup_jax.models.staged", "StagedModel"),
    "Tie": ("layup_jax.models.staged", "Tie"),
    "export_model": ("layup_jax.export", "export_model"),
    "load_model": ("layup_jax.export", "load_model"),
    "UserError": ("layup_jax.errors", "UserError"),
}
__all__ = ["train", "load_config", *_LAZY]


def train(config, workdir, should_stop=None) -> dict[str, Any]:
  """Trains `config` (an `ml_collections.ConfigDict`: `get_config()`, `load_config(...)`)
  in this process and returns the run's summary, also written to `workdir/summary.json` beside
  `metrics.jsonl` and the checkpoints. Resumes from `workdir`'s newest checkpoint. A bad
  setting raises `UserError` (a `ValueError`) whose message names the key.

  `should_stop()`, polled during training, stops the run at the next consistent point with a
  checkpoint (the summary is then `{"stopped": True, "step": ...}`). One process: several
  processes or hosts start through `python -m layup_jax.launch` (docs/guide/running.md)."""
  from layup_jax.run import runner

  return runner.run(config, workdir, should_stop or (lambda: False))


def load_config(path, algorithm: str | None = None):
  """The config of a config file (`get_config(algorithm)`, as `--config FILE:ALGORITHM`)."""
  from layup_jax.defaults import load_config_file

  return load_config_file(path, algorithm)


def __getattr__(name: str):
  if name in _LAZY:
    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)
  raise AttributeError(f"module 'layup_jax' has no attribute {name!r}")
