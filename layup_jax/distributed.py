"""Several processes (hosts, or GPUs of one host) as one run, on JAX's own distributed runtime.

`initialize(config.distributed)` calls `jax.distributed.initialize` with the config's keys; it
must run before anything touches a JAX backend (`jax.devices()`, a `device_put`, a jit), so the
command line calls it first. After it, `jax.devices()` lists every process's devices, ordered by
process (process 0's first), and `config.num_devices` counts them all.

A run's devices are `jax.devices()[:num_devices]`; a device's *position* in that list is its
global index (device ids are not positions: on CPU, process 1's ids start at 2048). Each process
feeds only its own devices (`local_positions`), and only process 0 writes records
(`is_primary`). Checkpoints are one Orbax checkpoint of the whole run, written by every process
together into the workdir, which must be on a filesystem every process sees; a stop request
(SIGTERM, Ctrl-C) takes effect at the next evaluation or checkpoint, where the processes agree
on it. Every algorithm runs across processes: DDP; LayUp, GoSGD and AD-PSGD, their sends and
pairwise averages with other processes' devices through layup_jax/crossprocess.py; the periodic
baselines, their average an all-reduce over every process's devices (layup_jax/collectives.py).
In the gossip and periodic algorithms' checkpoints each process writes its own devices'
replicas (rows of arrays sharded over the run's devices, `checkpointing.DeviceRows`) and
process 0 the state every process holds the same, with the metadata gathered from all
(layup_jax/runtime_state.py).
"""

import contextlib
import dataclasses
import json
import os
import pickle
import sys
import threading
import time

import jax
import ml_collections
import numpy as np

from layup_jax import compat
from layup_jax.errors import ConfigError, RejoinError

AUTO = "auto"  # distributed.coordinator_address: JAX's cluster auto-detection (SLURM, ...)


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `jax.distributed.initialize` is given; `None` fields are left to JAX to detect."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  heartbeat_timeout_s: int


def settings(config: ml_collections.ConfigDict) -> Settings | None:
  """The initialize arguments of `config.distributed`, or None for a single-process run; a bad
  combination raises ConfigError (one line)."""
  address = config.coordinator_address
  if not address:
    if config.num_processes > 1 or config.process_id >= 0:
      raise ConfigError("config.distributed.num_processes/process_id need "
                        "config.distributed.coordinator_address (host:port of process 0)")
    return None
  if address == AUTO:
    return Settings(None, None, None, config.heartbeat_timeout_s)
  if ":" not in address:
    raise ConfigError(f"config.distributed.coordinator_address={address!r}: host:port of "
                      f"process 0 (for example 127.0.0.1:12355), or {AUTO!r}")
  if config.num_processes < 1 or not 0 <= config.process_id < config.num_processes:
    raise ConfigError(
        f"config.distributed: process_id={config.process_id} must be in [0, num_processes="
        f"{config.num_processes}) when the coordinator address is given")
  return Settings(address, config.num_processes, config.process_id, config.heartbeat_timeout_s)


def initialize(config: ml_collections.ConfigDict, recoverable: bool = False) -> bool:
  """Joins the distributed run `config` describes (before any backend use); False when the run
  is a single process. Idempotent. `recoverable` (gossip runs): JAX's runtime lets the other
  processes go on when one dies, and lets it join again (`jax_enable_recoverability`;
  docs/elastic.md), where by default every process is aborted."""
  chosen = settings(config)
  if chosen is None:
    return False
  if jax.distributed.is_initialized():
    return True
  if recoverable:
    jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(
      coordinator_address=chosen.coordinator_address,
      num_processes=chosen.num_processes,
      process_id=chosen.process_id,
      # JAX's own detection, later than `Watchdog`'s, so that ours names the process first, and
      # never under a minute: a process JAX's service finds silent is aborted (SIGABRT, no
      # message of ours), and on a loaded host its heartbeat thread can miss a few seconds.
      heartbeat_timeout_seconds=max(3 * chosen.heartbeat_timeout_s, 60),
  )
  return True


def is_primary() -> bool:
  """Whether this process writes the run's records (metrics, summary, plots): process 0."""
  return jax.process_index() == 0


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
    raise ConfigError("config.straggler.device: no straggler injection across processes yet")
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


# How long a gather waits for another process's value when no watchdog guards the run. Under a
# watchdog a gather waits as long as the writer lives (the watchdog ends or fences off a silent
# one): a loaded host's compilation before the first gather can take minutes longer on one
# process than on another (found: a two-process test failed at a fixed 2-minute wait).
GATHER_TIMEOUT_S = 120.0
_GATHER_POLL_MS = 2000
_pickled_keys: list[str] = []  # this process's keys of its recent `all_gather_pickled` calls


