"""Training algorithms by name; each builds a `Runtime` from the config, model and data."""

from collections.abc import Callable

from layup_jax.algorithms import ddp, layup
from layup_jax.algorithms.base import Runtime, Snapshot

_REGISTRY: dict[str, Callable[..., Runtime]] = {
    "ddp": ddp.build,
    "layup": layup.build,
}


def names() -> list[str]:
  return sorted(_REGISTRY)


def build_runtime(config, model, tx, devices, dataset) -> Runtime:
  """The runtime of `config.algorithm` on `devices`."""
  return _REGISTRY[config.algorithm](config, model, tx, devices, dataset)


__all__ = ["Runtime", "Snapshot", "build_runtime", "names"]
