"""Copies of arrays onto one device, at the least host cost jax allows.

The LayUp runtime copies every stage it sends to a peer, and every batch to its device, tens of
times per iteration across its threads. `jax.device_put` spends most of its time in a Python
layer that accepts every kind of input (pytrees of shardings, layouts, memory kinds); an array
copied onto one device needs none of it. `to_device` calls jax's internal transfer once per
array instead (on jax 0.10, CPU: about 10 us per array against 35 us for `jax.device_put`),
after checking once that it gives what `jax.device_put` gives; where that internal function is
missing or differs (another jax version), `to_device` is `jax.device_put`.

`to_devices` copies several trees of device arrays, each to its own device, in one call
(`batched_copy_array_to_devices_with_sharding`, what `jax.device_put` itself uses for a list):
the sends of an iteration that are ready together cross into XLA once. It too is checked once
against `jax.device_put`, and is one `to_device` per tree where the call is missing or differs.
"""

import functools
from typing import Any

import jax
import numpy as np

try:
  from jax._src import core as _core
  from jax._src.interpreters.pxla import batched_device_put as _batched_device_put
except ImportError:  # a jax without them: the public function
  _batched_device_put = None
try:
  from jax._src.lib import xla_client as _xc

  _copy_arrays = _xc.batched_copy_array_to_devices_with_sharding
  _ALWAYS_COPY = _xc.ArrayCopySemantics.ALWAYS_COPY
except (ImportError, AttributeError):  # a jax without it: one copy per tree
  _copy_arrays = None

PyTree = Any


def public(tree: PyTree, device: jax.Device) -> PyTree:
  return jax.device_put(tree, device)


def _direct(tree: PyTree, device: jax.Device) -> PyTree:
  sharding = jax.sharding.SingleDeviceSharding(device)

  def copy(x):
    if isinstance(x, jax.Array):
      aval = x.aval
    else:
      x = np.asarray(x)
      aval = _core.ShapedArray(x.shape, x.dtype)
    return _batched_device_put(aval, sharding, [x], [device])

  return jax.tree.map(copy, tree)


@functools.cache
def implementation():
  """`_direct` if it copies a device array and host arrays as `jax.device_put` does, else
  `public` (decided once, on first use: the check needs the devices)."""
  if _batched_device_put is None:
    return public
  devices = jax.devices()
  examples = (jax.device_put(np.arange(3, dtype=np.float32), devices[0]),
              np.arange(6, dtype=np.int32).reshape(2, 3), np.int32(7))
  try:
    for x in examples:
      want, got = jax.device_put(x, devices[-1]), _direct(x, devices[-1])
      if (type(got) is not type(want) or got.devices() != want.devices()
          or got.aval != want.aval or not np.array_equal(got, want)):
        return public
  except Exception:  # noqa: BLE001 - any change of the internal function: the public one
    return public
  return _direct


def to_device(tree: PyTree, device: jax.Device) -> PyTree:
  """`jax.device_put(tree, device)` for a pytree of jax or NumPy arrays and one device."""
  return implementation()(tree, device)


@functools.cache
def _target(device: jax.Device) -> tuple[Any, Any]:
  sharding = jax.sharding.SingleDeviceSharding(device)
  return sharding, sharding._internal_device_list  # the device list the batched copy takes


def _copy_all(trees: list[PyTree], devices: list[jax.Device]) -> list[PyTree]:
  flat = [jax.tree.flatten(tree) for tree in trees]
  leaves, targets = [], []
  for (tree_leaves, _), device in zip(flat, devices):
    leaves += tree_leaves
    targets += [_target(device)] * len(tree_leaves)
  copies = iter(_copy_arrays(leaves, [t[1] for t in targets], [t[0] for t in targets],
                             [_ALWAYS_COPY] * len(leaves)))
  return [jax.tree.unflatten(treedef, [next(copies) for _ in tree_leaves])
          for tree_leaves, treedef in flat]


def _one_by_one(trees: list[PyTree], devices: list[jax.Device]) -> list[PyTree]:
  return [to_device(tree, device) for tree, device in zip(trees, devices)]


@functools.cache
def _batched_implementation():
  """`_copy_all` if it copies as `jax.device_put` does, else `_one_by_one`."""
  if _copy_arrays is None:
    return _one_by_one
  devices = jax.devices()
  trees = [(jax.device_put(np.arange(3, dtype=np.float32), devices[0]),),
           [jax.device_put(np.ones((2, 2), np.int32), devices[0])]]
  targets = [devices[-1], devices[len(devices) // 2]]
  try:
    for tree, device, got in zip(trees, targets, _copy_all(trees, targets)):
      want = jax.device_put(tree, device)
      if jax.tree.structure(want) != jax.tree.structure(got):
        return _one_by_one
      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        if (type(g) is not type(w) or g.devices() != w.devices() or g.aval != w.aval
            or not g.committed or not np.array_equal(g, w)):
          return _one_by_one
  except Exception:  # noqa: BLE001 - any change of the internal function: one copy per tree
    return _one_by_one
  return _copy_all


def to_devices(trees: list[PyTree], devices: list[jax.Device]) -> list[PyTree]:
  """`[jax.device_put(t, d) for t, d in zip(trees, devices)]` for trees of jax arrays (each
  already on a device), in one call where jax allows it."""
  if len(trees) == 1:
    return [to_device(trees[0], devices[0])]
  return _batched_implementation()(trees, devices)
