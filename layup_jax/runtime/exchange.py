"""What an algorithm on the asynchronous runtime decides: what happens to a device's stages.

The runtime (layup_jax/runtime/engine.py) runs, per device, a compute task (forward and backward)
and an updater task. For each iteration of device i the updater calls its algorithm's
`Exchange`:

  context = begin(i)                  when the iteration's first gradient arrives
  on_stage(i, context, s, grads, step) as each stage's gradient arrives (last stage first)
  end(i, context)                      after the last stage; the iteration is then done

and the compute task calls `before_iteration(i)` before each iteration (where an algorithm
makes a device wait for the others, at a period boundary). A hook that waits for something is a
task (a generator, `layup_jax.runtime.scheduler`): it yields what it waits for, so that the thread
running every device's tasks never blocks on one. An exchange writes replicas only through the
`ReplicaStore` and sends stages only through its devices' `Outbox`es; it holds no threads of
its own.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax

from layup_jax.runtime.options import RuntimeOptions
from layup_jax.runtime.replicas import ReplicaStore
from layup_jax.runtime.sends import Outbox, PeerSampler, Transport

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Links:
  """What an exchange works with: the replicas, each device's outbox, the peer sampler, the
  runtime's options, `stopped()`, true once the runtime stops (for waits at a period), the
  run's devices (every process's; the store holds this process's), and the transport to any
  peer's device, in this process or another (layup_jax/runtime/sends.py)."""

  store: ReplicaStore
  outboxes: list[Outbox]
  peers: PeerSampler
  options: RuntimeOptions
  stopped: Any
  run_devices: list
  transport: Transport


class ExchangeState(Protocol):
  """What an algorithm keeps beyond the replicas (the periodic baselines' anchor, outer state and
  averages), as the runtime settles, saves and restores it; `Exchange.state` is None without.

  `same_on_every_process`: the keys of `state_dict`'s arrays that every process holds the same
  at a checkpoint (a replicated average): across processes they are not gathered, and each
  process passes its own copy to `whole_run_state`.
  """

  same_on_every_process: tuple[str, ...]

  def settle(self) -> None:
    """Called at a consistent point (every task idle between iterations): finishes what a
    compute task would do before its next iteration, so the replicas are what they would be
    then whatever the timing (CO2's reset to the ready average)."""

  def state_dict(self) -> tuple[dict, dict]:
    """(device arrays, JSON-able metadata)."""

  def restore_template(self, meta: dict) -> dict: ...

  def load_state_dict(self, arrays: dict, meta: dict, saved_devices: int) -> None: ...

  def whole_run_state(self, parts: list[tuple[dict, dict, int]]) -> tuple[dict, dict]:
    """Across processes: the whole run's state from every process's `state_dict` (host
    copies) and its first device, in process order (one checkpoint holds all)."""

  def own_part(self, arrays: dict, meta: dict, first: int, count: int) -> tuple[dict, dict]:
    """`whole_run_state`'s inverse for the devices `first .. first + count - 1`."""


class Exchange(Protocol):
  """An algorithm on the asynchronous runtime: four hooks (module docstring), its traits, and
  an optional state object. `on_stage` returns the array whose readiness marks the stage's
  update as landed (the merged stage on the peer, or the local update), for the update-latency
  metric, or None when the stage is not timed.

  Traits (class attributes, `Hooks` has the defaults):

  `fuses_local_step`: the runtime applies each stage's local step itself, in the program of
  the stage's backward (`DeviceStages.backward`, layup_jax/runtime/replicas.py), and `on_stage` gets
  `grads=None`: the stage's params are then already updated (`ReplicaStore.local_step` returns
  them). An algorithm whose step must wait for something else (AD-PSGD averages first) leaves
  it False and applies the gradient in `on_stage`.

  `schedule_by_own_iteration`: the learning-rate schedule's step of an iteration is the
  device's own iteration count (the periodic baselines: every device takes the same local
  steps between averages, as each rank of their reference implementations counts its own),
  instead of the run's global step when the iteration starts (the gossip algorithms, where a
  fast device takes more iterations than a slow one and the schedule follows the samples seen).

  `equal_shares`: every device takes the same number of the run's iterations (the periodic
  baselines, as every rank of their reference implementations runs the same steps). Without
  it a fast device takes more, which gossip wants; under CO2's one-period lag it let a device
  run up to a period ahead, so an evaluation or checkpoint fell at iterations that differed
  between devices from run to run (a record's loss moved by 0.2 %), and across processes one
  process could start a period's all-reduce that another had not reached at a checkpoint.

  `sends_stages`: the exchange pushes stages to peers through the outboxes (push-sum sends:
  LayUp, GoSGD). Only such sends are compressed between processes (`distributed.compression`);
  the others (AD-PSGD's pairwise averages, the periodic baselines' all-reduces) travel as they
  are, so a run of theirs builds no compressor.
  """

  fuses_local_step: bool
  sends_stages: bool
  schedule_by_own_iteration: bool
  equal_shares: bool
  state: ExchangeState | None

  def begin(self, i: int) -> Any: ...

  def on_stage(self, i: int, context: Any, s: int, grads: PyTree,
               step: jax.Array) -> PyTree | None: ...

  def end(self, i: int, context: Any) -> None: ...

  # Called by compute task i before it takes an iteration: None, or a task that waits (for
  # the other devices, at a boundary). An exchange that never waits leaves it None.
  before_iteration: Callable[[int], Any] | None

  def compile(self) -> None:
    """Compiles the exchange's own functions (beyond the store's), on every device."""


class Hooks:
  """The defaults every exchange starts from (one level, no chain): no waiting before an
  iteration, nothing at `begin` and `end`, each stage's local update only, no state beyond the
  replicas. Fused local steps by default: an exchange whose update must wait says so."""

  fuses_local_step = True
  sends_stages = False
  schedule_by_own_iteration = False
  equal_shares = False
  state: ExchangeState | None = None

  def __init__(self, links: Links):
    self.links, self.store, self.peers = links, links.store, links.peers

  def begin(self, i: int) -> Any:
    return None

  def on_stage(self, i: int, context: Any, s: int, grads: PyTree | None,
               step: jax.Array) -> PyTree | None:
    self.store.local_step(i, s, grads, step)
    return None

  def end(self, i: int, context: Any) -> Any:
    return None

  before_iteration = None

  def compile(self) -> None:
    pass

