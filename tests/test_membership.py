"""Who is lost and who rejoins an elastic gossip run (layup_jax/multiprocess/membership.py),
against an in-memory stand-in for the coordination service's key-value store."""

import select
import socket
import threading

import jax
import pytest

from layup_jax.errors import RejoinError
from layup_jax.multiprocess import gathers, membership
from layup_jax.platform import compat


class FakeStore:
  """The key-value calls `Membership` makes; a delete removes a key and its directory. Safe
  across threads, as jax's client is (a listing made while another thread writes once ended a
  test's thread with `dictionary changed size during iteration`)."""

  def __init__(self):
    self.values: dict[str, str] = {}
    self._lock = threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self._lock:
      assert allow_overwrite or key not in self.values, key
      self.values[key] = value

  def key_value_delete(self, key):
    with self._lock:
      for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
        del self.values[k]

  def key_value_dir_get(self, prefix):
    with self._lock:
      return sorted((k, v) for k, v in self.values.items() if k.startswith(prefix))

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.values:
      raise RuntimeError("DEADLINE_EXCEEDED: not written")
    return self.values[key]

  def key_value_set_bytes(self, key, value):
    self.key_value_set(key, value)

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    value = self.blocking_key_value_get(key, timeout_ms)
    return value if isinstance(value, bytes) else value.encode()

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError("NOT_FOUND")
    return self.values[key]


class SlowWriter(FakeStore):
  """Another process writes `key` only after this one has waited `polls` times for it (a
  loaded host compiling for minutes before its first gather)."""

  def __init__(self, key: str, value: bytes, polls: int):
    super().__init__()
    self.key, self.value, self.polls, self.waits = key, value, polls, 0

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    if key == self.key:
      self.waits += 1
      if self.waits > self.polls:
        self.values.setdefault(key, self.value)
    return super().blocking_key_value_get_bytes(key, timeout_ms)


@pytest.fixture
def store(monkeypatch):
  fake = FakeStore()
  monkeypatch.setattr(compat, "coordination_client", lambda: fake)
  monkeypatch.setattr(membership.gather_order, "next", 7)
  return fake


def test_an_admitted_process_is_not_found_lost_again_and_can_be_lost_later(store):
  members, heard = membership.Membership(), []
  members.listen(lambda k, step: heard.append(("lost", k, step)),
                 lambda k: heard.append(("rejoined", k)))
  members.declare(store, 2, 40)
  members.refresh(store)  # every watchdog period: no second call
  assert heard == [("lost", 2, 40)] and members.is_lost(2)
  store.key_value_set("layup_jax/join/2", "1")
  assert members.joining() == [2]
  members.clear(2)  # process 0, before it tells the others
  members.rejoined(2)
  members.refresh(store)
  assert heard == [("lost", 2, 40), ("rejoined", 2)] and not members.is_lost(2)
  assert not store.key_value_dir_get("layup_jax/join/")
  members.declare(store, 2, 90)  # lost again later: heard again
  assert heard[-1] == ("lost", 2, 90)


def test_only_a_lost_process_that_asked_is_admitted_one_per_consistent_point(store):
  members = membership.Membership()
  for k in (1, 2, 3):
    store.key_value_set(f"layup_jax/join/{k}", "1")  # 1 asks but was never lost
  members.declare(store, 3, 10)
  members.declare(store, 2, 12)
  assert members.joining() == [2]


def test_a_restarted_process_takes_the_admissions_step_lost_set_and_next_gather(store,
                                                                              monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 2)
  primary = membership.Membership()
  primary.declare(store, 1, 5)
  primary.declare(store, 2, 8)
  primary.clear(2)
  primary.admit(2, step=60)  # right after the gather that told the live processes
  restarted = membership.Membership()
  restarted.rejoining = True
  admission = restarted.await_admission()
  assert admission["step"] == 60
  assert restarted.lost == {1: 5} and not restarted.rejoining
  assert membership.gather_order.next == 7  # the live processes' next gather
  assert "layup_jax/admit/2" not in store.values and "layup_jax/join/2" in store.values


def test_a_restarted_process_whose_run_ended_says_so(store):
  store.key_value_set("layup_jax/done/0", "1")  # process 0 is done: not the run's end
  store.key_value_set(membership.FINISHED_KEY, "1")  # the leader said the run is done
  with pytest.raises(RejoinError, match="the run ended first"):
    membership.Membership().await_admission()


@pytest.fixture
def guarded(monkeypatch):
  """A fresh membership whose run a watchdog guards, and no fixed bound on a gather's wait
  other than the writer's life (the bound of an unguarded run set to zero)."""
  members = membership.Membership()
  members.watched = True
  monkeypatch.setattr(membership, "members", members)
  monkeypatch.setattr(gathers, "GATHER_TIMEOUT_S", 0.0)
  return members


