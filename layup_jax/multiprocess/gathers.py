"""Gathers of host values across processes through the coordination service's key-value store
(no device collective): every process calls them in the same order; in an elastic run they
gather the live processes only (`membership.members`)."""

import contextlib
import json
import time

import jax

from layup_jax.multiprocess import membership, messages, signed
from layup_jax.multiprocess.membership import ProcessLostError, try_get
from layup_jax.multiprocess.setup import local_positions

# How long a gather waits for another process's value when no watchdog guards the run. Under a
# watchdog a gather waits as long as the writer lives (the watchdog ends or fences off a silent
# one): a loaded host's compilation before the first gather can take minutes longer on one
# process than on another (found: a two-process test failed at a fixed 2-minute wait).
GATHER_TIMEOUT_S = 120.0
_GATHER_POLL_MS = 2000
_data_keys: list[str] = []  # this process's keys of its recent `all_gather_data` calls


def await_value(client, key: str, writer: int) -> bytes:
  """The store's value of `key`, which process `writer` writes, waiting as long as the writer
  may still write it: while a watchdog guards the run (`membership.members.watched`), until the writer says
  it is done (it ended, or failed on its own, without writing it) or is declared lost, and a
  writer seen training accused once the progress timeout has passed (`Membership.accuse`);
  without one, at most `GATHER_TIMEOUT_S`."""
  members = membership.members
  deadline = None if members.watched else time.monotonic() + GATHER_TIMEOUT_S
  patience = membership.AccusingWait(client, writer)
  with members.waiting():
    while True:
      try:
        return client.blocking_key_value_get_bytes(key, _GATHER_POLL_MS)
      except Exception as error:  # DEADLINE_EXCEEDED: not yet written
        if "DEADLINE_EXCEEDED" not in str(error):
          raise
      if members.is_lost(writer):
        raise ProcessLostError(writer)
      if try_get(client, f"layup_jax/done/{writer}") is not None:
        raise RuntimeError(f"process {writer} ended without writing {key} (see its own output)")
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"process {writer} did not write {key} within {GATHER_TIMEOUT_S:g} s")
      if writer in members.trained and members.watched:
        patience.check(lambda waited: f"process {writer} did not write {key} within "
                                      f"{waited:g} s")


def _read_gather(client, prefix: str, mine: bytes) -> list[tuple[int, bytes]]:
  """The values gather `prefix` holds, `(process, value)` in process order: every process's, or in an elastic run
  those of the processes the run's leader names (every live process that wrote its value; one
  lost before writing it is left out), so that every survivor reads the same set. A leader
  lost before naming them is followed by the next one, which names them itself; the first
  names written are the ones every process reads. This process's own value is `mine`, not
  read back: on another host than the store's, it would cross the link again (an
  evaluation's model)."""
  me = jax.process_index()
  read = lambda k: mine if k == me else await_value(client, f"{prefix}/{k}", k)
  if not membership.members.elastic:
    return [(k, read(k)) for k in range(jax.process_count())]
  key = f"{prefix}/members"
  while True:
    leader = membership.members.leader
    if me == leader:
      values = _name_members(client, key, read)
      return [(k, values[k]) for k in sorted(values)]
    try:
      names = json.loads(await_value(client, key, leader).decode())
    except ProcessLostError as error:
      if error.process != leader:
        raise
      continue  # the leader was lost before naming them: the next one does
    return [(k, read(k)) for k in names]


def _name_members(client, key: str, read) -> dict[int, bytes]:
  """The leader's part of a gather: the values of the live processes it could read, their
  names written under `key`, unless a leader before it wrote names already (then those
  processes' values)."""
  values: dict[int, bytes] = {}
  for k in range(jax.process_count()):
    if membership.members.is_lost(k):
      continue
    with contextlib.suppress(ProcessLostError):  # lost before writing it: left out
      values[k] = read(k)
  try:
    client.key_value_set(key, json.dumps(sorted(values)))  # never over an earlier leader's
  except Exception:  # noqa: BLE001 - ALREADY_EXISTS: the earlier leader's names stand
    earlier = try_get(client, key)
    if earlier is None:
      raise
    values = {k: values[k] if k in values else read(k) for k in json.loads(earlier)}
  return values


def all_gather_json(value) -> list:
  """Every process's `value` (JSON-serializable), in process order, through the coordination
  service's key-value store (no device collective); every process must call it, in the same
  order. In an elastic run, the live processes' values only (`members`)."""
  if jax.process_count() == 1:
    return [value]
  client = signed.client()
  prefix = membership.gather_order.prefix()
  mine = json.dumps(value).encode()
  client.key_value_set_bytes(f"{prefix}/{jax.process_index()}", mine)
  return [json.loads(part) for _, part in _read_gather(client, prefix, mine)]


def all_gather_data(value) -> list:
  """`all_gather_json` for data with arrays (a run's replicas at an evaluation), as messages
  through the same store (`messages`: data only, nothing read is executed). Each other
  process's part must have the form of this process's `value` (the same keys, arrays where it
  has arrays); a part that does not stops this process in one line (`MessageError`)."""
  if jax.process_count() == 1:
    return [value]
  client = signed.client()
  prefix = membership.gather_order.prefix()
  mine, encoded = f"{prefix}/{jax.process_index()}", messages.encode(value)
  client.key_value_set_bytes(mine, encoded)
  parts = [value if k == jax.process_index() else
           messages.decode(part, like=value, what=f"part {k} of gather {prefix}")
           for k, part in _read_gather(client, prefix, encoded)]
  # Our key of two gathers ago has been read by all: each process wrote its key of the last
  # gather only after reading every key of the one before, and we have read those.
  _data_keys.append(mine)
  if len(_data_keys) > 2:
    client.key_value_delete(_data_keys.pop(0))
  return parts


def data_states(iterators, devices, processes=None) -> list:
  """Every device's train-iterator state, in device order, each read by the process that feeds
  the device (the others' copies of an iterator never advance); with `processes` (an elastic
  run's checkpoint after a loss), their devices' only."""
  mine = {str(i): iterators[i].get_state() for i in local_positions(devices)}
  merged = {}
  for part in all_gather_json(mine):
    merged.update(part)
  return [merged[str(i)] for i, device in enumerate(devices)
          if processes is None or device.process_index in processes]
