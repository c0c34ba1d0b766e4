"""Exact global averages of per-device pytrees as one XLA collective.

The per-device arrays are assembled, without copies, into global arrays sharded over a mesh of
the devices (`jax.make_array_from_single_device_arrays`); one jitted function reduces them and
leaves the result replicated, so each device reads its own copy back. XLA lowers the reduction
to an all-reduce, the same primitive DDP's gradient mean uses. Across processes the mesh spans
every process's devices and each process passes its own devices' arrays: the same function is
then an all-reduce between processes (gloo on CPU), which every process calls in the same order.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from layup_jax.multiprocess import setup

PyTree = Any


class DeviceMesh:
  """The training devices as a 1-D mesh, with stacking and unstacking of per-device pytrees.

  `devices` are this process's (the pytrees stacked and unstacked are theirs); `run_devices`
  all the run's, every process's (default: `devices`, one process)."""

  def __init__(self, devices: Sequence[jax.Device],
               run_devices: Sequence[jax.Device] | None = None):
    self.devices = list(devices)
    self.run_devices = list(run_devices or devices)
    self.mesh = Mesh(np.array(self.run_devices), ("devices",))
    self.stacked = NamedSharding(self.mesh, PartitionSpec("devices"))
    self.replicated = NamedSharding(self.mesh, PartitionSpec())

  def stack(self, trees: Sequence[PyTree]) -> PyTree:
    """Per-device pytrees (tree k committed to device k) -> one pytree of global arrays whose
    leading axis concatenates the devices' leaves (0-d leaves become 1-d)."""
    num = len(self.run_devices)

    def assemble(*leaves):
      shards = [leaf.reshape(1) if leaf.ndim == 0 else leaf for leaf in leaves]
      shape = (num * shards[0].shape[0], *shards[0].shape[1:])
      return jax.make_array_from_single_device_arrays(shape, self.stacked, shards)

    return jax.tree.map(assemble, *trees)

  def unstack(self, tree: PyTree) -> list[PyTree]:
    """A replicated pytree -> one pytree per device, each leaf that device's copy."""
    per_device = []
    for device in self.devices:
      per_device.append(jax.tree.map(
          lambda leaf, device=device: next(s.data for s in leaf.addressable_shards
                                           if s.device == device), tree))
    return per_device

  def replicate(self, tree: PyTree) -> PyTree:
    """A copy of `tree` on every device of the run (every process passes the same values)."""
    return setup.put(tree, self.replicated)


def device_mean(stacked: PyTree, like: PyTree, num_devices: int) -> PyTree:
  """Inside jit: the mean over devices of a stacked pytree, shaped like one device's `like`."""
  def mean(leaf, one):
    return jnp.mean(leaf.reshape(num_devices, *one.shape), axis=0)

  return jax.tree.map(mean, stacked, like)


def make_global_mean(mesh: DeviceMesh, like: PyTree) -> Callable[[Sequence[PyTree]], list]:
  """`trees -> [mean, mean, ...]`: the exact mean of per-device pytrees, one copy per device."""
  num = len(mesh.run_devices)
  mean = jax.jit(lambda stacked: device_mean(stacked, like, num), out_shardings=mesh.replicated)
  return lambda trees: mesh.unstack(mean(mesh.stack(trees)))
