"""Staging a model: an ordered list of Flax modules becomes per-stage pure functions.

A stage is `(params, state, x, rng, train) -> (y, new_state)`; `state` holds mutable collections
such as BatchNorm's `batch_stats`. The last stage is the loss head: its module's output and the
labels go through `loss_fn`. LayUp dispatches one jitted forward per stage that returns the
activation *and* the stage's VJP (so the backward pass never recomputes the forward), then one
jitted VJP per stage in reverse order, handing each stage's gradient to the updater as it appears.
"""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from layup_jax import nonfinite, pushsum
from layup_jax.packing import StagePacking, pack_residuals, unpack_residuals

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]
# What a stage's forward keeps for its backward (`layup.remat`): "none" keeps every residual the
# VJP asks for; "dots" only the outputs of matrix multiplications and convolutions, the
# elementwise work (normalization, activations) being recomputed in the backward; "full" only
# the stage's input, the whole stage being recomputed.
REMAT_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy of integer labels, over samples (and tokens, for sequences)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


def _accepts_train(module: nn.Module) -> bool:
  return "train" in inspect.signature(type(module).__call__).parameters


def stage_key(key: jax.Array, stage_idx: int) -> jax.Array:
  """A stage's own key, made once per replica so that stage functions need no stage index."""
  return jax.random.fold_in(key, stage_idx)


def stage_rng(key: jax.Array, iteration: jax.Array, stage_idx: int) -> jax.Array:
  """The dropout key of one stage in one iteration, the same in staged and fused steps."""
  return jax.random.fold_in(stage_key(key, stage_idx), iteration)


def apply_module(module: nn.Module, params: PyTree, state: PyTree, x: PyTree, rng: jax.Array,
                 train: bool) -> tuple[PyTree, PyTree]:
  """A module as a stage: `(params, state, x, rng, train) -> (y, new_state)`."""
  kwargs = {"train": train} if _accepts_train(module) else {}
  variables = {"params": params, **state}
  if train and state:
    y, new_state = module.apply(variables, x, rngs={"dropout": rng}, mutable=list(state), **kwargs)
    return y, dict(new_state)
  return module.apply(variables, x, rngs={"dropout": rng}, **kwargs), state


def tree_get(tree: PyTree, path: Sequence[str]) -> PyTree:
  for key in path:
    tree = tree[key]
  return tree


def tree_add_at(tree: PyTree, path: Sequence[str], value: jax.Array) -> PyTree:
  """A copy of nested dicts `tree` with `value` added to the leaf at `path`."""
  if not path:
    return tree + value
  return {**tree, path[0]: tree_add_at(tree[path[0]], path[1:], value)}


