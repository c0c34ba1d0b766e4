"""Training algorithms by name: the one registry (`register`), and the only place that reads
`config.algorithm`.

An algorithm is a `build(config, model, tx, devices, dataset) -> Runtime` and its traits
(`Algorithm`); everything that differs between two algorithms on the same runtime (GoSGD and
AD-PSGD, or the four periodic baselines) is bound here, where it is named, rather than by
branching on the name elsewhere.

Owns: one module per method (`layup`: paper Algorithm 1; `gossip`: GoSGD, AD-PSGD; `ddp`;
`periodic` with its outer steps in `outer`: Local SGD, SlowMo, CO2, DiLoCo), what every
algorithm exposes to the runner (`base.Runtime`) and exact averages over devices
(`collectives`). Imports `runtime` and the packages below it; only `run` imports it.
"""

import dataclasses
import functools
from collections.abc import Callable

import ml_collections
import optax

from layup_jax.algorithms import ddp, gossip, layup, outer, periodic
from layup_jax.algorithms.base import Runtime, asynchronous_runtime
from layup_jax.runtime.stats import Snapshot


@dataclasses.dataclass(frozen=True)
class Algorithm:
  build: Callable[..., Runtime]  # (config, model, tx, devices, dataset) -> Runtime
  # Sends stages to random peers with push-sum weights (the gossip family): across processes
  # through crossprocess.py, where only per-stage weights can follow a stage to its peer.
  gossip: bool = False
  # A process started again rejoins its running run (gossip across processes): push-sum weights
  # let a live device give it a replica with a share of its weight, the average kept.
  rejoins: bool = False
  # Takes its outer step at every average (`baselines.out_freq` must equal `baselines.tau`).
  outer_step_every_average: bool = False
  # Each device steps on its own gradient (False: DDP's devices step on their mean), so an
  # Adam normalized as by the mean of many (`optimizer.adam_mean_of`) applies.
  own_gradients: bool = True


_REGISTRY: dict[str, Algorithm] = {}


def register(name: str, build: Callable[..., Runtime], **traits: bool) -> None:
  """Makes `config.algorithm = name` run `build`, with `Algorithm`'s `traits` (refuses a name
  taken already)."""
  if name in _REGISTRY:
    raise ValueError(f"algorithm {name!r} is registered already")
  _REGISTRY[name] = Algorithm(build, **traits)


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> Algorithm:
  return _REGISTRY[name]


def build_runtime(config: ml_collections.ConfigDict, model, tx, devices, dataset) -> Runtime:
  """The runtime of `config.algorithm` on `devices`."""
  return _REGISTRY[config.algorithm].build(config, model, tx, devices, dataset)


def _on_asynchronous_runtime(exchange: type) -> Callable[..., Runtime]:
  return functools.partial(asynchronous_runtime, make_exchange=exchange)


register("layup", _on_asynchronous_runtime(layup.LayUp), gossip=True, rejoins=True)
# The paper's Algorithm 1 as written, beside `layup`'s defaults: the same code with one push-sum
# weight per device and a stage per layer (layup_jax/defaults.py ALGORITHM_SETTINGS, which
# run/validation.py holds it to).
register("layup_paper", _on_asynchronous_runtime(layup.LayUp), gossip=True)
register("ddp", ddp.build, own_gradients=False)
register("gosgd", _on_asynchronous_runtime(gossip.GoSGD), gossip=True, rejoins=True)
register("adpsgd", _on_asynchronous_runtime(gossip.ADPSGD), gossip=True)
register("local_sgd", periodic.builder(lambda b: None))
register("slowmo", periodic.builder(lambda b: outer.SlowMo(b.slow_lr, b.slow_momentum)))
register("co2", periodic.builder(
    lambda b: outer.CO2Outer(b.slow_lr, b.slow_momentum, b.co2_clip,
                                b.co2_gap_penalty), lag=1))
register("diloco", periodic.builder(lambda b: outer.OptaxOuter(  # Douillard et al. 2023,
    optax.sgd(b.outer_lr, momentum=b.outer_momentum, nesterov=True)),  # Algorithm 1
    averages_per_outer_step=1), outer_step_every_average=True)

__all__ = ["Algorithm", "Runtime", "Snapshot", "build_runtime", "get", "names", "register"]
