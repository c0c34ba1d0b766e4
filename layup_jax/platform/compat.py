"""What the project takes from jax beyond its public API, in one place, for every jax it supports.

Tested: jax 0.10.2 on Python 3.11 (the newest jax for it), jax 0.11.2 on Python 3.12 (the GPU
image) and jax 0.12.0.1 on Python 3.13 (the newest the registry serves). Everything here works on
all three; where a jax lacks an internal, the caller gets a public fallback or one clear error,
never an AttributeError from deep inside a run.

- The batched copy of a stage onto one device (`transfer.py`): jax's own runtime calls below
  `jax.device_put`, about 4x cheaper per stage. `BATCHED_COPY` is None where they are missing;
  `transfer.implementation` also checks once that they give what `jax.device_put` gives.
- The coordination service's client and the coordinator's address (`multiprocess/`): jax has
  no public handle to either.
- The coordination service in a process of its own (`multiprocess/coordinator.py`), and
  `jax.distributed.initialize` joining it as a client from process 0 too
  (`initialize_without_service`): jax starts the service inside process 0, with no option
  against it. `EXTERNAL_COORDINATOR` says whether this jax allows it (tests/test_compat.py
  fails when a jax moves what it needs).
- The transfer server between processes (`crossprocess.py`): `jax.experimental.transfer`.
- Orbax's barrier between processes (`checkpointing.py`): a flag of Orbax's.
- The persistent compilation cache's key for a program on one device (`compile_cache.py`):
  jax strips the device from it on GPU only; and its writes from a process other than 0 on CPU
  devices: jax's compiler writes from process 0 only.
"""

import inspect
import threading
import types
import warnings

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


def distributed_process_id() -> int:
  """This process's id in its distributed run, known before any backend starts (asking
  `jax.process_index()` would start one)."""
  return _distributed_state().process_id


def coordinator_address() -> str | None:
  """`host:port` of the coordinator this process joined, None outside a multi-process run."""
  return _distributed_state().coordinator_address


def _external_coordinator_supported() -> bool:
  """Whether `jax.distributed.initialize` starts process 0's service through
  `_jax.get_distributed_runtime_service`, looked up when it runs (so that it can be bypassed),
  and that function exists."""
  try:
    from jax._src import distributed as jax_distributed

    return (callable(jax_distributed._jax.get_distributed_runtime_service)
            and "_jax.get_distributed_runtime_service(" in inspect.getsource(
                jax_distributed.State.initialize))
  except (ImportError, AttributeError, OSError, TypeError):
    return False


EXTERNAL_COORDINATOR = _external_coordinator_supported()


def start_coordination_service(bind_address: str, num_processes: int, heartbeat_timeout_s: int,
                               shutdown_timeout_s: int = 300, tls: dict | None = None):
  """jax's coordination service (key-value store, barriers, liveness) in this process, which
  needs no devices; recoverable, so that a lost client is let go and a restarted one let in.
  `tls`: jax's mutual-TLS arguments (`multiprocess.setup.tls_arguments`)."""
  from jax._src.lib import _jax

  return _jax.get_distributed_runtime_service(
      bind_address, num_processes, heartbeat_timeout=heartbeat_timeout_s,
      shutdown_timeout=shutdown_timeout_s, recoverable=True, **(tls or {}))


class _WithoutService:
  """jaxlib's module as `jax.distributed.initialize` sees it, less the service it would start
  in process 0."""

  def __init__(self, module):
    self._module = module

  def __getattr__(self, name):
    return getattr(self._module, name)

  @staticmethod
  def get_distributed_runtime_service(*args, **kwargs):
    return None


def initialize_without_service(**kwargs) -> None:
  """`jax.distributed.initialize(**kwargs)` as a client only, also in process 0: the service
  runs elsewhere (`start_coordination_service`, another process). When the client finds the
  service gone, jax ends the process at once in its own words ("Terminating process because
  the JAX distributed service detected fatal errors"): a callback of ours cannot take its
  place (jaxlib 0.10 and 0.12 fail to pass it the status: `std::bad_cast`)."""
  if not EXTERNAL_COORDINATOR:
    raise RuntimeError(f"jax {jax.__version__} gives no way to join a coordination service "
                       f"of its own process (layup_jax/platform/compat.py); run without "
                       f"config.distributed.external_coordinator")
  from jax._src import distributed as jax_distributed

  real = jax_distributed._jax
  jax_distributed._jax = _WithoutService(real)
  try:
    jax.distributed.initialize(**kwargs)
  finally:
    jax_distributed._jax = real


