"""Periodic-averaging baselines on the asynchronous runtime: Local SGD, SlowMo, CO2, DiLoCo.

Every device takes local (inner) optimizer steps on its own shard. Every `tau` of its
iterations it reaches a period boundary b and contributes its model y_b^i; when all devices
have reached b, their exact average is taken with one XLA all-reduce
(`layup_jax.algorithms.collectives`) and gives the boundary's result R_b, the model the devices continue
from. Every `out_freq` iterations an outer step moves the *anchor* (R at the previous outer
boundary) along the pseudo-gradient `anchor - average`:

  Local SGD  R_b = average                                     (no outer step)
  SlowMo     m <- slow_momentum m + (anchor - average) / lr,
             R_b = anchor <- anchor - slow_lr lr m             (fairscale's
             SlowMoDistributedDataParallel: lr is the base optimizer's learning rate at the
             boundary's last inner step)
  DiLoCo     R_b = anchor <- Nesterov SGD(outer_lr, outer_momentum) on (anchor - average),
             one outer step at every average (out_freq == tau, Douillard et al. 2023,
             Algorithm 1); inner optimizer from config.optimizer (AdamW in the paper)
  CO2        m <- clip(slow_momentum m + (anchor - consensus)), R_b = anchor <- anchor -
             slow_lr m, with the outer momentum clipped elementwise to [-co2_clip, co2_clip]
             (the CO2 fork's co2.py, `_perform_local_optimization` and `_co2_clip`), and
             asynchronous (Sun et al. 2024): the all-reduce of boundary b overlaps the next
             `tau` local steps, and its result R_b reaches a device one period late, at b+1.

How a CO2 device takes the stale result (`baselines.co2_resume`). "correct" (the default): at
boundary b device i contributes y_b^i and goes on from its *own* model, corrected by the stale
result: x <- y_b^i + R_{b-1} - c_{b-1}^i, where c_{b-1}^i is its corrected model at b-1 (a
delayed-averaging correction, as in CoCoD-SGD, Shen et al. 2019). Then c_b^i = R_{b-1} + (its
progress of period b): a device keeps its own latest progress, and the others' arrives one period
late; the consensus is mean_i c_b^i = R_{b-1} + mean_i y_b^i - C_{b-1} (C the consensus before the
outer step). On a quadratic whose devices share the curvature it follows synchronous Local SGD's
consensus exactly (tests/test_baselines.py). "restart" (the earlier form, an ablation): the device
continues from R_{b-1} itself, so its own period-b progress leaves its model and returns through
R_b one period later while its inner momentum carries on; with heavy-ball momentum 0.9 and tau 12
the consensus then moves *away* from a quadratic's minimum, 1.14x per period where Local SGD and
the correction close in 0.49x (tests/test_baselines.py; docs/records/measurements.md, "CO2"). The
consensus is then R_{b-1} + mean_i y_b^i - R_{b-2} (the periods started from R_{b-2}).

Sun et al. stabilise the overlap with a "staleness gap penalty" and outer-momentum clipping.
Their Algorithm 1 and the penalty's equation were not readable from here (no copy of the
paper's text beyond its abstract in the sources this project can reach); their released code
(github.com/weigao266/fairscale-CO2, co2.py) runs the outer step synchronously and divides
the pseudo-gradient by a constant `co2_gap_penalty` (default 1; fairseq-CO2 passes its
`--co2-gap-penalty`, default 1), with its clip's result discarded. The correction form is this
project's: it keeps the overlap the paper describes and converges where restarting does not.
The penalty is here as that code defines it (`baselines.co2_gap_penalty`, default 1: none), and
the clip; the LayUp paper's CO2 runs without it too ("the published CO2 implementation does not
include the penalty gap correction"). Even corrected, the lag costs accuracy: the others'
progress reaches a device 1-2 periods late, and at tau 12 with momentum 0.9 CO2 collapses at
learning rates Local SGD trains at (docs/records/measurements.md, "CO2").

Between outer steps R_b is the consensus.

BatchNorm statistics follow `layup.bn_policy`: "mix" averages them with the parameters at each
boundary; "local" keeps each device's own. Inner optimizer states stay local. A compute task
does not start the first iteration of a period before its device's model has been reset for it;
an updater never waits at a boundary (it contributes, and the reset happens when the result is
ready: by the last device to arrive, or by the compute task before its next iteration). So
whenever every started iteration has finished the runtime is at a consistent point, and a
checkpoint holds the contributions of periods not yet averaged.

Why one module of this size: the exchange's hooks, the period's shared state and that state's
checkpoint form of one protocol (which boundary each device has reached, what each contributed,
which results it has taken); the outer optimizers, which are independent of it, live in
`outer.py`.
"""

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from layup_jax import optim
from layup_jax.algorithms import collectives
from layup_jax.algorithms.base import asynchronous_runtime
from layup_jax.algorithms.outer import OuterStep
from layup_jax.checkpoint.layout import device_arrays_like
from layup_jax.data import Dataset, TrainStreams
from layup_jax.errors import ConfigError
from layup_jax.models.staged import StagedModel
from layup_jax.multiprocess import traffic
from layup_jax.runtime.engine import AsyncRuntime
from layup_jax.runtime.exchange import Hooks, Links
from layup_jax.runtime.scheduler import Task, Until

