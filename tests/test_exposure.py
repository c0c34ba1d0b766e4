"""What a run exposes on the network: under the launcher the coordination service listens on
loopback only; on a cluster it listens where the user says, or on every interface."""

import socket
import subprocess
import time

import pytest

from layup_jax import launch
from layup_jax.multiprocess import setup


@pytest.mark.parametrize("address,bind_host,expected", [
    ("127.0.0.1:4000", "", "127.0.0.1:4000"),
    ("localhost:4000", "", "localhost:4000"),
    ("[::1]:4000", "", "[::1]:4000"),
    ("10.0.0.5:4000", "", "[::]:4000"),
    ("10.0.0.5:4000", "10.0.0.5", "10.0.0.5:4000"),
])
def test_process_0s_service_listens_on_loopback_for_a_loopback_run_else_where_told(
    address, bind_host, expected):
  assert setup.bind_address(address, bind_host) == expected


def _own_address() -> str | None:
  """An address of this machine other than loopback (None: it has none)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    try:
      probe.connect(("10.255.255.255", 9))  # no packet is sent
      address = probe.getsockname()[0]
    except OSError:
      return None
  return None if address.startswith("127.") else address


def test_the_launchers_coordinator_is_not_reachable_from_another_address(tmp_path):
  """The coordinator the launcher starts answers on 127.0.0.1 and refuses a connection to the
  same port on this machine's other address."""
  other = _own_address()
  if other is None:
    pytest.skip("this machine has no address besides loopback")
  with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
  command = launch.coordinator_command(2, port)
  assert command[command.index("--host") + 1] == "127.0.0.1"
  service = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while True:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
      except OSError:
        assert time.monotonic() < deadline and service.poll() is None
        time.sleep(0.2)
    with pytest.raises(OSError):
      socket.create_connection((other, port), timeout=2).close()
  finally:
    service.terminate()
    service.wait(timeout=30)


def test_cluster_detection_leaves_the_service_where_jax_puts_it(monkeypatch):
  """`coordinator_address="auto"`: JAX finds the coordinator itself; no bind address is made up."""
  import jax

  from layup_jax import defaults

  joined = []
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: joined.append(kwargs))
  config = defaults.get_config().distributed
  config.coordinator_address = "auto"
  assert setup.initialize(config) is True
  assert joined == [{"coordinator_address": None, "num_processes": None, "process_id": None,
                     "heartbeat_timeout_seconds": 60}]