class GatherOrder:
  """Every process gathers in the same order, so the n-th gather of one process meets the
  others' n-th under one key directory. A restarted process takes the live processes' `next`
  from its admission (gathers run on the main thread)."""

  def __init__(self):
    self.next = 0

  def prefix(self) -> str:
    """The key directory of this process's next gather."""
    self.next += 1
    return f"layup_jax/gather/{self.next - 1}"


gather_order = GatherOrder()


class Membership:
  """Which processes of the run are lost (an elastic gossip run goes on without them), and
  which of them rejoin.

  Process 0, which hosts the coordination service, is the one authority: its watchdog declares
  a silent process lost (`declare`, a key `layup_jax/lost/<k>` holding the step), every
  process's watchdog reads those keys (`refresh`) and calls its listeners once per lost
  process. A gather between processes then takes the live ones only, with process 0 naming
  each gather's members, so that every survivor reads the same set even when a process dies
  mid-gather.

  A lost process started again with its id (`rejoining`) asks to rejoin (`await_admission`);
  at the run's next consistent point process 0 admits it (`joining`, `clear`, `admit`: the
  step and the gather it joins at), and every live process calls its listeners' `on_rejoined`
  (`rejoined`)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.elastic = False  # set by the watchdog of a gossip run across processes
    self.watched = False  # a watchdog guards the run's processes (set while it runs)
    self.lost: dict[int, int] = {}  # process -> the step at which it was declared lost
    self._listeners: list = []
    self._rejoin_listeners: list = []
    self.step = 0  # the run's step as this process last saw it (the runner's progress)
    # How long a thread that lost contact with a process waits for it to be declared lost
    # before it fails (set by the watchdog of an elastic run).
    self.grace_s = 0.0
    # This process was started again after being declared lost, and is not admitted yet.
    self.rejoining = False

  def await_loss(self, process: int) -> bool:
    """Whether `process` is declared lost within `grace_s` (a pull from it just failed)."""
    deadline = time.monotonic() + self.grace_s
    while not self.is_lost(process) and time.monotonic() < deadline:
      time.sleep(0.1)
    return self.is_lost(process)

  def listen(self, on_lost, on_rejoined=None) -> None:
    """Calls `on_lost(process, step)` for each process found lost from now on (and those
    already found), and `on_rejoined(process)` for each admitted back."""
    with self._lock:
      self._listeners.append(on_lost)
      if on_rejoined is not None:
        self._rejoin_listeners.append(on_rejoined)
      known = dict(self.lost)
    for process, step in known.items():
      on_lost(process, step)

  def live(self) -> list[int]:
    with self._lock:
      return [k for k in range(jax.process_count()) if k not in self.lost]

  def is_lost(self, process: int) -> bool:
    with self._lock:
      return process in self.lost

  def declare(self, client, process: int, step: int) -> None:
    """Process 0: `process` is lost at `step` (then every process learns it by `refresh`)."""
    client.key_value_set(f"layup_jax/lost/{process}", str(step), allow_overwrite=True)
    self.refresh(client)

  def refresh(self, client) -> list[tuple[int, int]]:
    """Reads the lost keys; calls the listeners for each process newly found lost. The read
    is under the lock: a process admitted meanwhile (its key cleared first, `clear`) is never
    found lost again from a read made before."""
    with self._lock:
      found = [(int(key.rsplit("/", 1)[1]), int(value))
               for key, value in client.key_value_dir_get("layup_jax/lost/")]
      new = [(k, step) for k, step in found if k not in self.lost]
      self.lost.update(new)
      listeners = list(self._listeners)
    for process, step in new:
      for on_lost in listeners:
        on_lost(process, step)
    return new

  # --- rejoining ------------------------------------------------------------------------------

  def joining(self) -> list[int]:
    """Process 0, at a consistent point: the lost process that asked to rejoin first, if any
    (one per consistent point)."""
    client = compat.coordination_client()
    asked = sorted(int(key.rsplit("/", 1)[1])
                   for key, _ in client.key_value_dir_get("layup_jax/join/"))
    return [k for k in asked if self.is_lost(k)][:1]

  @staticmethod
  def clear(process: int) -> None:
    """Process 0, before telling the others: `process` is no longer declared lost."""
    client = compat.coordination_client()
    for kind in ("lost", "join", "joining"):
      client.key_value_delete(f"layup_jax/{kind}/{process}")

  def admit(self, process: int, step: int) -> None:
    """Process 0, right after the gather that told every live process: `process` joins at
    `step`, its next gather being the live processes' next."""
    with self._lock:
      lost = [[k, s] for k, s in self.lost.items() if k != process]
    admission = {"step": step, "gather": gather_order.next, "lost": lost}
    compat.coordination_client().key_value_set(f"layup_jax/admit/{process}",
                                               json.dumps(admission), allow_overwrite=True)

  def rejoined(self, process: int) -> None:
    """Every live process: `process` is admitted back (its listeners' `on_rejoined`)."""
    with self._lock:
      self.lost.pop(process, None)
      listeners = list(self._rejoin_listeners)
    for on_rejoined in listeners:
      on_rejoined(process)

  def await_admission(self) -> dict:
    """The restarted process: asks to rejoin and waits until process 0 admits it at a
    consistent point; then gathers with the others. Returns the admission (`step`, and the
    processes still `lost`); raises if the run ends first."""
    me, client = jax.process_index(), compat.coordination_client()
    client.key_value_set(f"layup_jax/join/{me}", "1", allow_overwrite=True)
    print(f"process {me} is ready and asks to rejoin at the run's next evaluation or "
          f"checkpoint step", file=sys.stderr, flush=True)
    while True:
      try:
        admission = json.loads(client.blocking_key_value_get(f"layup_jax/admit/{me}", 1000))
        break
      except Exception as error:  # DEADLINE_EXCEEDED: not admitted yet
        if "DEADLINE_EXCEEDED" not in str(error):
          raise
        if run_finished():
          raise RejoinError(f"process {me} was not admitted back: the run ended first")
    client.key_value_delete(f"layup_jax/admit/{me}")
    gather_order.next = admission["gather"]
    with self._lock:
      self.lost = {k: step for k, step in admission["lost"]}
      self.rejoining = False
    return admission