PyTree = Any


def sync_step(stacked_params, stacked_state, base, previous, anchor, outer_state, learning_rate,
              *, like_params, like_state, num_devices: int, outer: OuterStep | None,
              outer_now: bool, lagged: bool, mix_state: bool):
  """Boundary b's result from the devices' models y_b^i:

  consensus = previous + mean_i(y_b^i) - base when `lagged` (CO2), with `previous` R_{b-1}
  and `base` the consensus of boundary b-1 before its outer step (the correction: previous -
  base is the mean of the corrections the devices add) or, restarting, R_{b-2} (the model
  every device started the period from); the plain average otherwise. Then the outer step
  when `outer_now`.
  Returns `(result, anchor, outer_state, average_state, consensus)`.
  """
  average = collectives.device_mean(stacked_params, like_params, num_devices)
  consensus = (jax.tree.map(lambda p, x, b: p + (x - b), previous, average, base) if lagged
               else average)
  average_state = (collectives.device_mean(stacked_state, like_state, num_devices) if mix_state
                   else ())
  if outer is None or not outer_now:
    return consensus, anchor, outer_state, average_state, consensus
  anchor, outer_state = outer.step(anchor, consensus, outer_state, learning_rate)
  return anchor, anchor, outer_state, average_state, consensus


@jax.jit
def _correction(result: PyTree, contribution: PyTree, previous: PyTree) -> PyTree:
  """Device i's correction after boundary b, R_b - c_b^i, where its corrected model at b is
  c_b^i = y_b^i + (its previous correction)."""
  return jax.tree.map(lambda r, y, c: r - (y + c), result, contribution, previous)


@jax.jit
def _add(tree: PyTree, other: PyTree) -> PyTree:
  return jax.tree.map(jnp.add, tree, other)


class PeriodSync:
  """Rendezvous of all devices at the end of each averaging period.

  Device i's `arrive(period)` counts it in; the last device to arrive runs `action(period)`
  (before returning) and the period is then done. Only this bookkeeping is locked; a device
  that waits for a period does so in its task (`PeriodicAveraging.before_iteration`).
  """

  def __init__(self, num_devices: int, action: Callable[[int], None]):
    self._num, self._action = num_devices, action
    self._lock = threading.Lock()
    self._arrived: dict[int, int] = collections.defaultdict(int)
    self.done = 0  # periods whose action has run (they complete in order)

  def arrive(self, period: int) -> bool:
    """Counts the caller in; True if it was the last and has run the action."""
    with self._lock:
      self._arrived[period] += 1
      if self._arrived[period] < self._num:
        return False
      del self._arrived[period]
      self._action(period)
      self.done = period
      return True

  def restore(self, done: int, arrived: dict[int, int]) -> None:
    """Continues a checkpointed run: `done` periods complete, `arrived[p]` devices at p."""
    with self._lock:
      self.done = done
      self._arrived = collections.defaultdict(int, arrived)