@dataclasses.dataclass(frozen=True)
class Tie:
  """Stage `consumer` also reads the array at `path` of stage `owner`'s params.

  GPT-2's output projection is its input embedding. Under layer-wise updates the matrix must be
  updated once per iteration with the sum of both stages' gradients and merged into a peer once,
  so it lives only in the owner's params: the consumer's module receives `(x, array)` as input,
  the array is read from the owner's *current* params when the consumer is dispatched, and the
  consumer's gradient for it is added to the owner's gradient before the owner's update. The
  owner precedes the consumer, so in the backward pass the consumer's part arrives first.
  """

  owner: int
  consumer: int
  path: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StagedModel:
  """A model as an ordered list of stages; the last one feeds `loss_fn`.

  Each module is called as `module(x, train=train)` (or `module(x)` when its `__call__` takes
  no `train`); dropout reads the `"dropout"` rng stream.
  """

  modules: tuple[nn.Module, ...]
  loss_fn: LossFn = softmax_cross_entropy
  ties: tuple[Tie, ...] = ()

  def __post_init__(self):
    if not self.modules:
      raise ValueError("a StagedModel needs at least one module")
    object.__setattr__(self, "modules", tuple(self.modules))
    object.__setattr__(self, "ties", tuple(self.ties))
    for tie in self.ties:
      if not 0 <= tie.owner < tie.consumer < len(self.modules):
        raise ValueError(f"{tie}: the owner stage must come before the consumer stage")
    if len({tie.consumer for tie in self.ties}) < len(self.ties):
      raise ValueError("a stage can consume at most one tied array")
    if len({tie.owner for tie in self.ties}) < len(self.ties):
      raise ValueError("a stage can own at most one tied array")
    # Read once per stage and iteration on the hot path (`stage_input`): a lookup, not a scan.
    object.__setattr__(self, "_tie_by_consumer", {tie.consumer: tie for tie in self.ties})

  def tie_of(self, stage_idx: int) -> Tie | None:
    """The tie whose consumer is `stage_idx`, if any."""
    return self._tie_by_consumer.get(stage_idx)

  def stage_input(self, stage_idx: int, x: PyTree, read_params: Callable[[int], PyTree]) -> PyTree:
    """`x`, or `(x, tied array)` for a consumer stage, reading the owner's params now."""
    tie = self.tie_of(stage_idx)
    return x if tie is None else (x, tree_get(read_params(tie.owner), tie.path))

  @property
  def num_stages(self) -> int:
    return len(self.modules)

  def init(self, rng: jax.Array, x: jax.Array) -> tuple[list[PyTree], list[PyTree]]:
    """Per-stage params and state, built by passing an example batch through the stages."""
    params, state = [], []
    for stage_idx, module in enumerate(self.modules):
      init_rng, dropout_rng = jax.random.split(jax.random.fold_in(rng, stage_idx))
      kwargs = {"train": False} if _accepts_train(module) else {}
      x = self.stage_input(stage_idx, x, params.__getitem__)
      x, variables = module.init_with_output(
          {"params": init_rng, "dropout": dropout_rng}, x, **kwargs
      )
      variables = dict(variables)
      params.append(variables.pop("params", {}))
      state.append(variables)
    return params, state

  def apply_stage(
      self, stage_idx: int, params: PyTree, state: PyTree, x: PyTree, rng: jax.Array, train: bool
  ) -> tuple[PyTree, PyTree]:
    """The stage as a pure function: `(params, state, x, rng, train) -> (y, new_state)`."""
    return apply_module(self.modules[stage_idx], params, state, x, rng, train)

  def loss_stage(
      self, params: PyTree, state: PyTree, x: PyTree, labels: jax.Array, rng: jax.Array
  ) -> tuple[jax.Array, PyTree]:
    """The loss head in train mode: `(loss, new_state)`."""
    logits, new_state = self.apply_stage(self.num_stages - 1, params, state, x, rng, True)
    return self.loss_fn(logits, labels), new_state

  def apply(
      self,
      params: Sequence[PyTree],
      state: Sequence[PyTree],
      x: jax.Array,
      key: jax.Array,
      iteration: jax.Array,
      train: bool,
  ) -> tuple[jax.Array, list[PyTree]]:
    """All stages composed: `(logits, new_state)`. The fused reference for the staged step."""
    new_state = []
    for stage_idx in range(self.num_stages):
      rng = stage_rng(key, iteration, stage_idx)
      x = self.stage_input(stage_idx, x, params.__getitem__)
      x, stage_state = self.apply_stage(stage_idx, params[stage_idx], state[stage_idx], x, rng,
                                        train)
      new_state.append(stage_state)
    return x, new_state

  def loss(self, params, state, x, labels, key, iteration) -> tuple[jax.Array, list[PyTree]]:
    """Training loss of the composed model: `(loss, new_state)`."""
    logits, new_state = self.apply(params, state, x, key, iteration, train=True)
    return self.loss_fn(logits, labels), new_state


class Group(nn.Module):
  """Consecutive stage modules run as one stage (`group_stages`)."""

  parts: Sequence[nn.Module]

  def __call__(self, x, train: bool = True):
    for part in self.parts:
      x = part(x, train=train) if _accepts_train(part) else part(x)
    return x


def group_stages(model: StagedModel, per_group: int) -> StagedModel:
  """`model` with every `per_group` consecutive stages run as one stage, a tie's consumer always
  starting a group (it takes `(x, tied array)` as its input).

  Fewer stages mean fewer programs, hand-overs, sends and merges per iteration, so less host
  time per iteration (scripts/bench_host.py), and coarser layer-wise updates: a stage is what
  LayUp updates and sends as one. A part's params sit under `parts_<k>` of its group's params.
  """
  if per_group < 1:
    raise ValueError(f"per_group must be >= 1, got {per_group}")
  if per_group == 1:
    return model
  consumers = {tie.consumer for tie in model.ties}
  groups: list[list[int]] = []
  for s in range(model.num_stages):
    if not groups or len(groups[-1]) == per_group or s in consumers:
      groups.append([])
    groups[-1].append(s)
  group_of = {s: g for g, members in enumerate(groups) for s in members}
  ties = tuple(Tie(owner=group_of[t.owner], consumer=group_of[t.consumer],
                   path=(f"parts_{groups[group_of[t.owner]].index(t.owner)}", *t.path))
               for t in model.ties)
  modules = [Group(tuple(model.modules[s] for s in members)) for members in groups]
  return StagedModel(tuple(modules), model.loss_fn, ties)


