"""Copies of arrays onto one device, at the least host cost jax allows.

The LayUp runtime copies every stage it sends to a peer, and every batch to its device, tens of
times per iteration across its threads. `jax.device_put` spends most of its time in a Python
layer that accepts every kind of input (pytrees of shardings, layouts, memory kinds); an array
copied onto one device needs none of it. `to_device` calls jax's internal transfer once per
array instead (on jax 0.10, CPU: about 10 us per array against 35 us for `jax.device_put`),
after checking once that it gives what `jax.device_put` gives; where that internal function is
missing or differs (another jax version), `to_device` is `jax.device_put`.
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
