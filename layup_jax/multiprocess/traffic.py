"""The bytes a run sends from one process to the others: what crosses the link between hosts.

Gossip counts what it offers to another process's device (each send's arrays, as pulled). A
collective (DDP's gradient all-reduce, the periodic methods' model average) is counted from the
compiled program: the bytes its all-reduces reduce, times 2 (P - 1) / P for P processes, which
is what each process sends in a bandwidth-optimal all-reduce (reduce-scatter then all-gather
between processes): the least any implementation sends. The transport may send more (gloo's
collectives on CPU run per device, not per process); `scripts/cluster_drill.sh` reads the
links' own counters, and docs/records/multihost.md compares the two.
"""

import re
import threading

import numpy as np

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([\d,]*)\]")
# An all-reduce instruction of compiled HLO text: `%name = <result shape(s)> all-reduce(` (or
# the asynchronous `all-reduce-start(`); the result has the operands' shapes.
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")


class BytesSent:
  """A thread-safe count of the bytes this process has sent to other processes."""

  def __init__(self):
    self._lock = threading.Lock()
    self._total = 0

  def add(self, nbytes: float) -> None:
    with self._lock:
      self._total += int(nbytes)

  @property
  def total(self) -> int:
    with self._lock:
      return self._total


def tree_bytes(leaves) -> int:
  """The bytes of a list of arrays (or ShapeDtypeStructs)."""
  return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)


def all_reduce_bytes(hlo_text: str) -> int:
  """The bytes one run of a compiled program reduces in its all-reduces (per device)."""
  total = 0
  for match in _ALL_REDUCE.finditer(hlo_text):
    for dtype, dims in _SHAPE.findall(match.group(1)):
      total += _ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def all_reduce_share(reduced_bytes: int, num_processes: int) -> float:
  """The bytes each of `num_processes` sends to the others in a bandwidth-optimal all-reduce of
  `reduced_bytes`: 2 (P - 1) / P of them (none in one process)."""
  if num_processes <= 1:
    return 0.0
  return 2.0 * (num_processes - 1) / num_processes * reduced_bytes


def compiled_share(compiled, num_processes: int) -> float:
  """`all_reduce_share` of a compiled program (`jax.stages.Compiled`): what each process sends
  per run of it."""
  return all_reduce_share(all_reduce_bytes(compiled.as_text()), num_processes)