@dataclasses.dataclass(frozen=True)
class StageSteps:
  """The jitted per-stage functions of one model; jit caches one executable per device.

  forward[s] (s < L-1): (params, state, x, stage_key, iteration) -> (y, new_state, vjp)
  loss:                 (params, state, x, labels, stage_key, iteration)
                        -> (loss, new_state, grads, dx)   (dx is None for a one-stage model)
  backward[s]:          (vjp, (params, x), dy) -> (grads, dx), given the stage's params and the
                        forward's input (its `vjp` holds no copy of them); stage 0 returns
                        (grads, None) so that XLA drops the unused input gradient.
  add_tied[s]:          (grads, tied_grad) -> grads, for the owner stage of a tie.
  read_tied[s]:         (owner's params) -> the tied array, for the consumer stage of a tie.
  backward_update[s]:   (vjp, (params, x), dy, opt_state, step, first_nonfinite, tied_grad)
                        -> (new params, new opt_state, first_nonfinite, dx): the backward and
                        the stage's local update in one program (with `update`; else empty),
                        so the gradient is never a separate array; `tied_grad` is None but
                        for a tie's owner. The Optax state is donated.
  loss_update:          (params, state, x, labels, stage_key, iteration, opt_state, step,
                        first_nonfinite) -> (loss, new_state, new params, new opt_state,
                        first_nonfinite, dx): the loss stage's forward, backward and update in
                        one program (with `update`).
  backward_update_mix[s], loss_update_mix (with `update` and `merge_state`): the same
                        programs with a peer's received stage mixed into the stage first
                        (`pushsum.merge`), so that no merge program of its own is needed:
                        backward_update_mix takes `(..., tied_grad, state, received,
                        receiver_share)` and also returns the stage's state (mixed where it
                        travels); loss_update_mix takes `(params, state, received,
                        receiver_share, ...)`. `received` is the peer's params, or
                        `(params, state)` where the stage's BatchNorm state travels
                        (`merge_state[s]`).
  forward_chain (with `chain_forwards`): (params, states, x, stage_keys, iteration) over the
                        stages before the loss stage (tuples) -> (the inputs of stages 1 ..,
                        the last one's output, new states, vjps): every forward of an iteration
                        in one program, the same functions composed, each stage's residuals
                        kept apart for its own backward.
  `vjp` is a `PackedResiduals`: with `packings` the VJP's arrays in one buffer per dtype.
  A consumer stage's `x` and `dx` are `(activation, tied array)` pairs. Stages whose modules are
  equal (the repeated blocks of a ResNet or GPT-2) share one jitted function, so each compiles
  once per device rather than once per stage. With `packings`, every stage's params (and so its
  gradients) are flat vectors (`layup_jax.packing`).
  """

  forward: tuple[Callable, ...]
  loss: Callable
  backward: tuple[Callable, ...]
  add_tied: dict[int, Callable]
  read_tied: dict[int, Callable] = dataclasses.field(default_factory=dict)
  backward_update: tuple[Callable, ...] = ()
  loss_update: Callable | None = None
  backward_update_mix: tuple[Callable, ...] = ()
  loss_update_mix: Callable | None = None
  forward_chain: Callable | None = None


def mix_received(params: PyTree, state: PyTree, received: PyTree, share: jax.Array,
                 merge_state: bool) -> tuple[PyTree, PyTree]:
  """Paper Algorithm 1's peer update (`pushsum.merge`) of a stage with a received one:
  `(params, state)`, the state mixed too where it travels (`merge_state`)."""
  if merge_state:
    return pushsum.merge((params, state), received, share)
  return pushsum.merge(params, received, share), state


