"""The staged-model API: a model as an ordered list of Flax modules, each a stage.

A stage is `(params, state, x, rng, train) -> (y, new_state)`; `state` holds mutable collections
such as BatchNorm's `batch_stats`. The last stage is the loss head: its module's output and the
labels go through `loss_fn`. LayUp updates and sends each stage as one layer (paper Algorithm 1's
l). Bring your own model by building a `StagedModel` from your modules (docs/guide/your_model.md);
`group_stages` runs consecutive stages as one, and a `Tie` shares one array between two stages
(GPT-2's embedding and output projection).
"""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.nnx import bridge

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]
# (outputs, targets) -> one value per sample, or per sample and position (averaged over them)
MetricFn = Callable[[jax.Array, jax.Array], jax.Array]


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy of integer labels, over samples (and tokens, for sequences)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


def _accepts_train(module: nn.Module) -> bool:
  """Whether the module's call takes `train`; an NNX module wrapped by `nnx.bridge.to_linen`
  passes its keywords through, so its own class's `__call__` decides."""
  call = type(module).__call__
  if isinstance(module, bridge.ToLinen):
    call = module.nnx_class.__call__
  return "train" in inspect.signature(call).parameters


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
  no `train`); dropout reads the `"dropout"` rng stream. A `flax.nnx` module enters as
  `nnx.bridge.to_linen(Class, *args)`. `metrics` names the evaluation's own measures beside
  cross-entropy and argmax accuracy: `fn(outputs, targets)` gives one value per sample (or per
  sample and position, averaged over positions), and the test records hold its mean over the
  test set under its name.
  """

  modules: tuple[nn.Module, ...]
  loss_fn: LossFn = softmax_cross_entropy
  ties: tuple[Tie, ...] = ()
  metrics: tuple[tuple[str, MetricFn], ...] = ()  # a dict is accepted and kept as its items

  def __post_init__(self):
    if not self.modules:
      raise ValueError("a StagedModel needs at least one module")
    object.__setattr__(self, "modules", tuple(self.modules))
    object.__setattr__(self, "ties", tuple(self.ties))
    metrics = self.metrics.items() if isinstance(self.metrics, dict) else self.metrics
    object.__setattr__(self, "metrics", tuple((str(name), fn) for name, fn in metrics))
    reserved = {"loss", "accuracy", "perplexity", "consensus_distance"}
    for name, _ in self.metrics:
      if name in reserved or name.startswith(("device0_", "running_statistics_")):
        raise ValueError(f"metric name {name!r} is taken by the evaluation's own measures")
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
  return StagedModel(tuple(modules), model.loss_fn, ties, model.metrics)
