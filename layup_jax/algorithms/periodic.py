"""Periodic-averaging baselines on the asynchronous runtime: Local SGD, SlowMo, CO2, DiLoCo.

Every device takes local (inner) optimizer steps on its own shard. Every `tau` of its
iterations it reaches a period boundary; when all devices have reached boundary t, the exact
average of their models is taken with one XLA all-reduce (`layup_jax.collectives`), and every
`out_freq` iterations an outer step updates the shared *anchor* from the pseudo-gradient
`anchor - average`:

  Local SGD  models <- average                          (no outer step)
  SlowMo     anchor <- anchor - slow_lr * m,  m <- slow_momentum * m + (anchor - average)
             (Wang et al. 2020, with the base learning rate folded into m), models <- anchor
  DiLoCo     anchor <- Nesterov SGD(outer_lr, outer_momentum) on (anchor - average),
             models <- anchor; inner optimizer from config.optimizer (AdamW in the paper)
  CO2        as SlowMo with the pseudo-gradient's global norm clipped to `co2_clip`, and
             asynchronous: at boundary t a device contributes its model and continues at once
             from the anchor of boundary t-1, so averaging overlaps the next `tau` local steps
             and the average used is exactly one period stale (Sun et al. 2024; their
             staleness-gap penalty is left out, as in the LayUp paper's comparison).

At boundaries without an outer step (between `out_freq` ones) models <- average. BatchNorm
statistics are averaged with the parameters; inner optimizer states stay local. A compute thread
does not start the first iteration of a period before its device's model has been reset for it;
an updater never waits at a boundary (it contributes, and the reset happens when the result is
ready: by the last device to arrive, or by the compute thread before its next iteration). So
whenever every started iteration has finished the runtime is at a consistent point, and a
checkpoint holds the contributions of periods not yet averaged.
"""

import functools
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import optax

from layup_jax import collectives
from layup_jax.algorithms.base import init_model
from layup_jax.data import Dataset, TrainStreams
from layup_jax.errors import ConfigError
from layup_jax.exchange import Links, LocalStepsExchange
from layup_jax.options import RuntimeOptions
from layup_jax.replicas import device_arrays_like
from layup_jax.runtime import AsyncRuntime, PeriodSync
from layup_jax.stages import StagedModel

PyTree = Any


def sync_step(stacked_params, stacked_state, anchor, outer_state, *, like_params, like_state,
              num_devices: int, outer_tx: optax.GradientTransformation | None, outer: bool):
  """The device average of params and state, and the anchor after an optional outer step."""
  average = collectives.device_mean(stacked_params, like_params, num_devices)
  average_state = collectives.device_mean(stacked_state, like_state, num_devices)
  if outer_tx is None or not outer:
    return average, outer_state, average_state
  pseudo_grad = jax.tree.map(lambda a, b: a - b, anchor, average)
  updates, outer_state = outer_tx.update(pseudo_grad, outer_state, anchor)
  return optax.apply_updates(anchor, updates), outer_state, average_state


