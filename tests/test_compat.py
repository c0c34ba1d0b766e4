"""What the project takes from jax's internals is there on the jax that runs the tests (every
supported version runs these in CI): a jax that moves one fails here, by name, not in a run."""

import jax

from layup_jax.platform import compat
from layup_jax.runtime import transfer


def test_the_batched_copy_internals_are_there_and_taken():
  assert compat.BATCHED_COPY is not None
  assert transfer.implementation() is transfer.batched  # they give what jax.device_put gives
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  assert list(compat.device_list(sharding)) == [jax.devices()[1]]


def test_the_coordination_state_reads_as_absent_in_one_process():
  assert compat.coordination_client() is None
  assert compat.coordinator_address() is None
