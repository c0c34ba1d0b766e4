"""Several processes (hosts, or GPUs of one host) as one run, on JAX's own distributed runtime.

`initialize(config.distributed)` calls `jax.distributed.initialize` with the config's keys; it
must run before anything touches a JAX backend (`jax.devices()`, a `device_put`, a jit), so the
command line calls it first. After it, `jax.devices()` lists every process's devices, ordered by
process (process 0's first), and `config.num_devices` counts them all.

A run's devices are `jax.devices()[:num_devices]`; a device's *position* in that list is its
global index (device ids are not positions: on CPU, process 1's ids start at 2048). Each process
feeds only its own devices (`local_positions`), and only the run's leader writes records
(`is_primary`): process 0, or after its loss the lowest live process (`membership`). The
coordination service runs in process 0, or with `external_coordinator` in a process of its own
(`multiprocess/coordinator.py`), every training process then its client. Checkpoints are one Orbax checkpoint of the whole run, written by every process
together into the workdir, which must be on a filesystem every process sees; a stop request
(SIGTERM, Ctrl-C) takes effect at the next evaluation or checkpoint, where the processes agree
on it. Every algorithm runs across processes: DDP; LayUp, GoSGD and AD-PSGD, their sends and
pairwise averages with other processes' devices through multiprocess/remote_peers.py; the
periodic baselines, their average an all-reduce over every process's devices
(algorithms/collectives.py).
In the gossip and periodic algorithms' checkpoints each process writes its own devices'
replicas (rows of arrays sharded over the run's devices, `checkpointing.DeviceRows`) and
process 0 the state every process holds the same, with the metadata gathered from all
(layup_jax/runtime/state.py).
"""

import dataclasses
import errno
import inspect
import os
import socket

import jax
import ml_collections
import numpy as np

from layup_jax.errors import ConfigError
from layup_jax.multiprocess import membership, signed
from layup_jax.platform import compat

AUTO = "auto"  # distributed.coordinator_address: JAX's cluster auto-detection (SLURM, ...)


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `jax.distributed.initialize` is given; `None` fields are left to JAX to detect."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  heartbeat_timeout_s: int
  external_coordinator: bool = False  # the service runs in a process of its own


def settings(config: ml_collections.ConfigDict) -> Settings | None:
  """The initialize arguments of `config.distributed`, or None for a single-process run; a bad
  combination raises ConfigError (one line)."""
  address = config.coordinator_address
  if not address:
    if config.num_processes > 1 or config.process_id >= 0:
      raise ConfigError("config.distributed.num_processes/process_id need "
                        "config.distributed.coordinator_address (host:port of process 0)")
    return None
  external = bool(config.get("external_coordinator", False))
  if address == AUTO:
    return Settings(None, None, None, config.heartbeat_timeout_s, external)
  if ":" not in address:
    raise ConfigError(f"config.distributed.coordinator_address={address!r}: host:port of "
                      f"process 0 (for example 127.0.0.1:12355), or {AUTO!r}")
  if config.num_processes < 1 or not 0 <= config.process_id < config.num_processes:
    raise ConfigError(
        f"config.distributed: process_id={config.process_id} must be in [0, num_processes="
        f"{config.num_processes}) when the coordinator address is given")
  return Settings(address, config.num_processes, config.process_id, config.heartbeat_timeout_s,
                  external)


def initialize(config: ml_collections.ConfigDict, recoverable: bool = False) -> bool:
  """Joins the distributed run `config` describes (before any backend use); False when the run
  is a single process. Idempotent. `recoverable` (gossip runs): JAX's runtime lets the other
  processes go on when one dies, and lets it join again (`jax_enable_recoverability`;
  docs/records/elastic.md), where by default every process is aborted."""
  chosen = settings(config)
  if chosen is None:
    return False
  if jax.distributed.is_initialized():
    return True
  if recoverable:
    jax.config.update("jax_enable_recoverability", True)
  membership.members.external_coordinator = chosen.external_coordinator
  join = (compat.initialize_without_service if chosen.external_coordinator
          else jax.distributed.initialize)
  kwargs = {}
  if not chosen.external_coordinator and chosen.coordinator_address is not None:  # not "auto"
    kwargs["coordinator_bind_address"] = bind_address(chosen.coordinator_address,
                                                      config.get("bind_host", ""))
    if chosen.process_id == 0:
      _check_port_free(kwargs["coordinator_bind_address"], chosen.coordinator_address)
  kwargs.update(tls_arguments(config))
  try:
    join(
        **kwargs,
        coordinator_address=chosen.coordinator_address,
        num_processes=chosen.num_processes,
        process_id=chosen.process_id,
        # JAX's own detection, later than `Watchdog`'s, so that ours names the process first,
        # and never under a minute: a process JAX's service finds silent is aborted (SIGABRT,
        # no message of ours), and on a loaded host its heartbeat thread can miss a few seconds.
        heartbeat_timeout_seconds=max(3 * chosen.heartbeat_timeout_s, 60),
    )
  except Exception as error:
    if "Failed to start RPC server" not in str(error):
      raise
    raise _port_in_use(chosen.coordinator_address) from None
  client = signed.client()
  if chosen.external_coordinator and compat.distributed_process_id() == 0 and membership.try_get(
      client, "layup_jax/alive/0") is not None:  # process 0 started again into its run
    compat.forget_global_topology(client)
  return True


_TLS_KEYS = ("tls_cert_file", "tls_key_file", "tls_ca_file")