class PeriodState:
  """What the periodic baselines keep beyond the replicas (`Exchange.state`): the anchor and
  outer state, the results R_p of the latest periods, the contributions of periods not yet
  averaged, and each device's progress through the boundaries; settled, saved and restored by
  the runtime (layup_jax/runtime/state.py)."""

  # Replicated averages: at a checkpoint every process has run the same ones.
  same_on_every_process = ("anchor", "outer_state", "results", "consensus")

  def __init__(self, store, mesh: collectives.DeviceMesh, *, tau: int, lag: int,
               mix_state: bool, outer: OuterStep | None, average: Callable[[int], None],
               correct: bool = False):
    self.store, self.mesh, self.tau, self.lag, self.mix_state = store, mesh, tau, lag, mix_state
    # CO2's correction: results[p] holds each device's correction R_p - c_p^i, not R_p.
    self.correct = correct
    self.num_devices = store.num_devices
    self.sync = PeriodSync(self.num_devices, average)
    self.finished = [0] * self.num_devices  # iterations whose updates device i has applied
    self.applied = [0] * self.num_devices  # boundaries whose reset device i has applied
    self.contributions: dict[int, list] = {}
    first = store.replicas[0]
    self.anchor = mesh.replicate(list(first.params))
    self.outer_state = mesh.replicate(outer.init(list(first.params))) if outer else ()
    # R_p per boundary p, replicated over the mesh, and its per-device copies with the state
    # (under the correction: each device's correction, zero at p = 0); the consensus before
    # the outer step (the correction's base).
    self.averages = {0: self.anchor}
    self.consensus = {0: self.anchor}
    models = ([list(r.params) for r in store.replicas],
              [list(r.state) for r in store.replicas] if mix_state else None)
    self.results = {0: jax.tree.map(jnp.zeros_like, models) if correct else models}

  def reset(self, k: int, boundary: int, period: int) -> None:
    """Device k's model <- `period`'s result (its BatchNorm state too under "mix"), or, under
    CO2's correction, model += its correction; for boundary `boundary`."""
    params, state = self.results[period]
    params, state = params[k], state[k] if state is not None else None
    if self.correct:  # device k is idle at its boundary: nothing else writes its replica
      replica = self.store.replicas[k]
      params = _add(list(replica.params), params)
      state = _add(list(replica.state), state) if state is not None else None
    self.store.reset(k, params, state)
    self.applied[k] = boundary

  def take_ready_result(self, k: int, boundary: int) -> bool:
    """Device k, at boundary `boundary`, takes the result it continues from (R_b; R_{b-1}
    under CO2's lag) if that is ready and not yet taken; True if it took it now."""
    if self.applied[k] >= boundary or self.sync.done < boundary - self.lag:
      return False
    self.reset(k, boundary, boundary - self.lag)
    return True

  def settle(self) -> None:
    """A device that contributed at a boundary before the average it continues from was
    ready (CO2) takes it now rather than at its next iteration: at a consistent point every
    device has reached the boundary, so the average is ready, and the snapshot (an evaluation,
    a checkpoint) holds it whatever the timing."""
    for k, finished in enumerate(self.finished):
      if finished and finished % self.tau == 0:
        self.take_ready_result(k, finished // self.tau)

  # --- checkpoints --------------------------------------------------------------------------------

  def _model_arrays(self, params, state) -> dict[str, list]:
    return {"params": list(params), "state": list(state) if state is not None else []}

  def _one_copy(self, replicated: PyTree) -> list:
    return list(self.mesh.unstack(replicated)[0])

  def state_dict(self):
    slots = [(p, k) for p, models in sorted(self.contributions.items())
             for k, model in enumerate(models) if model is not None]
    periods = sorted(self.results)
    corrections = [(p, k) for p in periods for k in range(self.num_devices)] if self.correct else []
    arrays = {
        "anchor": self.anchor, "outer_state": self.outer_state,
        # Averages are replicated: one copy each (period 0's are the identical initial models);
        # under the correction R_p's params, and the consensus, and each device's correction.
        "results": ([self._model_arrays(self._one_copy(self.averages[p]), None) for p in periods]
                    if self.correct else
                    [self._model_arrays(self.results[p][0][0], (self.results[p][1] or [None])[0])
                     for p in periods]),
        "consensus": ([self._one_copy(self.consensus[p]) for p in periods] if self.correct
                      else []),
        "corrections": [self._model_arrays(self.results[p][0][k],
                                           self.results[p][1][k] if self.mix_state else None)
                        for p, k in corrections],
        "contributions": [self._model_arrays(*self.contributions[p][k]) for p, k in slots],
    }
    meta = {"finished": list(self.finished), "applied": list(self.applied),
            "periods_done": self.sync.done, "result_periods": periods,
            "contribution_slots": [list(slot) for slot in slots],
            "correction_slots": [list(slot) for slot in corrections]}
    return arrays, meta

  def _check_resumable(self, meta, saved_devices: int) -> None:
    finished = meta["finished"]
    if saved_devices != self.num_devices and (meta["contribution_slots"]
                                              or meta.get("correction_slots")
                                              or len(set(finished)) > 1):
      raise ConfigError(
          f"this checkpoint of a periodic-averaging algorithm was taken in the middle of an "
          f"averaging period (devices at iterations {finished}); resume it on "
          f"{saved_devices} devices")

  def restore_template(self, meta):
    self._check_resumable(meta, len(meta["finished"]))
    replicas = self.store.replicas
    model = self._model_arrays(replicas[0].params, replicas[0].state)
    result = self._model_arrays(replicas[0].params, replicas[0].state
                                if self.mix_state and not self.correct else None)
    correction = self._model_arrays(replicas[0].params, replicas[0].state if self.mix_state
                                    else None)
    periods = len(meta["result_periods"])
    # The anchor and outer state come back on one device and are replicated from there (a
    # replicated sharding may span other processes' devices, which this one cannot read).
    first_device = jax.sharding.SingleDeviceSharding(replicas[0].device)
    like = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=first_device), tree)
    return {
        "anchor": like(self.anchor), "outer_state": like(self.outer_state),
        "results": device_arrays_like(result, lambda j: replicas[0].device, periods),
        "consensus": device_arrays_like(list(replicas[0].params), lambda j: replicas[0].device,
                                        periods if self.correct else 0),
        "corrections": [device_arrays_like(correction, lambda j, k=k: replicas[k].device, 1)[0]
                        for _, k in meta.get("correction_slots", [])],
        "contributions": [device_arrays_like(model, lambda j, k=k: replicas[
            k % self.num_devices].device, 1)[0] for _, k in meta["contribution_slots"]],
    }

  def load_state_dict(self, arrays, meta, saved_devices: int) -> None:
    self._check_resumable(meta, saved_devices)
    finished, count = meta["finished"], self.num_devices
    same = saved_devices == count
    self.finished = list(finished) if same else [finished[0]] * count
    self.applied = list(meta["applied"]) if same else [meta["applied"][0]] * count
    replicas = self.store.replicas
    self.anchor = self.mesh.replicate(arrays["anchor"])
    self.outer_state = self.mesh.replicate(arrays["outer_state"])
    self.results = {
        p: ([jax.device_put(model["params"], r.device) for r in replicas],
            [jax.device_put(model["state"], r.device) for r in replicas] if self.mix_state
            else None)
        for p, model in zip(meta["result_periods"], arrays["results"])}
    self.averages = {p: self.mesh.replicate(model["params"])
                     for p, model in zip(meta["result_periods"], arrays["results"])}
    if self.correct:
      self.consensus = {p: self.mesh.replicate(params)
                        for p, params in zip(meta["result_periods"], arrays["consensus"])}
      self.results = {p: ([None] * count, [None] * count if self.mix_state else None)
                      for p in meta["result_periods"]}
      for (p, k), model in zip(meta["correction_slots"], arrays["corrections"]):
        self.results[p][0][k] = list(model["params"])
        if self.mix_state:
          self.results[p][1][k] = list(model["state"])
    self.contributions = {}
    for (p, k), model in zip(meta["contribution_slots"], arrays["contributions"]):
      self.contributions.setdefault(p, [None] * count)[k] = (list(model["params"]),
                                                             list(model["state"]))
    self.sync.restore(meta["periods_done"],
                      {p: sum(m is not None for m in models)
                       for p, models in self.contributions.items()})

  # --- across processes: one checkpoint of the whole run ----------------------------------------

  def whole_run_state(self, parts):
    return join_process_states(parts)

  def own_part(self, arrays, meta, first: int, count: int):
    return process_state(arrays, meta, first, count)