def forget_global_topology(client) -> None:
  """Deletes the devices' global topology process 0 published when the run's backends started
  (xla's `ExchangeTopologies` keys it `<platform>:global_topology/<platform>`), so that a
  process 0 started again builds it afresh: it sets the key without overwrite, and found it
  there (`ALREADY_EXISTS`). The other processes read it only when their backend starts."""
  for platform in ("cpu", "cuda", "rocm", "tpu"):
    client.key_value_delete(f"{platform}:global_topology")


def start_transfer_server(client, address: str, transport_addresses: list[str]):
  """A transfer server (`jax.experimental.transfer`) for arrays pulled by other processes."""
  from jax.experimental import transfer

  return transfer.start_transfer_server(client, address, transport_addresses)


def use_orbax_coordination_barrier() -> None:
  """Orbax synchronizes processes through the coordination service (no device collective)."""
  from absl import flags

  flags.FLAGS.experimental_orbax_use_distributed_barrier = True


_OWN_DEVICES = threading.local()  # whether the program compiling on this thread is this process's


def write_compilation_cache_from_every_process() -> None:
  """Lets a process other than 0 write the programs of its own CPU devices to the persistent
  compilation cache, so that its next run (or a restarted process) reads them.

  jax writes entries from process 0 only, so that processes do not contend for one entry
  (`jax/_src/compiler.py`, `_cache_write`); its keys hold a program's devices on CPU
  (`cache_key.py` strips them on GPU only), so a process other than 0 never finds its
  programs there and compiles each of them afresh in every run. A program on this process's
  devices alone has a key no other process computes, so the process writes it itself; a
  program across processes (DDP's all-reduce), a program with host callbacks, a program on a
  GPU and everything in process 0 keep jax's own path. Idempotent.
  """
  from jax._src import compilation_cache, compiler

  if getattr(compiler._cache_write, "every_process", False):
    return
  jax_compile, jax_write = compiler.compile_or_get_cached, compiler._cache_write

  def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
    own = getattr(_OWN_DEVICES, "value", False)
    _OWN_DEVICES.value = all(device.process_index == backend.process_index()
                             for device in devices.flat)
    try:
      return jax_compile(backend, computation, devices, *args, **kwargs)
    finally:
      _OWN_DEVICES.value = own

  def cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                  *host_callbacks):
    if (_distributed_state().process_id == 0 or backend.platform != "cpu"
        or not getattr(_OWN_DEVICES, "value", False) or any(host_callbacks)):
      return jax_write(cache_key, compile_time_secs, module_name, backend, executable,
                       *host_callbacks)
    if compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
      return None
    try:
      compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                int(compile_time_secs))
    except Exception as error:  # as jax's own write: a failed write only warns
      warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                    f"{type(error).__name__}: {error}")
    return None

  cache_write.every_process, cache_write.jax_write = True, jax_write
  compiler.compile_or_get_cached, compiler._cache_write = compile_or_get_cached, cache_write


def key_single_device_programs_without_their_device() -> None:
  """Keys a program on one device by everything but which device, so that a stage's program
  compiled for device 0 is read, not compiled again, for the process's other devices.

  A run compiles each per-stage program once per device. jax keys the persistent compilation
  cache by the compile options, the device assignment among them, and strips the assignment
  on GPU only (`cache_key.py`), so on CPU devices each device's copy is its own entry, compiled
  afresh. A 1 x 1 assignment says nothing else about the program: the executable read from the
  cache is loaded for the device being compiled for (`deserialize_executable` takes the
  caller's compile options), as on GPU. Programs on several devices keep their keys (which
  devices a collective spans is part of it). The key still differs between processes (jax
  hashes the process's devices as the accelerator config), so a process never reads a program
  compiled on another host, whose CPU may differ: each process writes its own
  (`write_compilation_cache_from_every_process`). Idempotent.
  """
  from jax._src import cache_key

  if getattr(cache_key._hash_serialized_compile_options, "strips_one_device", False):
    return
  jax_hash = cache_key._hash_serialized_compile_options

  def hash_compile_options(hash_obj, compile_options_obj, strip_device_assignment=False):
    assignment = compile_options_obj.device_assignment
    if assignment is not None and assignment.replica_count() * assignment.computation_count() == 1:
      strip_device_assignment = True
    return jax_hash(hash_obj, compile_options_obj, strip_device_assignment)

  hash_compile_options.strips_one_device, hash_compile_options.jax_hash = True, jax_hash
  cache_key._hash_serialized_compile_options = hash_compile_options
