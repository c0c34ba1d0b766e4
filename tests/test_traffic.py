"""What crosses between processes: what a collective reduces is read from the compiled program,
each process's share of an all-reduce is the bandwidth-optimal one, and gossip picks a peer on
another process with the probability the run sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layup_jax.algorithms import collectives
from layup_jax.multiprocess import traffic
from layup_jax.runtime.sends import PeerSampler


def test_the_bytes_an_all_reduce_reduces_are_read_from_the_compiled_program():
  """The periodic methods' average of a 3x5 float32 and a 7-element bfloat16 leaf over 8 devices
  reduces 15 * 4 + 7 * 4 bytes per device (`jnp.mean` accumulates bfloat16 in float32, and the
  all-reduce carries the float32 sums); a program without collectives reduces none."""
  mesh = collectives.DeviceMesh(jax.devices()[:8])
  like = (jax.ShapeDtypeStruct((3, 5), jnp.float32), jax.ShapeDtypeStruct((7,), jnp.bfloat16))
  trees = [(jax.device_put(np.full((3, 5), k, np.float32), d),
            jax.device_put(np.full((7,), k, jnp.bfloat16), d))
           for k, d in enumerate(mesh.devices)]
  mean = jax.jit(lambda stacked: collectives.device_mean(stacked, like, 8),
                 out_shardings=mesh.replicated)
  compiled = mean.lower(mesh.stack(trees)).compile()
  assert traffic.all_reduce_bytes(compiled.as_text()) == 15 * 4 + 7 * 4
  assert traffic.compiled_share(compiled, 2) == 15 * 4 + 7 * 4
  local = jax.jit(lambda x: x * 2).lower(np.ones((3, 5), np.float32)).compile()
  assert traffic.all_reduce_bytes(local.as_text()) == 0


@pytest.mark.parametrize(("processes", "share"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_each_process_sends_2_p_minus_1_over_p_of_what_an_all_reduce_reduces(processes, share):
  assert traffic.all_reduce_share(1000, processes) == pytest.approx(1000 * share)


def test_an_offer_counts_its_arrays_bytes():
  counted = traffic.BytesSent()
  counted.add(traffic.tree_bytes([np.zeros((4, 3), np.float32), jnp.zeros(5, jnp.bfloat16)]))
  counted.add(traffic.tree_bytes([jax.ShapeDtypeStruct((2,), np.int64)]))
  assert counted.total == 48 + 10 + 16


def test_peers_on_other_processes_are_chosen_with_the_remote_probability():
  """Process 1 of 2 x 4 (devices 4-7): with remote probability 0.1 about one pick in ten is a
  device of process 0 and the rest are the other three local devices, evenly; never itself.
  Without it (-1) picks are uniform over the 7 other devices, 4 of them remote."""
  def picks(probability):
    sampler = PeerSampler(8, seed=0, first=4, count=4, remote_probability=probability)
    return np.array([sampler.pick(1) for _ in range(20000)])  # device 5 of the run

  chosen = picks(0.1)
  assert 5 not in chosen and set(chosen) == {0, 1, 2, 3, 4, 6, 7}
  assert np.mean(chosen < 4) == pytest.approx(0.1, abs=0.01)
  local = chosen[chosen >= 4]
  for device in (4, 6, 7):
    assert np.mean(local == device) == pytest.approx(1 / 3, abs=0.02)
  assert np.mean(picks(-1.0) < 4) == pytest.approx(4 / 7, abs=0.015)
