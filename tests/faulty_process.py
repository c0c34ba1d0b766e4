"""One process of a run that misbehaves on purpose (tests/test_multiprocess.py starts it in place
of `python -m layup_jax.train` for one process of three):

    python tests/faulty_process.py nan TRAIN_ARGS...

    python tests/faulty_process.py hide_newest TRAIN_ARGS...
    python tests/faulty_process.py hang TRAIN_ARGS...

`nan`: every stage this process offers to another process is NaN (its floating leaves; an int8
send's scales), as a faulty device or a hostile peer would send. The process itself trains as
usual; the receivers must drop what it sends, name it, and past the bound treat it as lost.
`hide_newest`: when the run lists its checkpoints to resume, this process does not see the
newest (as a lagging view of shared storage would not); the processes must agree on one step.
`hang`: after its 200th iteration this process's training blocks for good (a hung step, a
driver that never returns) while its watchdog thread goes on beating.
"""

import importlib
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
from absl import app

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from layup_jax.checkpoint.manager import Checkpoints  # noqa: E402
from layup_jax.multiprocess import remote_peers  # noqa: E402
from layup_jax.runtime.engine import AsyncRuntime  # noqa: E402


def _poison(leaf: jax.Array) -> jax.Array:
  """NaN in place of a floating leaf's values, on its own device; other leaves kept."""
  return leaf * jnp.nan if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf


def send_nan() -> None:
  """Every offer this process makes carries NaN."""
  offer = remote_peers.RemotePeers._offer

  def poisoned(self, part):
    return offer(self, jax.tree.map(_poison, part))

  remote_peers.RemotePeers._offer = poisoned


def hide_newest() -> None:
  """The first listing of the checkpoints (the restore's) leaves out the newest step."""
  steps, listings = Checkpoints.steps, []

  def seen(self):
    every = steps(self)
    listings.append(every)
    return every[:-1] if len(listings) == 1 else every

  Checkpoints.steps = seen


def hang(after: int = 200) -> None:
  """The compute threads block for good once this process has dispatched `after` iterations."""
  compute, dispatched = AsyncRuntime._compute_iteration, []

  def hung(self, *args, **kwargs):
    dispatched.append(1)
    if len(dispatched) > after:
      threading.Event().wait()
    return compute(self, *args, **kwargs)

  AsyncRuntime._compute_iteration = hung


if __name__ == "__main__":
  mode, args = sys.argv[1], sys.argv[2:]
  {"nan": send_nan, "hide_newest": hide_newest, "hang": hang}[mode]()
  sys.argv = [sys.argv[0], *args]
  train = importlib.import_module("layup_jax.train")  # the module (the package's `train` is the API)
  app.run(train.main, flags_parser=train._parse_flags)