def test_a_guarded_gather_waits_for_a_slow_process_as_long_as_it_lives(monkeypatch, guarded):
  slow = SlowWriter("layup_jax/gather/7/1", b'"theirs"', polls=100)
  monkeypatch.setattr(compat, "coordination_client", lambda: slow)
  monkeypatch.setattr(membership.gather_order, "next", 7)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  assert gathers.all_gather_json("mine") == ["mine", "theirs"]
  assert slow.waits == 101


def test_an_unguarded_wait_ends_at_its_bound_naming_the_process(store, monkeypatch):
  monkeypatch.setattr(membership, "members", membership.Membership())  # no watchdog
  monkeypatch.setattr(gathers, "GATHER_TIMEOUT_S", 0.0)
  with pytest.raises(TimeoutError, match="process 1 did not write"):
    gathers.await_value(store, "layup_jax/gather/7/1", 1)


def test_a_guarded_wait_ends_when_the_writer_ended_without_writing(store, guarded):
  store.key_value_set("layup_jax/done/1", "1")  # it failed on its own and said it is done
  with pytest.raises(RuntimeError, match="process 1 ended without writing"):
    gathers.await_value(store, "layup_jax/gather/7/1", 1)
  guarded.declare(store, 2, 30)
  with pytest.raises(gathers.ProcessLostError, match="process 2 was declared lost"):
    gathers.await_value(store, "layup_jax/gather/7/2", 2)


class NeverArrives:
  """A pulled array whose transfer never completes: its source's host vanished without closing
  the connection (TCP retransmits for minutes)."""

  def is_ready(self):
    return False


def test_a_pull_from_a_host_that_vanished_ends_when_the_host_is_declared_lost(monkeypatch,
                                                                              capsys):
  """In an elastic run a pull waits for its transfer only as long as its source lives: once the
  watchdog declares the source lost, the wait raises `ProcessLostError` (the receiver loop then
  ends quietly) and says in one line that the transfer's amount is lost with it; nothing
  computed on this process's devices waits for the transfer."""
  from layup_jax.multiprocess.wire import await_transfer
  monkeypatch.setattr(membership.members, "elastic", True)
  looks = []

  def is_lost(process):  # declared lost at the wait's fourth look
    looks.append(process)
    return len(looks) >= 4

  with pytest.raises(gathers.ProcessLostError):
    await_transfer([NeverArrives(), NeverArrives()], 2, is_lost, 1)
  # It polled the declaration (about its source only) and raised at the first look that found it.
  assert looks == [2, 2, 2, 2]
  assert "process 1: a transfer from process 2 was in flight when it was declared lost" \
      in capsys.readouterr().err
  # A transfer that arrives is returned, whatever else is lost.
  arrived = [jax.numpy.ones(3)]
  assert await_transfer(arrived, 0, lambda k: True, 1)[0] is arrived[0]


def test_a_lost_hosts_sockets_are_shut_so_that_a_blocked_receive_ends():
  """A host that vanished leaves its connections open and a receive on one blocked for as
  long as TCP retransmits; `shut_sockets_to(host)` ends that receive at once (as if the host
  had closed the connection) and leaves the connections to other hosts working. (Loopback's
  127.0.0.2 stands for the lost host, 127.0.0.1 for a live one.)"""
  from layup_jax.multiprocess.wire import shut_sockets_to
  servers = [socket.create_server((host, 0)) for host in ("127.0.0.2", "127.0.0.1")]
  lost, live = [socket.create_connection(s.getsockname()) for s in servers]
  accepted = [s.accept()[0] for s in servers]
  received = []
  blocked = threading.Thread(target=lambda: received.append(lost.recv(1024)), daemon=True)
  blocked.start()
  assert select.select([lost], [], [], 0)[0] == []  # nothing comes from the lost host
  assert shut_sockets_to("127.0.0.2") == 1  # the connection to it (its side has peer 127.0.0.1)
  blocked.join(timeout=5)
  assert not blocked.is_alive() and received == [b""]
  accepted[1].sendall(b"still here")
  assert live.recv(1024) == b"still here"
  for sock in [*servers, lost, live, *accepted]:
    sock.close()


def test_a_gather_reads_the_other_processes_parts_and_not_its_own_back(store, monkeypatch):
  """On another host than the store's, reading its own part back would send it across the link
  again (an evaluation's per-process sums: one model each)."""
  from layup_jax.multiprocess import messages

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(membership, "members", membership.Membership())
  read = []
  get = store.blocking_key_value_get_bytes
  monkeypatch.setattr(store, "blocking_key_value_get_bytes",
                      lambda key, timeout_ms: read.append(key) or get(key, timeout_ms))
  store.key_value_set_bytes("layup_jax/gather/7/0", messages.encode({"mass": [1.0, 2.0]}))
  store.key_value_set_bytes("layup_jax/gather/8/0", b'{"step": 3}')
  assert gathers.all_gather_data({"mass": [5.0]}) == [{"mass": [1.0, 2.0]},
                                                             {"mass": [5.0]}]
  assert gathers.all_gather_json({"step": 4}) == [{"step": 3}, {"step": 4}]
  assert read == ["layup_jax/gather/7/0", "layup_jax/gather/8/0"]
  assert "layup_jax/gather/7/1" in store.values  # written for the others to read