members = Membership()


def try_get(client, key: str) -> str | None:
  """The store's value of `key`, or None while it is not written (anything else is raised)."""
  try:
    return client.key_value_try_get(key)
  except Exception as error:  # NOT_FOUND: not written yet
    if "NOT_FOUND" in str(error):
      return None
    raise


def run_finished() -> bool:
  """Whether process 0 has said it is done (`Watchdog.finish`)."""
  return try_get(compat.coordination_client(), "layup_jax/done/0") is not None


def await_value(client, key: str, writer: int) -> bytes:
  """The store's value of `key`, which process `writer` writes, waiting as long as the writer
  may still write it: while a watchdog guards the run (`members.watched`), until the writer says
  it is done (it ended, or failed on its own, without writing it) or is declared lost; without
  one, at most `GATHER_TIMEOUT_S`."""
  deadline = None if members.watched else time.monotonic() + GATHER_TIMEOUT_S
  while True:
    try:
      return client.blocking_key_value_get_bytes(key, _GATHER_POLL_MS)
    except Exception as error:  # DEADLINE_EXCEEDED: not yet written
      if "DEADLINE_EXCEEDED" not in str(error):
        raise
    if members.is_lost(writer):
      raise ProcessLostError(writer)
    if try_get(client, f"layup_jax/done/{writer}") is not None:
      raise RuntimeError(f"process {writer} ended without writing {key} (see its own output)")
    if deadline is not None and time.monotonic() > deadline:
      raise TimeoutError(f"process {writer} did not write {key} within {GATHER_TIMEOUT_S:g} s")


class ProcessLostError(RuntimeError):
  """A wait (a gather, a pull) on a process that was declared lost meanwhile."""

  def __init__(self, process: int):
    super().__init__(f"process {process} was declared lost")
    self.process = process


def _read_gather(client, prefix: str, mine: bytes) -> list[bytes]:
  """The values gather `prefix` holds, in process order: every process's, or in an elastic run
  those of the processes process 0 names (every live process that wrote its value; one lost
  before writing it is left out), so that every survivor reads the same set. This process's
  own is `mine`, not read back: on another host than the store's, it would cross the link
  again (an evaluation's model)."""
  me = jax.process_index()
  read = lambda k: mine if k == me else await_value(client, f"{prefix}/{k}", k)
  if not members.elastic:
    return [read(k) for k in range(jax.process_count())]
  if me != 0:
    names = json.loads(await_value(client, f"{prefix}/members", 0).decode())
    return [read(k) for k in names]
  values: dict[int, bytes] = {}
  for k in range(jax.process_count()):
    if members.is_lost(k):
      continue
    with contextlib.suppress(ProcessLostError):  # lost before writing it: left out
      values[k] = read(k)
  client.key_value_set(f"{prefix}/members", json.dumps(sorted(values)))
  return [values[k] for k in sorted(values)]


