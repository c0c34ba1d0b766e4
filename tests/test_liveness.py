"""No stall without an end (layup_jax/multiprocess/watchdog.py, membership.py): a process whose
training makes no progress is found even while its heartbeat beats, a wait on another process
past the progress timeout accuses that process, and the run's leader declares the accused lost,
one of two that accuse each other. Against an in-memory stand-in for the coordination store."""

import collections
import threading

import jax
import jax.numpy as jnp
import pytest

from layup_jax.multiprocess import gathers, membership, remote_peers, watchdog, wire
from layup_jax.platform import compat
from tests.test_membership import FakeStore, SlowWriter


def test_a_process_training_without_progress_for_the_timeout_is_stalled():
  clock = watchdog.ProgressClock(timeout_s=10.0)
  # Not seen moving yet (compiling): never judged by progress, however long.
  assert not any(clock.observe(1, 0, False, t) for t in (0, 5, 50, 500))
  assert not clock.has_trained(1)
  assert not clock.observe(1, 3, False, 501)  # it moves
  assert clock.has_trained(1)
  assert not clock.observe(1, 3, False, 510)  # frozen 9 s: not yet
  assert clock.observe(1, 3, False, 512)  # frozen 11 s while training: stalled
  # Waiting on the others (an evaluation, a gather) is not a stall, and leaving it restarts
  # the clock.
  assert not clock.observe(1, 3, True, 600)
  assert not clock.observe(1, 3, False, 605)
  assert clock.observe(1, 3, False, 611)
  clock.forget(1)  # lost, or rejoining: judged afresh
  assert not clock.has_trained(1) and not clock.observe(1, 3, False, 1000)
  # Timeout 0: progress is not judged.
  off = watchdog.ProgressClock(timeout_s=0.0)
  off.observe(2, 1, False, 0)
  off.observe(2, 2, False, 1)
  assert not off.observe(2, 2, False, 10_000)


def test_a_heartbeat_carries_the_iterations_and_whether_the_process_waits():
  assert watchdog.read_beat(watchdog.beat_value(7, 120, True)) == ("7", 120, True)
  assert watchdog.read_beat(watchdog.beat_value(8, 0, False)) == ("8", 0, False)
  for bad in (None, "", "7", "7 x 1", "7 1 2", "7 -1 0", "7 1 0 0"):
    assert watchdog.read_beat(bad) is None


@pytest.fixture
def elastic(monkeypatch):
  """Process 0 of 3 in an elastic run under a watchdog, the store an in-memory one."""
  store = FakeStore()
  members = membership.Membership()
  members.elastic = members.watched = True
  monkeypatch.setattr(membership, "members", members)
  monkeypatch.setattr(compat, "coordination_client", lambda: store)
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  return store, members


def _watchdog_of(store, me: int):
  dog = object.__new__(watchdog.Watchdog)
  dog._client, dog._me, dog._external, dog._timeout_s = store, me, True, 5.0
  return dog


def test_an_accused_process_is_declared_lost_by_the_leader_and_told_why(elastic, capsys):
  store, members = elastic
  members.accuse(store, 2, "3 malformed sends (stage 1 holds non-finite values)")
  members.accuse(store, 2, "3 malformed sends (again)")  # one accusation per accuser
  assert store.key_value_dir_get("layup_jax/accused/") == [
      ("layup_jax/accused/2/0", "3 malformed sends (stage 1 holds non-finite values)")]
  _watchdog_of(store, 1)._judge_accusations()  # not the leader: decides nothing
  assert not members.is_lost(2)
  _watchdog_of(store, 0)._judge_accusations()
  assert members.is_lost(2)
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert line.startswith("process 2 lost at step 0;") and "malformed sends" in line
  assert "process 0: 3 malformed sends" in _watchdog_of(store, 2)._why_lost()
  members.clear(2)  # admitted back: its earlier run's accusations go with it
  assert not store.key_value_dir_get("layup_jax/accused/")