def make_stage_steps(model: StagedModel, keep_finite_state: bool = False,
                     packings: Sequence[StagePacking] | None = None,
                     state_packings: Sequence[StagePacking | None] | None = None,
                     remat: str = "none", update: Callable | None = None,
                     merge_state: Sequence[bool] | None = None,
                     chain_forwards: bool = False) -> StageSteps:
  """The jitted per-stage functions; `keep_finite_state` keeps a stage's old BatchNorm
  statistics wherever a batch made the new ones non-finite (for skipped non-finite steps);
  `packings` (one per stage) makes them take and return flat params and gradients, and
  `state_packings` flat state (None for a stage without state); `remat` names what a forward
  keeps for its backward (`REMAT_POLICIES`); `update(params, opt_state, grads, step,
  first_nonfinite) -> (params, opt_state, first_nonfinite)`, a stage's local step, adds the
  fused `backward_update` and `loss_update` functions; `merge_state` (per stage: whether its
  BatchNorm state travels with a send) adds the `*_mix` functions; `chain_forwards` adds
  `forward_chain`, an iteration's forwards as one program (one launch instead of one per
  stage; each stage's backward, update and send stay its own)."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
  last = model.num_stages - 1
  guard_state = nonfinite.keep_finite if keep_finite_state else lambda new, old: new
  same = lambda tree: tree
  unpack = [p.unpack for p in packings] if packings else [same] * model.num_stages
  pack = [p.pack for p in packings] if packings else [same] * model.num_stages
  layouts = list(state_packings or [None] * model.num_stages)
  unpack_state = [p.unpack if p else same for p in layouts]
  pack_state = [p.pack if p else same for p in layouts]
  packed_up_to = None if packings else 0  # without packings residuals are only stripped
  policy = REMAT_POLICIES[remat]

  forwards: dict[Any, Callable] = {}

  def shared_forward(s):
    module = model.modules[s]
    try:
      key = (module, packings[s] if packings else None, layouts[s])
      if key not in forwards:
        forwards[key] = jax.jit(make_forward(s))
      return forwards[key]
    except TypeError:  # an unhashable module (say, one holding a list) gets its own function
      return jax.jit(make_forward(s))

  def make_forward(s):
    module, unpack_params = model.modules[s], unpack[s]
    unpack_st, pack_st = unpack_state[s], pack_state[s]

    def forward(params, state, x, key, iteration):
      rng = jax.random.fold_in(key, iteration)
      apply = lambda p, h: apply_module(module, unpack_params(p), unpack_st(state), h, rng, True)
      if policy is not None:
        apply = jax.checkpoint(apply, policy=policy)
      y, vjp, new_state = jax.vjp(apply, params, x, has_aux=True)
      residuals = pack_residuals(vjp, (params, x), packed_up_to)
      return y, guard_state(pack_st(new_state), state), residuals

    return forward

  def backward(vjp, inputs, dy):
    return unpack_residuals(vjp, inputs)(dy)

  def first_backward(vjp, inputs, dy):
    return unpack_residuals(vjp, inputs)(dy)[0], None  # XLA drops the unused input gradient

  def loss(params, state, x, labels, key, iteration):
    rng = jax.random.fold_in(key, iteration)
    argnums = (0,) if last == 0 else (0, 1)
    (value, new_state), grads = jax.value_and_grad(
        lambda p, h: model.loss_stage(unpack[last](p), unpack_state[last](state), h, labels,
                                      rng), argnums=argnums, has_aux=True
    )(params, x)
    return (value, guard_state(pack_state[last](new_state), state), grads[0],
            (grads[1] if last > 0 else None))

  def make_add_tied(tie):
    owner = tie.owner
    return jax.jit(lambda grads, tied_grad: pack[owner](
        tree_add_at(unpack[owner](grads), tie.path, tied_grad)))

  def make_read_tied(tie):
    return jax.jit(lambda params: tree_get(unpack[tie.owner](params), tie.path))

  def make_backward_update(s, mix):
    tie = next((t for t in model.ties if t.owner == s), None)

    def backward_update(vjp, inputs, dy, opt_state, step, first_nonfinite, tied_grad):
      grads, dx = unpack_residuals(vjp, inputs)(dy)
      if tie is not None:
        grads = pack[s](tree_add_at(unpack[s](grads), tie.path, tied_grad))
      params, opt_state, first_nonfinite = update(inputs[0], opt_state, grads, step,
                                                  first_nonfinite)
      return params, opt_state, first_nonfinite, (None if s == 0 else dx)

    def backward_update_mix(vjp, inputs, dy, opt_state, step, first_nonfinite, tied_grad,
                            state, received, share):
      params, state = mix_received(inputs[0], state, received, share, merge_state[s])
      return (*backward_update(vjp, (params, inputs[1]), dy, opt_state, step, first_nonfinite,
                               tied_grad), state)

    if mix:
      return jax.jit(backward_update_mix, donate_argnums=(3,))
    return jax.jit(backward_update, donate_argnums=(3,))

  fused: dict[tuple, Callable] = {}

  def shared_backward_update(s, mix: bool = False):  # one for every stage but the first and
    key = (s == 0, s if any(t.owner == s for t in model.ties) else None,  # tie owners
           mix, mix and merge_state[s])
    if key not in fused:
      fused[key] = make_backward_update(s, mix)
    return fused[key]

  def loss_update(params, state, x, labels, key, iteration, opt_state, step, first_nonfinite):
    value, new_state, grads, dx = loss(params, state, x, labels, key, iteration)
    params, opt_state, first_nonfinite = update(params, opt_state, grads, step, first_nonfinite)
    return value, new_state, params, opt_state, first_nonfinite, dx

  def loss_update_mix(params, state, received, share, *rest):
    return loss_update(*mix_received(params, state, received, share, merge_state[last]), *rest)

  chained = [make_forward(s) for s in range(last)] if chain_forwards and last > 0 else []

  def forward_chain(params, states, x, keys, iteration):
    inputs, new_states, residuals = [], [], []
    for s, forward in enumerate(chained):
      if s > 0:
        x = model.stage_input(s, x, lambda owner: unpack[owner](params[owner]))
        inputs.append(x)
      x, new_state, vjp = forward(params[s], states[s], x, keys[s], iteration)
      new_states.append(new_state)
      residuals.append(vjp)
    return tuple(inputs), x, tuple(new_states), tuple(residuals)

  mixes = merge_state is not None
  backward_jit, first_backward_jit = jax.jit(backward), jax.jit(first_backward)
  return StageSteps(
      backward_update=(tuple(shared_backward_update(s) for s in range(last)) if update
                       else ()),
      forward=tuple(shared_forward(s) for s in range(last)),
      loss=jax.jit(loss),
      loss_update=jax.jit(loss_update, donate_argnums=(6,)) if update else None,
      backward_update_mix=(tuple(shared_backward_update(s, mix=True) for s in range(last))
                           if mixes and update else ()),
      loss_update_mix=(jax.jit(loss_update_mix, donate_argnums=(8,)) if mixes and update
                       else None),
      backward=tuple(first_backward_jit if s == 0 else backward_jit for s in range(last)),
      add_tied={tie.owner: make_add_tied(tie) for tie in model.ties},
      read_tied=({tie.consumer: make_read_tied(tie) for tie in model.ties} if packings else {}),
      forward_chain=jax.jit(forward_chain) if chained else None,
  )


class StageOps(Protocol):
  """One device's stage programs as `staged_pass` dispatches them: the runtime's replica store
  makes each an atomic read-dispatch-store of the device's replica (`DeviceStages` in
  layup_jax/replicas.py); `FixedStages` runs them on given params."""

  def read(self, s: int) -> PyTree:
    """Stage s's params as they are now."""

  def forward(self, s: int, x: PyTree, key: jax.Array, iteration: jax.Array) -> tuple:
    """Stage s's forward (its new BatchNorm state stored): `(y, vjp)`."""

  def forward_chain(self, x: PyTree, keys: Sequence[jax.Array], iteration: jax.Array) -> tuple:
    """Every stage's forward before the loss stage in one program (`StageSteps.forward_chain`;
    the new BatchNorm states stored): `(each stage's input, the last one's output, vjps)`."""

  def loss(self, x: PyTree, labels: jax.Array, key: jax.Array, iteration: jax.Array) -> tuple:
    """The loss stage: `(loss, its gradient or its updated params, dx)`."""

  def backward(self, s: int, vjp: PyTree, x: PyTree, dy: PyTree,
               tied_grad: PyTree | None) -> tuple:
    """Stage s's backward (with a tie owner's `tied_grad` added): `(its gradient or its
    updated params, dx)`."""


