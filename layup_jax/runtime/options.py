"""The options of the asynchronous runtime, as one typed object built from the config.

The config is checked once, before anything is built (layup_jax/run/validation.py); these are
its values as the runtime reads them. layup_jax/defaults.py says what each key means.
"""

import dataclasses

import ml_collections

from layup_jax import defaults

BN_POLICIES = ("mix", "local")  # config.layup.bn_policy
LOCAL_UPDATES = ("params", "numerator")  # config.layup.local_update
PUSH_SUM = ("per_stage", "per_model")  # config.layup.push_sum
PIN_HOST_THREADS = ("auto", "on", "off")  # config.tuning.pin_host_threads
# Each option's key in the config.
CONFIG_KEYS = {
    "seed": "seed", "bn_policy": "layup.bn_policy", "push_sum": "layup.push_sum",
    "gossip": "layup.gossip", "fanout": "layup.fanout", "local_update": "layup.local_update",
    "max_update_scale": "layup.max_update_scale", "nonfinite": "faults.nonfinite",
    "latency_every": "metrics.latency_every", "straggler_device": "straggler.device",
    "straggler_process": "straggler.process",
    "straggler_delay_iters": "straggler.delay_iters", "straggler_mode": "straggler.mode",
    "transfer_host": "distributed.transfer_host",
    "remote_peer_probability": "distributed.remote_peer_probability",
    "max_remote_backlog": "distributed.max_remote_backlog",
    "compression": "distributed.compression",
    "survivors_train_lost_share": "distributed.survivors_train_lost_share",
    "share_by_speed": "distributed.share_by_speed",
    "adam_mean_of": "optimizer.adam_mean_of",
    **{knob: f"tuning.{knob}" for knob in (
        "max_dispatch_ahead", "max_sends_in_flight", "pack_stages", "fuse_local_step",
        "updater_thread", "pin_host_threads", "idle_poll_s", "remat", "chain_forwards")},
}


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
  """How the threaded runtime trains (LayUp and the baselines built on it): the config's keys
  of `CONFIG_KEYS`, with no defaults of their own. `RuntimeOptions.of(**changes)` is the
  defaults of layup_jax/defaults.py with some changed (what a runtime built without a config,
  in a test or a benchmark, runs)."""

  seed: int
  bn_policy: str
  push_sum: str
  gossip: bool
  fanout: int
  local_update: str
  max_update_scale: float
  max_dispatch_ahead: int
  max_sends_in_flight: int
  pack_stages: bool
  fuse_local_step: bool
  updater_thread: bool
  pin_host_threads: str
  idle_poll_s: float
  remat: str
  chain_forwards: bool
  nonfinite: str
  latency_every: int
  straggler_device: int
  straggler_process: int
  straggler_delay_iters: float
  straggler_mode: str
  transfer_host: str
  remote_peer_probability: float
  max_remote_backlog: int
  compression: str
  survivors_train_lost_share: bool
  share_by_speed: bool
  adam_mean_of: float

  @property
  def by_halves(self) -> bool:
    """Whether each stage's gradient comes as its batch's two halves contributed it, for an
    optimizer that measures its noise (`optimizer.adam_mean_of` > 1)."""
    return self.adam_mean_of > 1

  @classmethod
  def of(cls, **changes) -> "RuntimeOptions":
    """The defaults' options (layup_jax/defaults.py), with `changes`."""
    return cls.from_config(defaults.get_config()).replace(**changes)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "RuntimeOptions":
    def value(key: str):
      section = config
      for part in key.split("."):
        section = section[part]
      return section

    return cls(**{name: value(key) for name, key in CONFIG_KEYS.items()})

  def replace(self, **changes) -> "RuntimeOptions":
    return dataclasses.replace(self, **changes)

  def delay_of(self, device_index: int, process_index: int = 0) -> float:
    """The straggler delay (in iterations) of this process's `device_index`-th device: 0 for
    every device but the straggler, or but the straggling process's (`straggler_process`)."""
    if self.straggler_process >= 0:
      return self.straggler_delay_iters if process_index == self.straggler_process else 0.0
    return self.straggler_delay_iters if device_index == self.straggler_device else 0.0