def all_gather_json(value) -> list:
  """Every process's `value` (JSON-serializable), in process order, through the coordination
  service's key-value store (no device collective); every process must call it, in the same
  order. In an elastic run, the live processes' values only (`members`)."""
  if jax.process_count() == 1:
    return [value]
  client = compat.coordination_client()
  prefix = gather_order.prefix()
  mine = json.dumps(value).encode()
  client.key_value_set_bytes(f"{prefix}/{jax.process_index()}", mine)
  return [json.loads(part) for part in _read_gather(client, prefix, mine)]


def all_gather_pickled(value) -> list:
  """`all_gather_json` for any picklable value (host arrays: a run's replicas at an
  evaluation), as bytes through the same store; the processes of one run trust each other."""
  if jax.process_count() == 1:
    return [value]
  client = compat.coordination_client()
  prefix = gather_order.prefix()
  mine, pickled = f"{prefix}/{jax.process_index()}", pickle.dumps(value)
  client.key_value_set_bytes(mine, pickled)
  parts = [pickle.loads(part) for part in _read_gather(client, prefix, pickled)]
  # Our key of two gathers ago has been read by all: each process wrote its key of the last
  # gather only after reading every key of the one before, and we have read those.
  _pickled_keys.append(mine)
  if len(_pickled_keys) > 2:
    client.key_value_delete(_pickled_keys.pop(0))
  return parts


def data_states(iterators, devices, processes=None) -> list:
  """Every device's train-iterator state, in device order, each read by the process that feeds
  the device (the others' copies of an iterator never advance); with `processes` (an elastic
  run's checkpoint after a loss), their devices' only."""
  mine = {str(i): iterators[i].get_state() for i in local_positions(devices)}
  merged = {}
  for part in all_gather_json(mine):
    merged.update(part)
  return [merged[str(i)] for i, device in enumerate(devices)
          if processes is None or device.process_index in processes]


_FAREWELL_S = 120.0  # how long process 0 of an elastic run waits for the others at the end
_FAREWELL_GRACE_S = 1.0  # and then, for their last word to the service