def staged_pass(model: StagedModel, steps: StageSteps, ops: StageOps, x: jax.Array,
                labels: jax.Array, stage_keys: Sequence[jax.Array], iteration: jax.Array,
                emit: Callable[[int, PyTree], None],
                on_stage: Callable[[int], None] = lambda stage_idx: None):
  """One forward and backward pass, dispatched stage by stage (paper Algorithm 1, compute side).

  Each stage's params are read when its forward and its backward are dispatched, so each uses
  the freshest ones (the paper's "backward pass on different weights", Section 6.1). `emit(s,
  out)` is called as soon as stage s's backward is dispatched, last stage first, with what
  `ops` returned for it (its gradient, or its updated params where `ops` applies the local
  update in the backward's program); `stage_keys[s]` is `stage_key(key, s)`. Returns `(loss,
  stage 0's out)`.
  """
  last = model.num_stages - 1
  vjps, inputs = [], []

  def stage_input(s: int, x: PyTree) -> PyTree:
    if s in steps.read_tied:  # packed params: the tied array is cut out on the device
      return x, steps.read_tied[s](ops.read(model.tie_of(s).owner))
    return model.stage_input(s, x, ops.read)

  if steps.forward_chain is not None:  # one program; its stages' inputs kept as in the loop
    on_stage(0)
    inputs, x, vjps = ops.forward_chain(x, stage_keys[:last], iteration)
  for s in range(len(vjps), last):
    on_stage(s)
    x_in = stage_input(s, x)
    x, vjp = ops.forward(s, x_in, stage_keys[s], iteration)
    vjps.append(vjp)
    inputs.append(x_in)  # given to its backward again: the residuals hold no copy
  on_stage(last)
  loss, out, dx = ops.loss(stage_input(last, x), labels, stage_keys[last], iteration)
  tied_grads = {}
  for s in reversed(range(last + 1)):
    if s < last:
      on_stage(s)
      out, dx = ops.backward(s, vjps[s], inputs[s], dx, tied_grads.pop(s, None))
      vjps[s] = inputs[s] = None  # drop the residuals as soon as they are used
    tie = model.tie_of(s)
    if tie is not None:
      dx, tied_grads[tie.owner] = dx
    emit(s, out)
  return loss, out


