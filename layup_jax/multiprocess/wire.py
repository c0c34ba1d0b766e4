"""The wire between processes: each process's transfer server (`jax.experimental.transfer`),
the addresses the others pull from, the wait for a pull, and host copies of device arrays."""

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from layup_jax.errors import ConfigError
from layup_jax.multiprocess import membership, signed
from layup_jax.platform import compat

PyTree = Any
_PULL_POLL_S = 0.001  # how often an elastic run's pull looks whether its source was lost


def own_address_toward(host: str) -> str:
  """The address of this host on the route to `host` (no packet is sent): the one the other
  processes reach it at, where a hostname may resolve to loopback."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((host, 9))
    return probe.getsockname()[0]


def transfer_host(configured: str) -> str:
  """`configured`, else this host's address toward the coordinator."""
  if configured:
    return configured
  coordinator = compat.coordinator_address() or "127.0.0.1:0"
  return own_address_toward(coordinator.rsplit(":", 1)[0].strip("[]"))


def _host_of(address: str) -> str:
  return address.rsplit(":", 1)[0].strip("[]")


def shut_sockets_to(host: str) -> int:
  """Shuts down every TCP socket of this process whose peer is `host` (an address or a name),
  whoever opened it (the transfer library's included), so that a thread blocked on one sees
  the connection end; returns their count. Linux (`/proc/self/fd`); elsewhere nothing."""
  try:
    names = os.listdir("/proc/self/fd")
    peers = {info[4][0] for info in socket.getaddrinfo(host, None)}
  except OSError:
    return 0
  shut = 0
  for name in names:
    try:
      if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
        continue
      with socket.socket(fileno=os.dup(int(name))) as sock:  # closing the copy keeps the fd
        if sock.type == socket.SOCK_STREAM and \
            sock.getpeername()[0].removeprefix("::ffff:") in peers:
          sock.shutdown(socket.SHUT_RDWR)
          shut += 1
    except OSError:  # closed meanwhile, not connected, not a socket of ours to read
      continue
  return shut


def start_server(host: str, num_local_devices: int):
  """This process's transfer server on `host`; one clear line when it cannot start."""
  client = jax.local_devices()[0].client
  try:
    return compat.start_transfer_server(client, f"{host}:0",
                                        [f"{host}:0"] * max(1, num_local_devices))
  except Exception as error:  # any failure: one line before training
    raise ConfigError(
        f"the transfer server for gossip between processes did not start on {host} "
        f"({type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}); set "
        f"config.distributed.transfer_host to an address of this host that the other "
        f"processes reach") from error


def await_transfer(pulled: PyTree, source: int, is_lost: Callable[[int], bool],
                   me: int) -> PyTree:
  """`pulled` once its transfer has arrived, in an elastic run (else as it is: its merge waits
  for it on the device). There a sender that dies mid-pull fails the transfer here, not in a
  merge; and one whose host vanished without closing its connections (power, a cable, a link
  down) leaves it waiting while TCP retransmits for minutes: the wait ends when `is_lost(source)`
  (the watchdog declared it lost; `ProcessLostError`, its amount lost with it), so that nothing
  computed on this device ever waits for it and the receiver thread ends. One still not
  arrived after the progress timeout (a link cut while the store still answers) accuses the
  sender, so that the wait ends in a declaration."""
  if not membership.members.elastic:
    return pulled
  leaves = jax.tree.leaves(pulled)
  members = membership.members
  deadline, insist = members.deadline(), False
  while not all(leaf.is_ready() for leaf in leaves):
    if deadline is not None and time.monotonic() > deadline:  # a cut link: no end otherwise
      waited = members.progress_timeout_s * (2 if insist else 1)
      if members.accuse(signed.client(), source, f"a transfer from process {source} did not "
                        f"arrive within {waited:g} s", insist):
        deadline = None
      else:  # it waits itself: a deadline more
        deadline, insist = members.deadline(), True
    if is_lost(source):
      print(f"process {me}: a transfer from process {source} was in flight when it was "
            f"declared lost; dropped, its push-sum amount lost with it", file=sys.stderr,
            flush=True)
      raise membership.ProcessLostError(source)
    time.sleep(_PULL_POLL_S)
  return jax.block_until_ready(pulled)


def _address_key(process: int) -> str:
  return f"layup_jax/transfer/{process}"


def host_tree(tree: PyTree) -> PyTree:
  """NumPy copies of a tree's arrays (to gather across processes); an array replicated over
  every process's devices gives this process's copy."""
  def host(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      if not leaf.sharding.is_fully_replicated:
        raise ValueError(f"a {leaf.shape} array split across processes has no one host copy")
      leaf = leaf.addressable_data(0)
    return np.asarray(jax.device_get(leaf))

  return jax.tree.map(host, tree)
