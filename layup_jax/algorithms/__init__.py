"""Training algorithms by name; each builds a `Runtime` from the config, model and data."""

from collections.abc import Callable

from layup_jax.algorithms import ddp, gossip, layup, periodic
from layup_jax.algorithms.base import Runtime
from layup_jax.snapshot import Snapshot

_REGISTRY: dict[str, Callable[..., Runtime]] = {
    "layup": layup.build,
    "ddp": ddp.build,
    "gosgd": gossip.build,
    "adpsgd": gossip.build,
    "local_sgd": periodic.build,
    "slowmo": periodic.build,
    "co2": periodic.build,
    "diloco": periodic.build,
}


def names() -> list[str]:
  return sorted(_REGISTRY)


def build_runtime(config, model, tx, devices, dataset) -> Runtime:
  """The runtime of `config.algorithm` on `devices`."""
  return _REGISTRY[config.algorithm](config, model, tx, devices, dataset)


__all__ = ["Runtime", "Snapshot", "build_runtime", "names"]