class Watchdog:
  """Ends this process with one line when another process of the run stops answering, or, in
  an elastic run (gossip), has process 0 declare it lost and trains on without it.

  Each process's watchdog thread writes a counter to the coordination service's key-value
  store every second and reads the others'. A process whose counter has not moved for
  `timeout_s` (it died, or lost the coordinator; one waiting in a collective still answers,
  the watchdog being a thread of its own) is named, and this process exits with status 4 at
  once: a collective with a dead peer would otherwise wait, and JAX's own heartbeat, set
  longer, would abort the process without saying which one. A process that finished says so
  and is not waited for. Losing the coordinator (process 0) is reported the same way.

  `elastic`: a silent process other than 0 is not fatal: process 0 declares it lost
  (`Membership`) and says so in one line; every process reads the declarations each period.
  """

  EXIT_STATUS = 4

  def __init__(self, timeout_s: float, period_s: float = 1.0, elastic: bool = False):
    self._client = compat.coordination_client()
    self._me, self._count = jax.process_index(), jax.process_count()
    self._timeout_s, self._period_s = timeout_s, period_s
    self._elastic = members.elastic = elastic
    members.watched = True
    if elastic:  # a never-seen process is given 3x the timeout, then process 0 declares it
      members.grace_s = 3 * timeout_s + 2 * period_s
    if elastic and self._me == 0:
      print("elastic gossip: a lost process other than 0 is left behind and the others train "
            "on (the same command started again for it rejoins); process 0 hosts the run's "
            "coordination service, so its loss stops every process (rerun to resume from the "
            "last checkpoint)", file=sys.stderr, flush=True)
    if elastic and self._me != 0 and self._exists(self._key("alive", self._me)):
      self._await_declared_lost()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
    self._thread.start()

  def _key(self, kind: str, k: int) -> str:
    return f"layup_jax/{kind}/{k}"

  def _await_declared_lost(self) -> None:
    """This process was started again into a running run (its earlier self's heartbeat is in
    the store): it stays silent until process 0 has declared that one lost, then rejoins
    (`Membership.await_admission`, from the runtime)."""
    print(f"process {self._me} started again into its running run: it rejoins once process 0 "
          f"has declared its earlier run lost (within {3 * self._timeout_s:g} s)",
          file=sys.stderr, flush=True)
    # Process 0 waits for a process that is rejoining before it ends the run (`finish`).
    self._client.key_value_set(self._key("joining", self._me), "1", allow_overwrite=True)
    while self._value(self._key("lost", self._me)) is None:
      if run_finished():
        self._leave_unadmitted()
      time.sleep(self._period_s / 2)
    members.rejoining = True


  def _watch(self) -> None:
    beat = 0
    seen = {k: (None, time.monotonic()) for k in range(self._count)}  # counter, when it moved
    while not self._stop.wait(self._period_s):
      now = time.monotonic()
      try:
        beat += 1
        self._client.key_value_set(self._key("alive", self._me), str(beat), allow_overwrite=True)
        if self._elastic:
          members.refresh(self._client)
          if members.rejoining and run_finished():
            self._leave_unadmitted()
          if members.is_lost(self._me) and not members.rejoining:  # silent too long: fenced off
            self._die(f"process 0 declared this process lost at step {members.lost[self._me]} "
                      f"(silent for more than {self._timeout_s:g} s)",
                      "The others train on without it")
        for k in range(self._count):
          if members.is_lost(k):  # and if it rejoins, its heartbeat is timed afresh
            seen[k] = (None, now)
            continue
          if k == self._me or self._exists(self._key("done", k)):
            continue
          value = self._value(self._key("alive", k))
          if value is not None and value != seen[k][0]:
            seen[k] = (value, now)
          # A process not seen yet may still be starting (a loaded host): 3x the time.
          limit = self._timeout_s * (1 if seen[k][0] is not None else 3)
          if now - seen[k][1] > limit:
            self._silent(k)
      except Exception as error:  # noqa: BLE001 - the coordination service itself is gone
        if self._stop.is_set():
          return
        self._die(f"lost the run's coordinator, process 0 ({type(error).__name__}: "
                  f"{(str(error).splitlines() or [''])[0][:160]})")

  def _silent(self, k: int) -> None:
    """Process k has not answered for `timeout_s`."""
    if not self._elastic or k == 0:
      self._die(f"process {k} of the run stopped answering for {self._timeout_s:g} s "
                f"(it died, or lost the coordinator)")
    if self._me != 0:
      return  # process 0 decides (and says so); its own silence is fatal here
    step = members.step
    members.declare(self._client, k, step)
    live = set(members.live())
    devices = sum(1 for d in jax.devices() if d.process_index in live)
    print(f"process {k} lost at step {step}; {devices} devices train on", file=sys.stderr,
          flush=True)

  def _leave_unadmitted(self) -> None:
    """A process that was rejoining finds the run ended: it says so and lets process 0 go."""
    self._client.key_value_set(self._key("done", self._me), "1", allow_overwrite=True)
    self._die("the run ended before this process could rejoin it", "Nothing to do")

  def _value(self, key: str) -> str | None:
    return try_get(self._client, key)

  def _exists(self, key: str) -> bool:
    return self._value(key) is not None

  def _die(self, why: str, then: str = "Rerun the same command on every process to resume "
                                        "from the last checkpoint") -> None:
    print(f"error: {why}; process {self._me} stops. {then}", file=sys.stderr, flush=True)
    os._exit(self.EXIT_STATUS)

  def finish(self) -> None:
    """This process is done (or failed on its own): the others stop waiting for it.

    In an elastic run JAX keeps no shutdown barrier (recoverability), so process 0, which
    hosts the coordination service, would leave while another process still uses it, and
    that one's client aborts it (found: the last process of a finished run ended by SIGABRT).
    So the others leave JAX's runtime right after saying they are done, and process 0 waits
    for every live or rejoining process's word (at most `_FAREWELL_S`) and a moment more."""
    self._stop.set()
    self._thread.join(timeout=5)
    members.watched = False
    with contextlib.suppress(Exception):  # the service may be gone already: nothing to tell
      self._client.key_value_set(self._key("done", self._me), "1", allow_overwrite=True)
    if not self._elastic:
      return
    if self._me != 0:
      with contextlib.suppress(Exception):
        jax.distributed.shutdown()
      return
    deadline = time.monotonic() + _FAREWELL_S
    with contextlib.suppress(Exception):
      while time.monotonic() < deadline and not all(
          self._exists(self._key("done", k))
          or members.is_lost(k) and not self._exists(self._key("joining", k))
          for k in range(self._count)):
        members.refresh(self._client)
        time.sleep(0.1)
    time.sleep(_FAREWELL_GRACE_S)
