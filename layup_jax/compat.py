"""What the project takes from jax beyond its public API, in one place, for every jax it supports.

Tested: jax 0.10.2 on Python 3.11 (the newest jax for it), jax 0.11.2 on Python 3.12 (the GPU
image) and jax 0.12.0.1 on Python 3.13 (the newest the registry serves). Everything here works on
all three; where a jax lacks an internal, the caller gets a public fallback or one clear error,
never an AttributeError from deep inside a run.

- The batched copy of a stage onto one device (`transfer.py`): jax's own runtime calls below
  `jax.device_put`, about 4x cheaper per stage. `BATCHED_COPY` is None where they are missing;
  `transfer.implementation` also checks once that they give what `jax.device_put` gives.
- The coordination service's client and the coordinator's address (`distributed.py`,
  `crossprocess.py`): jax has no public handle to either.
- The transfer server between processes (`crossprocess.py`): `jax.experimental.transfer`.
- Orbax's barrier between processes (`checkpointing.py`): a flag of Orbax's.
"""

import types

import jax

try:
  from jax._src import core as _core
  from jax._src.interpreters.pxla import batched_device_put as _batched_device_put
  from jax._src.lib import xla_client as _xc

  BATCHED_COPY: types.SimpleNamespace | None = types.SimpleNamespace(
      copy_arrays=_xc.batched_copy_array_to_devices_with_sharding,  # device arrays, one call
      put_host_array=_batched_device_put,  # a host array onto a device
      shaped_array=_core.ShapedArray,
      reuse_input=_xc.ArrayCopySemantics.REUSE_INPUT)
except (ImportError, AttributeError):  # a jax without them: `jax.device_put`
  BATCHED_COPY = None


def device_list(sharding: jax.sharding.Sharding):
  """The runtime's device list of a sharding, as the batched copy takes it."""
  return sharding._internal_device_list


def _distributed_state():
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state


def coordination_client():
  """The coordination service's client of this process (set by `jax.distributed.initialize`)."""
  return _distributed_state().client


def coordinator_address() -> str | None:
  """`host:port` of the coordinator this process joined, None outside a multi-process run."""
  return _distributed_state().coordinator_address


def start_transfer_server(client, address: str, transport_addresses: list[str]):
  """A transfer server (`jax.experimental.transfer`) for arrays pulled by other processes."""
  from jax.experimental import transfer

  return transfer.start_transfer_server(client, address, transport_addresses)


def use_orbax_coordination_barrier() -> None:
  """Orbax synchronizes processes through the coordination service (no device collective)."""
  from absl import flags

  flags.FLAGS.experimental_orbax_use_distributed_barrier = True