class PeriodicAveraging(Hooks):
  """Local steps, then exact global averages every `tau` iterations (see the module doc); its
  state beyond the replicas is `self.state` (`PeriodState`)."""

  schedule_by_own_iteration = True  # every device's k-th local step at the schedule's step k
  equal_shares = True  # every device takes the run's iterations / devices (a CO2 record or
                      # checkpoint then falls at the same iterations whatever the timing)

  def __init__(self, links: Links, *, tau: int, out_freq: int, outer: OuterStep | None,
               lag: int, learning_rate: Callable[[int], float] = lambda step: 1.0,
               correct_stale: bool = False):
    super().__init__(links)
    if tau < 1 or out_freq % tau:
      raise ValueError(f"out_freq={out_freq} must be a positive multiple of tau={tau}")
    self.tau, self.out_freq, self.lag = tau, out_freq, lag
    self._learning_rate = learning_rate
    store = self.store
    self.num_devices, self.num_stages = store.num_devices, store.num_stages
    self._mix_state = links.options.bn_policy == "mix"
    self._mesh = collectives.DeviceMesh([r.device for r in store.replicas], links.run_devices)
    total = len(links.run_devices)  # the mean is over every process's devices
    self._outer = outer
    self.state = PeriodState(store, self._mesh, tau=tau, lag=lag, mix_state=self._mix_state,
                             outer=outer, average=self._average,
                             correct=bool(lag) and correct_stale)
    first = store.replicas[0]
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        (list(first.params), list(first.state)))
    out = (self._mesh.replicated,) * 5
    self._shares: dict[bool, float] = {}  # bytes sent to other processes per boundary
    self._sync_steps = {
        outer_now: jax.jit(functools.partial(
            sync_step, like_params=like[0], like_state=like[1], num_devices=total,
            outer=outer, outer_now=outer_now, lagged=bool(lag), mix_state=self._mix_state),
            out_shardings=out)
        for outer_now in (False, True)
    }

  def _sync_arguments(self, params, state, period: int) -> tuple:
    averages = self.state.averages
    base = (self.state.consensus[period - 1] if self.state.correct
            else averages[max(period - 1 - self.lag, 0)])
    previous = averages[period - 1]
    learning_rate = self._mesh.replicate(np.float32(self._learning_rate(period * self.tau - 1)))
    return (params, state, base, previous, self.state.anchor, self.state.outer_state,
            learning_rate)

  def compile(self) -> None:
    """Runs both sync steps once on stand-in arguments of the right shapes and placements
    (the anchor for every model R_p: a resumed run holds only its latest periods' results)."""
    replicas = self.store.replicas
    params = self._mesh.stack([list(r.params) for r in replicas])
    state = self._mesh.stack([list(r.state) for r in replicas])
    learning_rate = self._mesh.replicate(np.float32(1.0))
    anchor = self.state.anchor
    arguments = (params, state, anchor, anchor, anchor, self.state.outer_state, learning_rate)
    for step in self._sync_steps.values():
      jax.block_until_ready(step(*arguments))
    # Across processes, what each process sends per boundary (from the program's all-reduces).
    if self.links.transport.across_processes:
      self._shares = {outer_now: traffic.compiled_share(step.lower(*arguments).compile(),
                                                        jax.process_count())
                      for outer_now, step in self._sync_steps.items()}

  # --- the period boundary ----------------------------------------------------------------------

  def _average(self, period: int) -> None:
    """Run by the last device to reach boundary `period`: average, outer step, results."""
    st = self.state
    contributions = st.contributions.pop(period)
    params = self._mesh.stack([c[0] for c in contributions])
    state = self._mesh.stack([c[1] for c in contributions])
    outer_now = self._outer is not None and (period * self.tau) % self.out_freq == 0
    self.links.transport.sent.add(self._shares.get(outer_now, 0))
    result, st.anchor, st.outer_state, average_state, st.consensus[period] = (
        self._sync_steps[outer_now](*self._sync_arguments(params, state, period)))
    st.averages[period] = result
    results = (self._mesh.unstack(result),
               self._mesh.unstack(average_state) if self._mix_state else None)
    if st.correct:  # each device's R_b - (y_b^i + its previous correction)
      previous = st.results[period - 1]
      results = tuple(None if part is None else [
          _correction(r, c[n], p) for r, c, p in zip(part, contributions, previous[n])]
          for n, part in enumerate(results))
    st.results[period] = results
    # R_{b-1} stays: the base of boundary b+1 under CO2's lag, and the reset at b.
    for kept in (st.averages, st.results, st.consensus):
      kept.pop(period - 2, None)
    if self.lag == 0:
      for k in range(self.num_devices):
        st.reset(k, period, period)

  def end(self, i, context) -> None:
    st = self.state
    finished = st.finished[i] + 1
    if finished % self.tau == 0:
      boundary = finished // self.tau
      replica = self.store.replicas[i]
      st.contributions.setdefault(boundary, [None] * self.num_devices)[i] = (
          list(replica.params), list(replica.state))
      # The last device to arrive averages; with lag 0 it also resets every model.
      st.sync.arrive(boundary)
      st.take_ready_result(i, boundary)  # CO2: the stale average may be ready
    st.finished[i] = finished  # after the reset: the compute task may now reset instead

  def before_iteration(self, i: int) -> Task | None:
    """At a boundary: a task that waits until every device has arrived (None elsewhere)."""
    k = self.store.replicas[i].iteration
    if not k or k % self.tau:
      return None
    return self._wait_at_boundary(i, k)

  def _wait_at_boundary(self, i: int, k: int) -> Task:
    st = self.state
    boundary = k // self.tau
    needed = boundary - self.lag

    def ready() -> bool:
      return st.applied[i] >= boundary or (st.finished[i] >= k and st.sync.done >= needed)

    if not ready():
      yield Until(ready, f"every device at boundary {needed} (device {i} is at {boundary})")
    st.take_ready_result(i, boundary)  # it was not ready when this device arrived


