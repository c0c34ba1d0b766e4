"""The options of the asynchronous runtime, as one typed object built from the config.

The config is checked once, before anything is built (layup_jax/run/validation.py); these are
its values as the runtime reads them. layup_jax/defaults.py says what each key means.
"""

import dataclasses

import ml_collections

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
    "straggler_delay_iters": "straggler.delay_iters", "straggler_mode": "straggler.mode",
    "transfer_host": "distributed.transfer_host",
    "remote_peer_probability": "distributed.remote_peer_probability",
    "max_remote_backlog": "distributed.max_remote_backlog",
    "compression": "distributed.compression",
    "survivors_train_lost_share": "distributed.survivors_train_lost_share",
    **{knob: f"tuning.{knob}" for knob in (
        "max_dispatch_ahead", "max_sends_in_flight", "pack_stages", "fuse_local_step",
        "updater_thread", "pin_host_threads", "idle_poll_s", "remat", "chain_forwards")},
}


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
  """How the threaded runtime trains (LayUp and the baselines built on it)."""

  seed: int = 0
  bn_policy: str = "mix"
  push_sum: str = "per_stage"
  gossip: bool = True
  fanout: int = 1
  local_update: str = "params"
  max_update_scale: float = 4.0
  max_dispatch_ahead: int = 1
  max_sends_in_flight: int = 0
  pack_stages: bool = True
  fuse_local_step: bool = True
  updater_thread: bool = True
  pin_host_threads: str = "auto"
  idle_poll_s: float = -1.0
  remat: str = "dots"
  chain_forwards: bool = False
  nonfinite: str = "stop"
  latency_every: int = 0
  straggler_device: int = -1
  straggler_delay_iters: float = 0.0
  straggler_mode: str = "host"
  transfer_host: str = ""
  remote_peer_probability: float = 0.2
  max_remote_backlog: int = 4
  compression: str = "int8"
  survivors_train_lost_share: bool = True

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

  def delay_of(self, device_index: int) -> float:
    """The straggler delay (in iterations) of one device: 0 for every device but the
    straggler."""
    return self.straggler_delay_iters if device_index == self.straggler_device else 0.0
