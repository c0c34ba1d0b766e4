"""layup_jax: asynchronous decentralized data-parallel training with layer-wise updates.

The package root imports nothing heavy so that `python -m layup_jax.train` can set XLA flags
before JAX is first imported.
"""

__version__ = "0.1.0"