_PER_DEVICE = ("finished", "applied")  # the per-device entries of the exchange's metadata
# The per-device arrays of a state, and the metadata naming each one's (period, device).
_PER_SLOT = (("contributions", "contribution_slots"), ("corrections", "correction_slots"))


def join_process_states(parts: list[tuple[dict, dict, int]]) -> tuple[dict, dict]:
  """One checkpoint state of a run across processes from each process's `state_dict` and first
  device. At a checkpoint every device of every process has taken the same iterations (the
  runner stops all processes at the same step; `equal_shares`), so every process has run the
  same periods' all-reduces, and the anchor, outer state, results and periods averaged are the
  same in every part (each process passes its own copy: `same_on_every_process`); the
  contributions, corrections and per-device counts are joined in device order."""
  if len({(m["periods_done"], tuple(m["result_periods"])) for _, m, _ in parts}) > 1:
    raise RuntimeError(f"processes reached a checkpoint at different periods: "
                       f"{[m['periods_done'] for _, m, _ in parts]}")
  arrays, meta = dict(parts[0][0]), dict(parts[0][1])
  for key, slots in _PER_SLOT:
    arrays[key] = [c for a, _, _ in parts for c in a[key]]
    meta[slots] = [[p, first + k] for _, m, first in parts for p, k in m[slots]]
  for key in _PER_DEVICE:
    meta[key] = [x for _, m, _ in parts for x in m[key]]
  return arrays, meta