class PeriodicAveraging(LocalStepsExchange):
  """Local steps, then exact global averages every `tau` iterations (see the module doc)."""

  def __init__(self, links: Links, *, tau: int, out_freq: int,
               outer_tx: optax.GradientTransformation | None, lag: int):
    super().__init__(links)
    if tau < 1 or out_freq % tau:
      raise ValueError(f"out_freq={out_freq} must be a positive multiple of tau={tau}")
    self.tau, self.out_freq, self.lag = tau, out_freq, lag
    store = self.store
    self.num_devices, self.num_stages = store.num_devices, store.num_stages
    self._mesh = collectives.DeviceMesh([r.device for r in store.replicas])
    self._sync = PeriodSync(self.num_devices, self._average, links.stopped)
    self._finished = [0] * self.num_devices  # iterations whose updates device i has applied
    self._applied = [0] * self.num_devices  # boundaries whose reset device i has applied
    self._contributions: dict[int, list] = {}
    first = store.replicas[0]
    self._anchor = self._mesh.replicate(list(first.params))
    self._outer_tx = outer_tx
    self._outer_state = self._mesh.replicate(outer_tx.init(list(first.params))) if outer_tx \
        else ()
    self._results = {0: ([list(r.params) for r in store.replicas],
                         [list(r.state) for r in store.replicas])}
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        (list(first.params), list(first.state)))
    out = (self._mesh.replicated,) * 3
    self._sync_steps = {
        outer: jax.jit(lambda p, st, a, o, outer=outer: sync_step(
            p, st, a, o, like_params=like[0], like_state=like[1],
            num_devices=self.num_devices, outer_tx=outer_tx, outer=outer), out_shardings=out)
        for outer in (False, True)
    }

  def compile(self) -> None:
    replicas = self.store.replicas
    params = self._mesh.stack([list(r.params) for r in replicas])
    state = self._mesh.stack([list(r.state) for r in replicas])
    for step in self._sync_steps.values():
      jax.block_until_ready(step(params, state, self._anchor, self._outer_state))

  # --- the period boundary ----------------------------------------------------------------------

  def _average(self, period: int) -> None:
    """Run by the last device to reach boundary `period`: average, outer step, results."""
    contributions = self._contributions.pop(period)
    params = self._mesh.stack([c[0] for c in contributions])
    state = self._mesh.stack([c[1] for c in contributions])
    # Between outer steps the models are averaged and the anchor stays where it is.
    outer = self._outer_tx is not None and (period * self.tau) % self.out_freq == 0
    models, self._outer_state, average_state = self._sync_steps[outer](
        params, state, self._anchor, self._outer_state)
    if outer:
      self._anchor = models
    self._results[period] = (self._mesh.unstack(models), self._mesh.unstack(average_state))
    self._results.pop(period - 2, None)
    if self.lag == 0:
      for k in range(self.num_devices):
        self._reset(k, period, period)

  def _reset(self, k: int, boundary: int, period: int) -> None:
    """Device k's model <- the models of `period`'s result, for boundary `boundary`."""
    params, state = self._results[period]
    self.store.reset(k, params[k], state[k])
    self._applied[k] = boundary

  def end(self, i, context) -> None:
    finished = self._finished[i] + 1
    if finished % self.tau == 0:
      boundary = finished // self.tau
      replica = self.store.replicas[i]
      self._contributions.setdefault(boundary, [None] * self.num_devices)[i] = (
          list(replica.params), list(replica.state))
      # The last device to arrive averages; with lag 0 it also resets every model.
      self._sync.arrive(boundary)
      if self.lag and self._sync.done >= boundary - self.lag:  # CO2: the stale average is ready
        self._reset(i, boundary, boundary - self.lag)
    self._finished[i] = finished  # after the reset: the compute thread may now reset instead
    self._sync.notify()

  def may_wait_before_iteration(self, i: int) -> bool:
    k = self.store.replicas[i].iteration
    return bool(k) and k % self.tau == 0  # at a boundary: until the others arrive

  def before_iteration(self, i: int, wait: bool) -> None:
    if not self.may_wait_before_iteration(i):
      return
    k = self.store.replicas[i].iteration
    boundary = k // self.tau
    needed = boundary - self.lag

    def ready() -> bool:
      return self._applied[i] >= boundary or (self._finished[i] >= k
                                              and self._sync.done >= needed)

    if not wait and not ready():
      raise RuntimeError(f"serial mode: device {i} reached boundary {boundary} before every "
                         f"device reached boundary {needed}")
    self._sync.wait_until(ready)
    if self._applied[i] < boundary:  # the average was not ready when this device arrived
      self._reset(i, boundary, needed)
      self._sync.notify()

  # --- checkpoints --------------------------------------------------------------------------------

  def _model_arrays(self, params, state) -> dict[str, list]:
    return {"params": list(params), "state": list(state)}

  def state_dict(self):
    slots = [(p, k) for p, models in sorted(self._contributions.items())
             for k, model in enumerate(models) if model is not None]
    periods = sorted(self._results)
    arrays = {
        "anchor": self._anchor, "outer_state": self._outer_state,
        # Averages are replicated: one copy each (period 0's are the identical initial models).
        "results": [self._model_arrays(self._results[p][0][0], self._results[p][1][0])
                    for p in periods],
        "contributions": [self._model_arrays(*self._contributions[p][k]) for p, k in slots],
    }
    meta = {"finished": list(self._finished), "applied": list(self._applied),
            "periods_done": self._sync.done, "result_periods": periods,
            "contribution_slots": [list(slot) for slot in slots]}
    return arrays, meta

  def _check_resumable(self, meta, saved_devices: int) -> None:
    finished = meta["finished"]
    if saved_devices != self.num_devices and (meta["contribution_slots"]
                                              or len(set(finished)) > 1):
      raise ConfigError(
          f"this checkpoint of a periodic-averaging algorithm was taken in the middle of an "
          f"averaging period (devices at iterations {finished}); resume it on "
          f"{saved_devices} devices")

  def restore_template(self, meta):
    self._check_resumable(meta, len(meta["finished"]))
    replicas = self.store.replicas
    model = self._model_arrays(replicas[0].params, replicas[0].state)
    like = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    return {
        "anchor": like(self._anchor), "outer_state": like(self._outer_state),
        "results": device_arrays_like(model, lambda j: replicas[0].device,
                                      len(meta["result_periods"])),
        "contributions": [device_arrays_like(model, lambda j, k=k: replicas[
            k % self.num_devices].device, 1)[0] for _, k in meta["contribution_slots"]],
    }

  def load_state_dict(self, arrays, meta, saved_devices: int) -> None:
    self._check_resumable(meta, saved_devices)
    finished, count = meta["finished"], self.num_devices
    same = saved_devices == count
    self._finished = list(finished) if same else [finished[0]] * count
    self._applied = list(meta["applied"]) if same else [meta["applied"][0]] * count
    replicas = self.store.replicas
    self._anchor = jax.device_put(arrays["anchor"], self._mesh.replicated)
    self._outer_state = jax.device_put(arrays["outer_state"], self._mesh.replicated)
    self._results = {
        p: ([jax.device_put(model["params"], r.device) for r in replicas],
            [jax.device_put(model["state"], r.device) for r in replicas])
        for p, model in zip(meta["result_periods"], arrays["results"])}
    self._contributions = {}
    for (p, k), model in zip(meta["contribution_slots"], arrays["contributions"]):
      self._contributions.setdefault(p, [None] * count)[k] = (list(model["params"]),
                                                              list(model["state"]))
    self._sync.restore(meta["periods_done"],
                       {p: sum(m is not None for m in models)
                        for p, models in self._contributions.items()})