def test_the_lowest_live_process_leads_once_the_leader_is_lost(store, monkeypatch):
  """Process 0 leads; lost, the lowest live process leads, and keeps the lead when process 0
  rejoins (which learns who leads from its admission); a lost process that is not the leader
  changes nothing."""
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  members = membership.Membership()
  assert (members.leader, members.next_leader()) == (0, 1)
  members.declare(store, 2, 10)
  assert (members.leader, members.next_leader()) == (0, 1)
  members.declare(store, 0, 20)
  assert (members.leader, members.next_leader()) == (1, 3)
  members.clear(0)
  members.admit(0, step=30)
  members.rejoined(0)
  assert (members.leader, members.next_leader()) == (1, 0)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  restarted = membership.Membership()
  restarted.rejoining = True
  restarted.await_admission()
  assert restarted.leader == 1


class _LeaderLostMidGather(FakeStore):
  """Process 2 waits for gather 7's members from its leader, process 0, which dies before
  naming them: the wait finds it declared lost (the watchdog's refresh), and process 1, leading
  now, names the members (itself and process 2) once it sees process 2's value."""

  def __init__(self, members):
    super().__init__()
    self.members, self.waits = members, 0
    self.values.update({"layup_jax/gather/7/1": b'"one"'})

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    if key == "layup_jax/gather/7/members":
      self.waits += 1
      if self.waits == 2:  # process 0 is declared lost while process 2 waits for it
        self.key_value_set("layup_jax/lost/0", "12")
        self.members.refresh(self)
      if self.waits == 4:  # process 1, now the leader, names the members
        self.key_value_set(key, b"[1, 2]")
    return super().blocking_key_value_get_bytes(key, timeout_ms)


def test_a_gather_whose_leader_is_lost_before_naming_its_members_takes_the_next_leaders(
    monkeypatch):
  members = membership.Membership()
  members.watched, members.elastic = True, True
  store = _LeaderLostMidGather(members)
  monkeypatch.setattr(compat, "coordination_client", lambda: store)
  monkeypatch.setattr(membership, "members", members)
  monkeypatch.setattr(membership.gather_order, "next", 7)
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(jax, "process_index", lambda: 2)
  assert gathers.all_gather_json("two") == ["one", "two"]
  assert members.leader == 1 and store.waits == 4


def test_a_new_leader_reads_the_names_an_earlier_leader_wrote(store, monkeypatch):
  """Process 0 named gather 7's members and died; process 1, leading now, finds its names and
  returns those processes' values (process 0's included), not a set of its own."""
  members = membership.Membership()
  members.watched, members.elastic = True, True
  monkeypatch.setattr(membership, "members", members)
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  store.values.update({"layup_jax/gather/7/0": b'"zero"', "layup_jax/gather/7/2": b'"two"',
                       "layup_jax/gather/7/members": "[0, 1, 2]", "layup_jax/lost/0": "12"})
  members.refresh(store)
  assert members.leader == 1
  assert gathers.all_gather_json("one") == ["zero", "one", "two"]


def test_a_restarted_process_not_yet_admitted_takes_no_notice_of_a_loss(monkeypatch):
  """Processes 1 and 2 lost together; 1 is admitted back, 2 still waits; then the leader,
  process 0, is lost. Process 2 never heard of 1's rejoin, so its view held every process lost,
  and its reaction to the loss divided by 0 live devices (`Fraction(6, 0)`: found in a churn
  drill, the watchdog thread died and the restart with it). A process not yet admitted takes
  no notice: its admission gives it the run's view."""
  from fractions import Fraction
  from types import SimpleNamespace

  from layup_jax.multiprocess.elastic import Elastic

  members = membership.Membership()
  members.rejoining, members.lost = True, {2: 1503, 1: 1503}
  monkeypatch.setattr(membership, "members", members)
  monkeypatch.setattr(jax, "process_index", lambda: 2)
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  told = []
  runtime = SimpleNamespace(
      num_devices=2, total_devices=6, iterations_started=lambda: 0,
      run_devices=[SimpleNamespace(process_index=g // 2) for g in range(6)],
      transport=SimpleNamespace(lose=told.append), peers=SimpleNamespace(lose=told.append),
      options=SimpleNamespace(survivors_train_lost_share=True),
      pace=SimpleNamespace(set_rate=lambda *args: told.append(args)))
  elastic = Elastic(runtime)
  members.lost[0] = 1857
  elastic.on_lost(0, 1857)
  assert told == []
  members.rejoining = False  # admitted: a loss reaches the transport, the peers and the pace
  members.lost = {0: 1857}
  elastic.on_lost(0, 1857)
  assert told[:2] == [0, [0, 1]] and told[2][0] == Fraction(6, 4)  # the run's 6 over 4 live