@dataclasses.dataclass
class FixedStages:
  """`StageOps` on given per-stage params (never changed) and states (replaced as the
  forwards compute new ones): gradients, no updates."""

  steps: StageSteps
  params: Sequence[PyTree]
  states: list[PyTree]

  def read(self, s):
    return self.params[s]

  def forward(self, s, x, key, iteration):
    y, self.states[s], vjp = self.steps.forward[s](self.params[s], self.states[s], x, key,
                                                   iteration)
    return y, vjp

  def forward_chain(self, x, keys, iteration):
    last = len(self.params) - 1
    inputs, y, self.states[:last], vjps = chain_forwards(self.steps, self.params[:last],
                                                         self.states[:last], x, keys, iteration)
    return inputs, y, vjps

  def loss(self, x, labels, key, iteration):
    last = len(self.params) - 1
    value, self.states[last], grads, dx = self.steps.loss(self.params[last], self.states[last],
                                                          x, labels, key, iteration)
    return value, grads, dx

  def backward(self, s, vjp, x, dy, tied_grad):
    return backward_grads(self.steps, s, vjp, self.params[s], x, dy, tied_grad)


def chain_forwards(steps: StageSteps, params: Sequence[PyTree], states: Sequence[PyTree], x,
                   keys: Sequence[jax.Array], iteration) -> tuple[list, PyTree, list, list]:
  """`steps.forward_chain` on the stages before the loss stage: (each stage's input, stage 0's
  being `x`; the last one's output; the new states; the vjps), as lists."""
  inputs, y, new_states, vjps = steps.forward_chain(tuple(params), tuple(states), x,
                                                    tuple(keys), iteration)
  return [x, *inputs], y, list(new_states), list(vjps)


def backward_grads(steps: StageSteps, s: int, vjp, params: PyTree, x, dy, tied_grad):
  """Stage s's backward without an update: (its gradient, with a tied parameter's gradient
  from another stage added, and the gradient of its input)."""
  grads, dx = steps.backward[s](vjp, (params, x), dy)
  if tied_grad is not None:
    grads = steps.add_tied[s](grads, tied_grad)
  return grads, dx


def staged_value_and_grad(model: StagedModel, steps: StageSteps, params, state, x, labels, key,
                          iteration):
  """One staged forward and backward pass on fixed params, on the calling thread.

  Returns `(loss, grads per stage, new state per stage)`: the reference that tests compare with
  `jax.grad` of the composed model.
  """
  grads, ops = [None] * model.num_stages, FixedStages(steps, params, list(state))
  keys = [stage_key(key, s) for s in range(model.num_stages)]
  loss, _ = staged_pass(model, steps, ops, x, labels, keys, iteration, grads.__setitem__)
  return loss, grads, ops.states