def test_when_the_leader_and_the_next_in_line_fall_silent_together_the_next_live_one_declares(
    elastic, capsys):
  """The leader declares a lost process, the next in line the leader. Killed within one timeout
  of each other (a churn drill's two kills at step 53), neither was declared by anyone, and the
  one survivor waited for good. The lowest process not silent decides: where only the leader
  is silent that is still the next in line, not the survivor after it."""
  store, members = elastic
  last = _watchdog_of(store, 2)
  last._elastic = True
  last._silent(0, {0})  # process 1 answers: it declares the leader, process 2 does not
  assert not members.is_lost(0)
  for k in (0, 1):
    last._silent(k, {0, 1})
  assert members.is_lost(0) and members.is_lost(1) and members.leader == 2
  said = capsys.readouterr().err
  assert "process 0 lost at step 0" in said and "process 1 lost at step 0" in said


@pytest.mark.parametrize("leader_accused", [False, True])
def test_of_two_processes_that_accuse_each_other_one_is_declared(elastic, leader_accused):
  """A link between two processes failed: each accuses the other; exactly one is declared lost
  (where one leads, the other), whoever judges first."""
  store, members = elastic
  a, b = (0, 2) if leader_accused else (1, 2)
  members.accuse(store, a, "sends not acknowledged")
  store.key_value_set(f"layup_jax/accused/{a}/{b}", "x")
  store.key_value_set(f"layup_jax/accused/{b}/{a}", "y")
  for judge in (1, 0, 1, 0):  # the next leader, then the leader, each period
    _watchdog_of(store, judge)._judge_accusations()
  lost = {k for k in (a, b) if members.is_lost(k)}
  assert lost == ({b} if leader_accused else {a})


def test_a_guarded_gather_accuses_a_writer_that_trained_once_the_timeout_passed(elastic,
                                                                             monkeypatch):
  _, members = elastic
  slow = SlowWriter("layup_jax/gather/7/1", b'"late"', polls=3)
  monkeypatch.setattr(compat, "coordination_client", lambda: slow)
  members.progress_timeout_s = 1e-9
  members.trained.add(1)  # seen training: a wait on it has a deadline
  assert gathers.await_value(slow, "layup_jax/gather/7/1", 1) == b'"late"'
  assert [k for k, _ in slow.key_value_dir_get("layup_jax/accused/")] == [
      "layup_jax/accused/1/0"]
  # One not seen training yet (compiling at the run's start) is waited for without one.
  slow2 = SlowWriter("layup_jax/gather/8/2", b'"late"', polls=3)
  assert gathers.await_value(slow2, "layup_jax/gather/8/2", 2) == b'"late"'
  assert not slow2.key_value_dir_get("layup_jax/accused/")


def test_a_wait_on_a_process_that_waits_itself_accuses_it_only_a_deadline_later(
    elastic, capsys):
  """The run's leader waits on a hung process's part of a gather while the others wait on the
  leader's list of members: the leader's heartbeat says it waits, so the others' first deadline
  accuses nobody (the hung one is found by its progress or the leader's own wait), their
  second does (two processes that wait on each other across a cut link)."""
  store, members = elastic
  members.progress_timeout_s = 1e-9
  members.trained.add(1)
  members.held.add(1)  # its heartbeat says it waits on another process
  assert members.accuse(store, 1, "late", insist=False) is False
  assert not store.key_value_dir_get("layup_jax/accused/")
  slow = SlowWriter("layup_jax/gather/9/1", b'"late"', polls=3)
  assert gathers.await_value(slow, "layup_jax/gather/9/1", 1) == b'"late"'
  assert [k for k, _ in slow.key_value_dir_get("layup_jax/accused/")] == [
      "layup_jax/accused/1/0"]
  assert "did not write layup_jax/gather/9/1 within 2e-09 s" in capsys.readouterr().err


class NeverArrives:
  def is_ready(self):
    return False


def test_a_transfer_that_never_arrives_accuses_its_sender_and_ends_when_it_is_declared(
    elastic):
  store, members = elastic
  members.progress_timeout_s = 1e-9
  looks = []

  def is_lost(process):  # the leader declares it a few looks later
    looks.append(process)
    return len(looks) >= 3

  with pytest.raises(membership.ProcessLostError):
    wire.await_transfer([NeverArrives()], 2, is_lost, 0)
  assert [k for k, _ in store.key_value_dir_get("layup_jax/accused/")] == [
      "layup_jax/accused/2/0"]