def _outer_tx(config: ml_collections.ConfigDict) -> optax.GradientTransformation | None:
  b = config.baselines
  slowmo = optax.sgd(b.slow_lr, momentum=b.slow_momentum or None)
  return {
      "local_sgd": None,
      "slowmo": slowmo,
      "co2": optax.chain(optax.clip_by_global_norm(b.co2_clip), slowmo),
      "diloco": optax.sgd(b.outer_lr, momentum=b.outer_momentum, nesterov=True),
  }[config.algorithm]


def make_exchange(*, tau: int, out_freq: int, outer_tx: optax.GradientTransformation | None,
                  lag: int):
  """The exchange factory `AsyncRuntime` takes, for one periodic-averaging algorithm."""
  return functools.partial(PeriodicAveraging, tau=tau, out_freq=out_freq, outer_tx=outer_tx,
                           lag=lag)


def build(config: ml_collections.ConfigDict, model: StagedModel,
          tx: optax.GradientTransformation, devices: Sequence[jax.Device],
          dataset: Dataset | TrainStreams) -> AsyncRuntime:
  params, state = init_model(config, model, dataset.example_batch)
  options = RuntimeOptions.from_config(config).replace(bn_policy="mix")
  exchange = make_exchange(tau=config.baselines.tau, out_freq=config.baselines.out_freq,
                           outer_tx=_outer_tx(config), lag=1 if config.algorithm == "co2" else 0)
  return AsyncRuntime(model, tx, devices, dataset.train, params, state, dataset.example_batch,
                      exchange, options)