def process_state(arrays: dict, meta: dict, first: int, count: int) -> tuple[dict, dict]:
  """`join_process_states`'s inverse: the part of devices `first .. first + count - 1`."""
  arrays, meta = dict(arrays), dict(meta)
  for key, slots in _PER_SLOT:
    mine = [n for n, (_, k) in enumerate(meta[slots]) if first <= k < first + count]
    arrays[key] = [arrays[key][n] for n in mine]
    meta[slots] = [[meta[slots][n][0], meta[slots][n][1] - first] for n in mine]
  for key in _PER_DEVICE:
    meta[key] = meta[key][first:first + count]
  return arrays, meta


def make_exchange(*, tau: int, out_freq: int, outer: OuterStep | None, lag: int,
                  learning_rate: Callable[[int], float] = lambda step: 1.0,
                  correct_stale: bool = False):
  """The exchange factory `AsyncRuntime` takes, for one periodic-averaging algorithm;
  `learning_rate(step)` is the base optimizer's schedule (SlowMo scales by it);
  `correct_stale`: with a lag, each device corrects its own model by the stale result instead
  of restarting from it (CO2, module docstring)."""
  return functools.partial(PeriodicAveraging, tau=tau, out_freq=out_freq, outer=outer, lag=lag,
                           learning_rate=learning_rate, correct_stale=correct_stale)