def tls_arguments(config: ml_collections.ConfigDict) -> dict:
  """jax's mutual-TLS arguments for its coordination service from `config.distributed`'s
  `tls_*` files (none set: none, plain gRPC). All three are needed, each a readable file, and a
  jax that offers TLS there (0.12 does; 0.10 does not): else one line (ConfigError). With them
  a process refuses to fall back to insecure credentials (`verify_secure_credentials`)."""
  files = {key: config.get(key, "") for key in _TLS_KEYS}
  if not any(files.values()):
    return {}
  missing = [key for key, path in files.items() if not path]
  if missing:
    raise ConfigError(f"config.distributed.{missing[0]} is empty: TLS needs all of "
                      f"{', '.join('config.distributed.' + k for k in _TLS_KEYS)}")
  for key, path in files.items():
    if not os.access(os.path.expanduser(path), os.R_OK):
      raise ConfigError(f"config.distributed.{key}={path!r}: no readable file there")
  if "mtls_cert_file" not in inspect.signature(jax.distributed.initialize).parameters:
    raise ConfigError(f"config.distributed.tls_*: jax {jax.__version__} offers no TLS for its "
                      f"coordination service (jax 0.12 does, on Python >= 3.12); upgrade jax, or "
                      f"leave the tls_* files empty and keep the service on a trusted network")
  return {"mtls_cert_file": os.path.expanduser(files["tls_cert_file"]),
          "mtls_key_file": os.path.expanduser(files["tls_key_file"]),
          "mtls_ca_file": os.path.expanduser(files["tls_ca_file"]),
          "verify_secure_credentials": True}


_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def _port_in_use(coordinator_address: str) -> ConfigError:
  port = coordinator_address.rsplit(":", 1)[-1]
  return ConfigError(f"config.distributed.coordinator_address={coordinator_address!r}: the "
                     f"coordination service cannot listen on port {port} here (in use by "
                     f"another program or run?); choose a free port")


def _check_port_free(bind: str, coordinator_address: str) -> None:
  """Process 0's service port, bound and released: jaxlib's service, failing to bind one that
  is in use, crashes the process (SIGSEGV) when told an address to listen on."""
  host, port = bind.rsplit(":", 1)
  host = host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.bind((host if host != "::" else "::", int(port)))
  except OSError as error:
    if error.errno == errno.EADDRINUSE:
      raise _port_in_use(coordinator_address) from None


def bind_address(coordinator_address: str, bind_host: str = "") -> str:
  """`host:port` the coordination service in process 0 listens on: `bind_host` if set, else the
  coordinator address's own host when it is a loopback address (nothing outside this machine
  can reach the run's store), else every interface."""
  host, port = coordinator_address.rsplit(":", 1)
  if not bind_host:
    bind_host = host if host.startswith(_LOOPBACK) else "[::]"
  return f"{bind_host}:{port}"


def is_primary() -> bool:
  """Whether this process is the run's leader, which writes its records (metrics, summary,
  plots): process 0, or after its loss the lowest live process (`membership.Membership`)."""
  members = membership.members
  return jax.process_index() == members.leader and not members.rejoining


def local_positions(devices) -> list[int]:
  """Positions in `devices` of the devices this process drives."""
  me = jax.process_index()
  return [i for i, d in enumerate(devices) if d.process_index == me]


def local_block(devices) -> range:
  """Positions in `devices` of the devices this process drives, which must be consecutive (the
  asynchronous runtime's indices are offsets from the first)."""
  positions = local_positions(devices)
  block = range(positions[0], positions[0] + len(positions))
  if positions != list(block):
    raise ConfigError(f"this process's devices are not consecutive in the run: {positions}")
  return block


def check_supported(config: ml_collections.ConfigDict, gossip: bool) -> None:
  """Refuses, in one line, what a multi-process run cannot do yet, and distributed keys that a
  process not started through `initialize` would silently ignore. `gossip`: the algorithm
  sends stages to random peers with push-sum weights (its registry trait)."""
  if jax.process_count() == 1:
    if settings(config.distributed) is not None:
      raise ConfigError("config.distributed.coordinator_address is set, but this process did not "
                        "join a distributed run: start it with python -m layup_jax.train (or "
                        "call layup_jax.distributed.initialize before any JAX use)")
    return
  if config.num_devices != len(jax.devices()):
    raise ConfigError(f"config.num_devices={config.num_devices}: a multi-process run trains on "
                      f"every process's devices, {len(jax.devices())} here")
  if config.straggler.device >= 0:
    raise ConfigError("config.straggler.device: across processes a straggler is a whole "
                      "process (config.straggler.process)")
  if config.straggler.process >= jax.process_count():
    raise ConfigError(f"config.straggler.process={config.straggler.process}: the run has "
                      f"{jax.process_count()} processes")
  if gossip and config.layup.push_sum != "per_stage":
    raise ConfigError("config.layup.push_sum: across processes only per_stage push-sum runs "
                      "(a per-model weight would have to follow the last stage to the peer)")


def put(tree, sharding: jax.sharding.Sharding):
  """`jax.device_put(tree, sharding)` for a sharding that may span other processes' devices: every
  process passes the same host values (numpy, or arrays it can read) and places its own part.
  PRNG key arrays keep their type."""
  if sharding.is_fully_addressable:
    return jax.device_put(tree, sharding)

  def place(leaf):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(place(jax.random.key_data(leaf)),
                                      impl=jax.random.key_impl(leaf))
    value = np.asarray(leaf)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return jax.tree.map(place, tree)