def test_sends_never_acknowledged_accuse_the_receiver_and_quiesce_ends_at_its_loss(elastic):
  store, members = elastic
  members.progress_timeout_s = 1e-9
  peers = object.__new__(remote_peers.RemotePeers)
  peers._me, peers._client, peers._lock = 0, store, threading.Lock()
  peers._process_of, peers.lost = [0, 1, 2], set()
  peers._sent, peers._acked = {1: 0, 2: 5}, {1: 0, 2: 2}

  def declared_later():  # the watchdog's thread declares process 2 lost meanwhile
    while not store.key_value_dir_get("layup_jax/accused/"):
      pass
    peers.lost.add(2)

  thread = threading.Thread(target=declared_later)
  thread.start()
  peers.quiesce(lambda: False)
  thread.join()
  assert [k for k, _ in store.key_value_dir_get("layup_jax/accused/")] == [
      "layup_jax/accused/2/0"]
  assert not members.idle() or not members.training  # its wait is over


def test_a_process_admitted_back_reads_the_live_processes_addresses_afresh(elastic):
  """Two restarts waiting at once: process 2 read process 1's transfer address at its start,
  then process 1 was started again too and admitted first. Admitted itself, process 2 must
  pull from process 1's new server (it gives 2 its share): at admission it reads the addresses
  of every live process again, and drops its connections to the old ones; a process still
  lost keeps its entry (it is read again when that process is admitted)."""
  store, _ = elastic
  peers = object.__new__(remote_peers.RemotePeers)
  peers._me, peers._client, peers._lock = 2, store, threading.Lock()
  peers._process_of, peers.lost = [0, 0, 1, 1, 2, 2], set()
  peers._addresses = {0: "host:100", 1: "host:101 (earlier run)", 2: "host:102"}
  peers._connections = {0: "to 100", 1: "to 101 (earlier run)"}
  for k, address in ((0, "host:100"), (1, "host:201"), (2, "host:102")):
    store.key_value_set(f"layup_jax/transfer/{k}", address)
  peers.lost = {0}  # the admission's: process 0 is lost now
  peers.readdress()
  assert peers._addresses == {0: "host:100", 1: "host:201", 2: "host:102"}
  assert peers._connections == {0: "to 100"}


def test_a_sender_past_the_bound_of_malformed_sends_is_accused_once(elastic, capsys):
  store, members = elastic
  members.max_dropped_sends = 3
  peers = object.__new__(remote_peers.RemotePeers)
  peers._me, peers._client, peers._first, peers._count, peers.num_stages = 0, store, 0, 2, 3
  peers.dropped, peers.compressor, peers.latencies = {}, None, collections.deque()
  peers._pull = lambda source, uuid, j, s, encoded=False: {"w": jnp.full((2,), jnp.nan)}
  peers._arrived = lambda source, pulled: pulled
  notice = {"uuid": 7, "peer": 1, "stage": 2, "amount": 0.5, "encoded": False,
            "offered_at": 1.0, "average": False}
  for _ in range(5):
    peers._receive_one(2, notice)
  assert peers.dropped == {2: 5}
  assert [k for k, _ in store.key_value_dir_get("layup_jax/accused/")] == [
      "layup_jax/accused/2/0"]
  err = capsys.readouterr().err
  assert err.count("dropped a send from process 2") == 1
  assert err.count("asks the run to declare process 2 lost") == 1


def test_outside_an_elastic_run_an_accusation_stops_this_process_in_one_line(monkeypatch,
                                                                            capsys):
  members = membership.Membership()  # not elastic: nothing can go on without the other
  monkeypatch.setattr(membership.os, "_exit", lambda status: (_ for _ in ()).throw(
      SystemExit(status)))
  with pytest.raises(SystemExit) as stopped:
    members.accuse(FakeStore(), 1, "process 1 did not write layup_jax/gather/3/1 within 300 s")
  assert stopped.value.code == 4
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: process 1 did not write")
