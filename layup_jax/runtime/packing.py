"""One flat buffer per stage: how the LayUp runtime stores a stage's params and optimizer state.

A stage's params are a pytree of a few to a few hundred arrays. Every jitted call and every
`device_put` pays a fixed cost per array (an argument to pass, an output buffer and Python
object to create, a small kernel to launch), and LayUp makes several such calls per stage per
iteration: the optimizer step, the send and the peer's merge. Kept as one flat vector, a stage
costs one array in each of them, as PyTorch FSDP's flat parameters do. The stage functions
unpack the vector inside their jitted bodies, where slicing and reshaping are free, so the
gradient of a packed stage comes out packed (each leaf's gradient written into its place). The
optimizers used here (SGD, Adam, AdamW, global norm clipping) act elementwise or on the global
norm, so a step on the packed vector equals the step on the pytree.

A stage's forward returns its VJP, whose residuals (the activations the backward pass needs)
are tens of arrays per stage; `pack_residuals` stores them as one buffer per dtype, so that the
forward returns, and the backward takes, a few arrays instead (`StageSteps` with `packings`).
Packing copies them, which pays only while they are small: stages whose residuals exceed
`RESIDUALS_PACKED_UP_TO` bytes keep them as they are. Residuals that are the forward's own
inputs (its params, its input activation) are never copied: jit would return a copy of an
input, so they are left out and the backward is given them again.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
# Up to this size a stage's residuals are packed: copying 1 MiB costs about what a few tens of
# extra arrays cost per call on a CPU, and far less on a GPU.
RESIDUALS_PACKED_UP_TO = 1 << 20


@dataclasses.dataclass(frozen=True)
class StagePacking:
  """The layout of one stage's params in its flat vector (hashable: stages of equal layout
  share their jitted functions)."""

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]

  @classmethod
  def of(cls, tree: PyTree) -> "StagePacking":
    leaves, treedef = jax.tree.flatten(tree)
    return cls(treedef, tuple(tuple(leaf.shape) for leaf in leaves),
               tuple(np.dtype(leaf.dtype) for leaf in leaves))

  @property
  def dtype(self) -> np.dtype:
    """The vector's dtype: every leaf's dtype promoted (float32 for a stage without params)."""
    return np.dtype(jnp.result_type(*self.dtypes)) if self.dtypes else np.dtype(np.float32)

  @property
  def size(self) -> int:
    return sum(math.prod(shape) for shape in self.shapes)

  def pack(self, tree: PyTree) -> jax.Array:
    """The flat vector of `tree` (pure: usable inside jit)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
      return jnp.zeros((0,), self.dtype)
    return jnp.concatenate([jnp.ravel(leaf).astype(self.dtype) for leaf in leaves])

  @property
  def starts(self) -> tuple[int, ...]:
    """Where each leaf begins in the vector."""
    return tuple(int(x) for x in np.cumsum([0] + [math.prod(s) for s in self.shapes])[:-1])

  def unpack(self, flat: jax.Array) -> PyTree:
    """The pytree of the flat vector `flat` (pure: usable inside jit; see `_cut` for its
    gradient)."""
    return jax.tree.unflatten(self.treedef, _cut(self, flat))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cut(packing: StagePacking, flat: jax.Array) -> list[jax.Array]:
  """The leaves of `flat`, one slice each.

  Its gradient writes each leaf's gradient into one zero vector (dynamic-update-slice, done in
  place by XLA). Left to autodiff, each slice's gradient is a zero-padded copy of the whole
  vector, summed over the leaves: leaves x size work in every backward pass of a packed stage
  (GPT-2 tiny's block backwards spent a third more kernel time than with pytrees). A
  concatenation of the leaves' gradients (the gradient of `jnp.split`) is as fast on small
  stages, slower on ResNet-18's, where it copies every conv kernel's gradient once more.
  """
  return [flat[start:start + math.prod(shape)].reshape(shape).astype(dtype)
          for start, shape, dtype in zip(packing.starts, packing.shapes, packing.dtypes)]


def _cut_forward(packing: StagePacking, flat: jax.Array):
  return _cut(packing, flat), None


def _cut_backward(packing: StagePacking, _, leaf_grads: list[jax.Array]):
  grad = jnp.zeros((packing.size,), packing.dtype)
  for start, leaf_grad in zip(packing.starts, leaf_grads):
    grad = jax.lax.dynamic_update_slice(grad, jnp.ravel(leaf_grad).astype(packing.dtype),
                                        (start,))
  return (grad,)


_cut.defvjp(_cut_forward, _cut_backward)


@jax.tree_util.register_pytree_node_class
class PackedResiduals:
  """A stage's VJP with its arrays in one flat buffer per dtype; the layout is static."""

  def __init__(self, buffers: tuple[jax.Array, ...], layout: tuple):
    self.buffers, self.layout = buffers, layout

  def tree_flatten(self):
    return self.buffers, self.layout

  @classmethod
  def tree_unflatten(cls, layout, buffers):
    return cls(tuple(buffers), layout)


def _packable(dtype) -> bool:
  return jnp.issubdtype(dtype, np.number) or jnp.issubdtype(dtype, np.bool_)


def pack_residuals(vjp: PyTree, inputs: PyTree = (),
                   packed_up_to: int | None = None) -> PackedResiduals:
  """`vjp`'s arrays concatenated per dtype (inside jit; PRNG keys and the like stay as they
  are, one buffer each), or all kept as they are when they exceed `packed_up_to` bytes (default
  `RESIDUALS_PACKED_UP_TO`). Arrays that are leaves of `inputs` are left out: pass the same
  `inputs` to `unpack_residuals`."""
  limit = RESIDUALS_PACKED_UP_TO if packed_up_to is None else packed_up_to
  leaves, treedef = jax.tree.flatten(vjp)
  input_leaves = jax.tree.leaves(inputs)
  given = [next((k for k, x in enumerate(input_leaves) if leaf is x), None) for leaf in leaves]
  kept = [leaf for leaf, k in zip(leaves, given) if k is None]
  size = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in kept
             if _packable(leaf.dtype))
  packed = size <= limit
  group_of = lambda leaf: np.dtype(leaf.dtype) if packed and _packable(leaf.dtype) else None
  groups = sorted({group_of(leaf) for leaf in kept} - {None}, key=str)
  buffers = [jnp.concatenate([jnp.ravel(leaf) for leaf in kept if group_of(leaf) == dtype])
             for dtype in groups]
  others = [leaf for leaf in kept if group_of(leaf) is None]
  slots = tuple(("input", k) if k is not None else
                (None if group_of(leaf) is None else groups.index(group_of(leaf)),
                 tuple(leaf.shape)) for leaf, k in zip(leaves, given))
  return PackedResiduals(tuple(buffers + others), (treedef, len(groups), slots))


def unpack_residuals(packed: PackedResiduals, inputs: PyTree = ()) -> PyTree:
  """The VJP `pack_residuals` packed (inside jit), given the same `inputs`."""
  treedef, num_groups, slots = packed.layout
  input_leaves = jax.tree.leaves(inputs)
  offsets = [0] * num_groups
  others = iter(packed.buffers[num_groups:])
  leaves = []
  for group, shape in slots:
    if group == "input":
      leaves.append(input_leaves[shape])
    elif group is None:
      leaves.append(next(others))
    else:
      size = math.prod(shape)
      leaves.append(packed.buffers[group][offsets[group]:offsets[group] + size].reshape(shape))
      offsets[group] += size
  return jax.tree.unflatten(treedef, leaves)
