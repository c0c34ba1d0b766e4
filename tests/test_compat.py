"""What the project takes from jax's internals is there on the jax that runs the tests (every
supported version runs these in CI): a jax that moves one fails here, by name, not in a run."""

import pathlib
import subprocess
import sys

import jax

from layup_jax.platform import compat
from layup_jax.runtime import transfer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_batched_copy_internals_are_there_and_taken():
  assert compat.BATCHED_COPY is not None
  assert transfer.implementation() is transfer.batched  # they give what jax.device_put gives
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  assert list(compat.device_list(sharding)) == [jax.devices()[1]]


def test_the_coordination_state_reads_as_absent_in_one_process():
  assert compat.coordination_client() is None
  assert compat.coordinator_address() is None


_CLIENT_OF_AN_OUTSIDE_SERVICE = r"""
import socket, sys
from layup_jax.platform import compat
with socket.socket() as s:
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
service = compat.start_coordination_service(f"[::]:{port}", 1, heartbeat_timeout_s=60)
# Process 0 joins as a client only: had it started a service of its own, on the same port,
# its bind would fail.
compat.initialize_without_service(coordinator_address=f"127.0.0.1:{port}", num_processes=1,
                                  process_id=0)
client = compat.coordination_client()
client.key_value_set("probe", "through the outside service")
print(client.blocking_key_value_get("probe", 1000))
import jax
from jax._src import distributed
assert distributed.global_state.service is None
jax.distributed.shutdown()
service.shutdown()
"""


def test_process_0_joins_a_coordination_service_of_another_process_as_a_client():
  """The coordinator apart (`multiprocess/coordinator.py`) rests on jax internals: fails here
  when a jax release moves them."""
  assert compat.EXTERNAL_COORDINATOR
  result = subprocess.run([sys.executable, "-c", _CLIENT_OF_AN_OUTSIDE_SERVICE], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().splitlines()[-1] == "through the outside service"