def builder(make_outer: Callable[[ml_collections.ConfigDict], OuterStep | None],
            lag: int = 0, averages_per_outer_step: int = 4) -> Callable[..., AsyncRuntime]:
  """The `build` of one periodic baseline (the registry's entry): its outer step from
  `make_outer(config.baselines)` (None: Local SGD), `lag` periods of staleness (CO2's 1), an
  outer step every `baselines.out_freq` iterations, or with 0 every `averages_per_outer_step`
  averages (4: the paper's 48 at tau 12; DiLoCo's 1)."""
  def build(config: ml_collections.ConfigDict, model: StagedModel,
            tx: optax.GradientTransformation, devices: Sequence[jax.Device],
            dataset: Dataset | TrainStreams) -> AsyncRuntime:
    steps_per_epoch = getattr(dataset, "steps_per_epoch", 0)  # benchmark streams have none
    schedule = optim.make_schedule(config.optimizer,
                                   config.num_steps or config.num_epochs * steps_per_epoch,
                                   steps_per_epoch)
    tau = config.baselines.tau
    exchange = make_exchange(tau=tau, out_freq=config.baselines.out_freq
                             or averages_per_outer_step * tau,
                             outer=make_outer(config.baselines), lag=lag,
                             learning_rate=lambda step: float(schedule(step)),
                             correct_stale=config.baselines.co2_resume == "correct")
    return asynchronous_runtime(config, model, tx, devices, dataset, exchange)
  return build
