"""A staged model's jitted per-stage programs: the pure functions the runtime dispatches.

LayUp dispatches one jitted forward per stage that returns the activation *and* the stage's VJP
(so the backward pass never recomputes the forward), then one jitted VJP per stage in reverse
order; with the local update fused, each stage's backward program also applies the stage's
Optax step (`local_update`, paper Algorithm 1's local update) and mixes in a peer's stage that
waits for it (`mix_received`, the peer update). Everything here is a pure function of arrays;
non-finite checks are device scalars computed inside the programs, so detecting a NaN costs no
host sync (the runtime reads them one iteration later, runtime/stats.py `FiniteChecks`).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from layup_jax.models.staged import StagedModel, apply_module, tree_add_at, tree_get
from layup_jax.pushsum import mixing
from layup_jax.runtime.packing import StagePacking, pack_residuals, unpack_residuals

PyTree = Any
# What a stage's forward keeps for its backward (`tuning.remat`): "none" keeps every residual the
# VJP asks for; "dots" only the outputs of matrix multiplications and convolutions, the
# elementwise work (normalization, activations) being recomputed in the backward; "full" only
# the stage's input, the whole stage being recomputed.
REMAT_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}



def all_finite(tree: PyTree) -> jax.Array:
  """True iff every element of every floating leaf of `tree` is finite (True for no leaves)."""
  checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def select(keep_new: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """`new` where `keep_new` holds, else `old` (whole trees, one scalar predicate)."""
  return jax.tree.map(lambda n, o: jnp.where(keep_new, n, o), new, old)


def keep_finite(new: PyTree, old: PyTree) -> PyTree:
  """`new` element by element, except where it is not finite: there `old` (BatchNorm statistics
  of a batch that held a NaN stay as they were)."""
  def pick(n, o):
    if not jnp.issubdtype(n.dtype, jnp.inexact):
      return n
    return jnp.where(jnp.isfinite(n), n, o)
  return jax.tree.map(pick, new, old)


def halves(tree: PyTree) -> PyTree:
  """Each leaf's leading (batch) axis cut in two: `(B, ...)` -> `(2, B / 2, ...)`."""
  return jax.tree.map(lambda a: a.reshape(2, a.shape[0] // 2, *a.shape[1:]), tree)


def whole(tree: PyTree) -> PyTree:
  """`halves` undone: `(2, B / 2, ...)` -> `(B, ...)`."""
  return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def twice(tree: PyTree) -> PyTree:
  """Each leaf stacked twice, `(2, ...)`: params seen by both halves of a batch."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (2, *a.shape)), tree)


def halves_sum_and_noise(grads: PyTree) -> tuple[PyTree, PyTree]:
  """From a stage's gradient as its batch's two halves contributed it, `(2, ...)` (each half's
  mean-loss gradient over 2, so that they sum to the batch's): the batch's gradient, and
  `(g_a - g_b)^2 / 4` per coordinate, `g_a`, `g_b` the halves' own gradients, an unbiased
  estimate of the variance of the batch's gradient (layup_jax/optim.py
  `scale_by_adam_of_mean`)."""
  return (jax.tree.map(lambda g: g[0] + g[1], grads),
          jax.tree.map(lambda g: jnp.square(g[0] - g[1]), grads))


def mean_of_halves(state: PyTree) -> PyTree:
  """A stage's new state from its two halves' (BatchNorm statistics: their mean)."""
  return jax.tree.map(lambda a: a.mean(0).astype(a.dtype)
                      if jnp.issubdtype(a.dtype, jnp.inexact) else a[0], state)


def local_update(tx: optax.GradientTransformation, params, opt_state, grads, step: jax.Array,
                 first_nonfinite: jax.Array | None = None, scale: jax.Array | None = None,
                 skip_nonfinite: bool = False, by_halves: bool = False):
  """One Optax step of one stage: `(new_params, new_opt_state, first_nonfinite)`.

  With `by_halves`, `grads` is the stage's gradient as the two halves of its batch contributed
  it, `(2, ...)` (`make_stage_steps(by_halves=True)`): the step takes their sum, and their
  difference as `noise=` (`halves_sum_and_noise`; layup_jax/optim.py `scale_by_adam_of_mean`).

  `scale` multiplies the step's update (None: 1): LayUp's numerator form of the local update
  (`layup.local_update`) scales it by the device's equal share over its push-sum weight, so that
  every device's gradient counts alike in the push-sum average (`pushsum.mixing.PushSumWeights
  .update_scale`).

  `step` is the run's global step when the gradient's iteration began; it reaches every
  transformation that takes a `step` extra argument (layup_jax/optim.py's learning-rate
  schedule). `first_nonfinite` follows the updates of one iteration in the order they are
  applied, so that the host reads one scalar per iteration rather than a flag per stage:
  `-(n + 1)` while the n gradients so far were finite (start with -1, the default), else the
  position n of the first non-finite one. With `skip_nonfinite`, a non-finite gradient leaves
  params and optimizer state as they were.
  """
  extra = {}
  if by_halves:
    grads, extra["noise"] = halves_sum_and_noise(grads)
  finite = all_finite(grads)
  updates, new_opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params,
                                                                     step=step, **extra)
  if scale is not None:
    updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
  new_params = optax.apply_updates(params, updates)
  if skip_nonfinite:
    new_params, new_opt_state = select(finite, (new_params, new_opt_state),
                                                 (params, opt_state))
  so_far = jnp.int32(-1) if first_nonfinite is None else first_nonfinite
  first_nonfinite = jnp.where(so_far >= 0, so_far,
                              jnp.where(finite, so_far - 1, -so_far - 1)).astype(jnp.int32)
  return new_params, new_opt_state, first_nonfinite


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
  backward_update[s]:   (vjp, (params, x), dy, opt_state, step, first_nonfinite, scale,
                        tied_grad)
                        -> (new params, new opt_state, first_nonfinite, dx): the backward and
                        the stage's local update in one program (with `update`; else empty),
                        so the gradient is never a separate array; `tied_grad` is None but
                        for a tie's owner. The Optax state is donated.
  loss_update:          (params, state, x, labels, stage_key, iteration, opt_state, step,
                        first_nonfinite, scale) -> (loss, new_state, new params, new opt_state,
                        first_nonfinite, dx): the loss stage's forward, backward and update in
                        one program (with `update`).
  backward_update_mix[s], loss_update_mix (with `update` and `merge_state`): the same
                        programs with a peer's received stage mixed into the stage first
                        (`mixing.merge`), so that no merge program of its own is needed:
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
  gradients) are flat vectors (`layup_jax.runtime.packing`).
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
  """Paper Algorithm 1's peer update (`mixing.merge`) of a stage with a received one:
  `(params, state)`, the state mixed too where it travels (`merge_state`)."""
  if merge_state:
    return mixing.merge((params, state), received, share)
  return mixing.merge(params, received, share), state


def make_stage_steps(model: StagedModel, keep_finite_state: bool = False,
                     packings: Sequence[StagePacking] | None = None,
                     state_packings: Sequence[StagePacking | None] | None = None,
                     remat: str = "none", update: Callable | None = None,
                     merge_state: Sequence[bool] | None = None,
                     chain_forwards: bool = False, by_halves: bool = False) -> StageSteps:
  """The jitted per-stage functions; `keep_finite_state` keeps a stage's old BatchNorm
  statistics wherever a batch made the new ones non-finite (for skipped non-finite steps);
  `packings` (one per stage) makes them take and return flat params and gradients, and
  `state_packings` flat state (None for a stage without state); `remat` names what a forward
  keeps for its backward (`REMAT_POLICIES`); `update(params, opt_state, grads, step,
  first_nonfinite, scale) -> (params, opt_state, first_nonfinite)`, a stage's local step
  (`local_update`; `scale` multiplies its update), adds the
  fused `backward_update` and `loss_update` functions; `merge_state` (per stage: whether its
  BatchNorm state travels with a send) adds the `*_mix` functions; `chain_forwards` adds
  `forward_chain`, an iteration's forwards as one program (one launch instead of one per
  stage; each stage's backward, update and send stay its own); `by_halves` runs each stage on
  the two halves of its batch side by side (one program, the same work) and returns every
  gradient as the halves contributed it, `(2, ...)`, for an update that measures its
  gradient's noise (`local_update(by_halves=True)`): a tied array is seen by both halves whole,
  BatchNorm normalizes each half by its own statistics and keeps their mean, and the halves
  draw their dropout apart."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
  last = model.num_stages - 1
  guard_state = keep_finite if keep_finite_state else lambda new, old: new
  same = lambda tree: tree
  unpack = [p.unpack for p in packings] if packings else [same] * model.num_stages
  pack = [p.pack for p in packings] if packings else [same] * model.num_stages
  layouts = list(state_packings or [None] * model.num_stages)
  unpack_state = [p.unpack if p else same for p in layouts]
  pack_state = [p.pack if p else same for p in layouts]
  packed_up_to = None if packings else 0  # without packings residuals are only stripped
  policy = REMAT_POLICIES[remat]

  def halves_inputs(s, params, x):
    """A stage's `(params, input)` as its halves see them: the params and a tied array whole
    (`twice`), the activation cut in two."""
    if model.tie_of(s) is None:
      return twice(params), halves(x)
    return twice(params), (halves(x[0]), twice(x[1]))

  def whole_input_grad(s, dx):
    """The halves' input gradient as the previous stage (and a tie's owner) takes it: the
    activation's whole, a tied array's per half."""
    if model.tie_of(s) is None:
      return whole(dx)
    return whole(dx[0]), dx[1]

  def on_halves(apply_one):
    """`apply_one(p, h, rng) -> (y, new_state)` on both halves at once, from `halves_inputs`:
    `(y per half, the halves' mean state)`."""
    def apply(p2, h2, rng):
      y2, states = jax.vmap(apply_one)(p2, h2, jax.random.split(rng))
      return y2, mean_of_halves(states)
    return apply

  def stage_vjp(s, vjp, inputs, dy):
    """Stage s's `(grads, dx)` from its forward's residuals (per half under `by_halves`)."""
    if not by_halves:
      return unpack_residuals(vjp, inputs)(dy)
    grads, dx = unpack_residuals(vjp, halves_inputs(s, *inputs))(halves(dy))
    return grads, whole_input_grad(s, dx)

  def add_tied_grad(s, grads, tied_grad):
    add = lambda g, t: pack[s](tree_add_at(unpack[s](g), tie_path[s], t))
    return jax.vmap(add)(grads, tied_grad) if by_halves else add(grads, tied_grad)

  tie_path = {tie.owner: tie.path for tie in model.ties}

  forwards: dict[Any, Callable] = {}

  def shared_forward(s):
    module = model.modules[s]
    try:
      key = (module, packings[s] if packings else None, layouts[s],
             by_halves and model.tie_of(s) is not None)
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
      apply_one = lambda p, h, r: apply_module(module, unpack_params(p), unpack_st(state), h, r,
                                               True)
      if policy is not None:
        apply_one = jax.checkpoint(apply_one, policy=policy)
      if by_halves:
        inputs, apply = halves_inputs(s, params, x), on_halves(apply_one)
      else:
        inputs, apply = (params, x), apply_one
      y, vjp, new_state = jax.vjp(lambda p, h: apply(p, h, rng), *inputs, has_aux=True)
      residuals = pack_residuals(vjp, inputs, packed_up_to)
      return (whole(y) if by_halves else y), guard_state(pack_st(new_state), state), residuals

    return forward

  def make_backward(s):
    if s == 0:  # XLA drops the unused input gradient
      return lambda vjp, inputs, dy: (stage_vjp(s, vjp, inputs, dy)[0], None)
    return lambda vjp, inputs, dy: stage_vjp(s, vjp, inputs, dy)

  backwards: dict[tuple, Callable] = {}

  def shared_backward(s):  # one for stage 0, one for a tie's consumer, one for the others
    key = (s == 0, by_halves and model.tie_of(s) is not None)
    if key not in backwards:
      backwards[key] = jax.jit(make_backward(s))
    return backwards[key]

  def loss(params, state, x, labels, key, iteration):
    rng = jax.random.fold_in(key, iteration)
    argnums = (0,) if last == 0 else (0, 1)
    loss_one = lambda p, h, y, r: model.loss_stage(unpack[last](p), unpack_state[last](state),
                                                   h, y, r)
    if by_halves:
      def value_of(p2, h2):
        values, states = jax.vmap(loss_one)(p2, h2, halves(labels), jax.random.split(rng))
        return values.mean(), mean_of_halves(states)
      inputs = halves_inputs(last, params, x)
    else:
      value_of, inputs = (lambda p, h: loss_one(p, h, labels, rng)), (params, x)
    (value, new_state), grads = jax.value_and_grad(value_of, argnums=argnums,
                                                   has_aux=True)(*inputs)
    dx = None
    if last > 0:
      dx = whole_input_grad(last, grads[1]) if by_halves else grads[1]
    return value, guard_state(pack_state[last](new_state), state), grads[0], dx

  def make_add_tied(tie):
    return jax.jit(lambda grads, tied_grad: add_tied_grad(tie.owner, grads, tied_grad))

  def make_read_tied(tie):
    return jax.jit(lambda params: tree_get(unpack[tie.owner](params), tie.path))

  def make_backward_update(s, mix):
    tie = next((t for t in model.ties if t.owner == s), None)

    def backward_update(vjp, inputs, dy, opt_state, step, first_nonfinite, scale, tied_grad):
      grads, dx = stage_vjp(s, vjp, inputs, dy)
      if tie is not None:
        grads = add_tied_grad(s, grads, tied_grad)
      params, opt_state, first_nonfinite = update(inputs[0], opt_state, grads, step,
                                                  first_nonfinite, scale)
      return params, opt_state, first_nonfinite, (None if s == 0 else dx)

    def backward_update_mix(vjp, inputs, dy, opt_state, step, first_nonfinite, scale, tied_grad,
                            state, received, share):
      params, state = mix_received(inputs[0], state, received, share, merge_state[s])
      return (*backward_update(vjp, (params, inputs[1]), dy, opt_state, step, first_nonfinite,
                               scale, tied_grad), state)

    if mix:
      return jax.jit(backward_update_mix, donate_argnums=(3,))
    return jax.jit(backward_update, donate_argnums=(3,))

  fused: dict[tuple, Callable] = {}

  def shared_backward_update(s, mix: bool = False):  # one for every stage but the first and
    key = (s == 0, s if any(t.owner == s for t in model.ties) else None,  # tie owners
           mix, mix and merge_state[s], by_halves and model.tie_of(s) is not None)
    if key not in fused:
      fused[key] = make_backward_update(s, mix)
    return fused[key]

  def loss_update(params, state, x, labels, key, iteration, opt_state, step, first_nonfinite,
                  scale):
    value, new_state, grads, dx = loss(params, state, x, labels, key, iteration)
    params, opt_state, first_nonfinite = update(params, opt_state, grads, step, first_nonfinite,
                                                scale)
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
      backward=tuple(shared_backward(s) for s in range(last)),
      add_tied={tie.owner: make_add_tied(tie) for tie in model.ties},
      read_tied=({tie.consumer: make_read_tied(tie) for tie in model.ties} if packings else {}),
      forward_chain=jax.jit(forward_chain) if chained else None,
  )
