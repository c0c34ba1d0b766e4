"""Elastic gossip across processes (docs/guide/elastic.md): what the asynchronous runtime does when a
process of its run is lost, or started again and rejoins.

A lost process's devices stop being peers at once (`on_lost`, from the heartbeat watchdog's
thread); at each consistent point the survivors renormalise every stage's push-sum weights over
themselves (`at_consistent_point`) and admit one restarted process that asked to rejoin; the
restarted process's side of that is `rejoin`. The runtime's iteration never branches on any of
this: peers, transport and weights are changed underneath it.
"""

import time
from fractions import Fraction

import jax

from layup_jax.errors import RejoinError
from layup_jax.multiprocess import gathers, membership


class Elastic:
  """One `AsyncRuntime`'s membership of an elastic run across processes."""

  def __init__(self, runtime):
    self.rt = runtime
    # Set at the first consistent point that finds a process lost (every survivor finds it at
    # the same one): the run trains on without it.
    self.processes_lost = False
    # A process that rejoined its run writes no checkpoint rows: the coordination service's
    # barriers, which Orbax's saves use, did not complete with a restarted process.
    self.saves_checkpoints = True
    # Iterations each device counts as done without having run them (it rejoined at a step).
    self.joined_at = [0] * runtime.num_devices

  def listen(self) -> None:
    membership.members.listen(self.on_lost, self.on_rejoined)

  def devices_of(self, processes) -> list[int]:
    """Positions in the run of the devices that `processes` drive."""
    return [g for g, device in enumerate(self.rt.run_devices)
            if device.process_index in processes]

  def on_lost(self, process: int, step: int) -> None:
    """Process `process` is lost (its watchdog thread says so): nothing goes to its devices or
    waits for them from now on. A process started again and not admitted yet takes no notice:
    its view of who is lost is stale (it never hears of a rejoin it is not part of, so with one
    more loss it counted every process lost, and its pace divided by 0 live devices), and its
    admission gives it the run's (`rejoin`)."""
    if process == jax.process_index() or membership.members.rejoining:
      return
    self.rt.transport.lose(process)
    self.rt.peers.lose(self.devices_of({process}))
    self._pace()

  def on_rejoined(self, process: int) -> None:
    """Process `process` was admitted back (`_admit`): its devices are peers again, and a
    receiver loop takes its sends."""
    self.rt.threads.start(self.rt.transport.rejoin(process))
    self.rt.peers.rejoin(self.devices_of({process}))

  def at_consistent_point(self, step: int) -> None:
    """Every process idle, nothing in flight: renormalise, then admit a restarted process."""
    self._renormalise()
    if self.processes_lost:
      self._admit(step)
      self._pace(step)

  def _pace(self, step: int | None = None) -> None:
    """With `distributed.survivors_train_lost_share`, each step of the run costs this
    process's devices `devices / live devices` iterations from the next whole one on
    (layup_jax/runtime/pace.py); a consistent point at `step` anchors the change there."""
    rt = self.rt
    if not rt.options.survivors_train_lost_share:
      return
    rt.pace.set_rate(Fraction(rt.total_devices, self._live_devices()), rt.iterations_started(),
                     None if step is None else step * rt.num_devices)

  def live_devices_by_process(self) -> dict[int, int]:
    """Each live process's (not declared lost) device count."""
    live = set(range(jax.process_count())) - set(membership.members.lost)
    return {k: len(self.devices_of({k})) for k in sorted(live)}

  def _renormalise(self) -> None:
    """Once a process is lost, the survivors divide each stage's push-sum weights by the
    stage's total over them, so that they sum to 1 again and the push-sum average is the
    survivors' (the lost process's weight, and the amounts in flight to it, went with it)."""
    parts = gathers.all_gather_json(self.rt.store.weights.sums())
    if len(parts) < jax.process_count():
      self.processes_lost = True
      self.rt.store.weights.rescale([1.0 / sum(column) for column in zip(*parts)])
    self._count_live_devices()

  def _live_devices(self) -> int:
    """How many of the run's devices are on processes not declared lost."""
    return len(self.devices_of(set(range(jax.process_count())) - set(membership.members.lost)))

  def _count_live_devices(self) -> None:
    """A device's equal share of the push-sum weights is one over the live devices'."""
    self.rt.store.weights.equal_share = 1.0 / self._live_devices()

  def _admit(self, step: int) -> None:
    """Admits a lost process that was started again and asked to rejoin. The leader decides
    and clears its earlier run's notices; then every live process gives it its share: the live
    devices in turn each give one of its devices every stage with half the stage's push-sum
    weight, as a send does, and since that device's weight is 0 it takes the giver's replica;
    each waits until its gifts are merged, so the point stays consistent and every sum exact."""
    rt, members = self.rt, membership.members
    primary = jax.process_index() == members.leader
    joining = members.joining() if primary else []
    for process in joining:  # before anyone hears of it: no notice of the earlier run is read
      rt.transport.forget(process)
      members.clear(process)
    joining = next((j for j in gathers.all_gather_json(joining) if j), [])  # the leader's
    if not joining:
      return
    process = joining[0]
    if primary:
      members.admit(process, step)
    members.rejoined(process)
    self._count_live_devices()
    lost = set(members.lost)
    givers = self.devices_of(set(range(jax.process_count())) - lost - {process})
    for n, device in enumerate(self.devices_of({process})):
      i = rt.transport.local(givers[n % len(givers)])
      if i is not None:
        for s in range(rt.num_stages):
          part, amount = rt.store.take(i, s, halve=True)
          rt.transport.give(device, s, jax.block_until_ready(part), amount)
    rt.transport.quiesce()

  def rejoin(self) -> int:
    """This process was started again after being declared lost (`membership.members.
    rejoining`): asks to rejoin, and once the leader admits it at the run's next consistent
    point, its devices, at push-sum weight 0, each take a live device's replica with half its
    weight (`_admit`; their optimizer state starts afresh) and train on from the run's step,
    which this returns."""
    rt = self.rt
    admission = membership.members.await_admission()
    step, lost = admission["step"], {k for k, _ in admission["lost"]}
    rt.transport.set_lost(lost)
    rt.peers.rejoin(range(rt.total_devices))
    rt.peers.lose(self.devices_of(lost))
    for i, replica in enumerate(rt.store.replicas):
      rt.store.weights.values[i] = [0.0] * rt.num_stages
      replica.iteration = self.joined_at[i] = step
    rt.restored(step * rt.num_devices)
    self._count_live_devices()
    self._pace(step)
    self.processes_lost = True
    self.saves_checkpoints = False
    rt.start_threads()  # the receiver loops merge the shares (nothing else is granted yet)
    deadline = time.monotonic() + 120
    while not all(rt.store.holds_weight(i, s) for i in range(rt.num_devices)
                  for s in range(rt.num_stages)):
      rt.raise_if_failed()
      if time.monotonic() > deadline:
        raise RejoinError("no live device gave this process its share within 120 s")
      time.sleep(0.01)
    rt.store.settle()
    return step
