"""Received gossip is checked before a merge: a notice's device, stage and push-sum amount in
range, the stage's values finite; a bad send is dropped and counted, its sender named once."""

import collections
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from layup_jax.multiprocess import remote_peers


def _receiver(arrives):
  """Process 1's receiving side, devices 4-7 of a model of 3 stages, pulling `arrives`."""
  peers = object.__new__(remote_peers.RemotePeers)
  peers._me, peers._first, peers._count, peers.num_stages = 1, 4, 4, 3
  peers.dropped, peers.compressor, peers.latencies = {}, None, collections.deque()
  peers.merged = []
  peers._merge = lambda j, s, received, amount: peers.merged.append((j, s, amount))
  peers._pull = lambda source, uuid, j, s, encoded=False: arrives
  peers._arrived = lambda source, pulled: pulled
  return peers


def _notice(**changes):
  return {"uuid": 7, "peer": 5, "stage": 2, "amount": 0.25, "encoded": False,
          "offered_at": 1.0, "average": False, **changes}


GOOD = {"w": jnp.ones((2, 2))}


@pytest.mark.parametrize("changes,problem", [
    ({"peer": 3}, "device 3"), ({"peer": 8}, "device 8"), ({"peer": "5"}, "device '5'"),
    ({"stage": 3}, "stage 3 of 3"), ({"stage": -1}, "stage -1"),
    ({"amount": math.nan}, "amount nan"), ({"amount": math.inf}, "amount inf"),
    ({"amount": 0.0}, "amount 0.0"), ({"amount": -0.5}, "amount -0.5"),
    ({"amount": 1.5}, "amount 1.5"), ({"amount": True}, "amount True"),
    ({"uuid": "x"}, "malformed offer"),
])
def test_a_notice_out_of_range_is_dropped_counted_and_its_sender_named_once(
    capsys, changes, problem):
  peers = _receiver(GOOD)
  peers._receive_one(2, _notice(**changes))
  peers._receive_one(2, _notice(**changes))
  assert peers.merged == [] and peers.dropped == {2: 2}
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and "from process 2" in lines[0] and problem in lines[0]


def test_a_stage_with_non_finite_values_is_dropped_and_a_good_one_merged(capsys):
  for bad in (np.nan, np.inf, -np.inf):
    peers = _receiver({"w": jnp.ones((2, 2)).at[1, 0].set(bad)})
    peers._receive_one(3, _notice())
    assert peers.merged == [] and peers.dropped == {3: 1}
    assert "non-finite" in capsys.readouterr().err
  peers = _receiver(GOOD)
  peers._receive_one(3, _notice())
  assert peers.merged == [(1, 2, 0.25)] and peers.dropped == {}


def test_notices_that_do_not_parse_are_refused_not_raised():
  assert remote_peers._parse_notice("{not json") == {}
  assert remote_peers._parse_notice("[1, 2]") == {}
  assert remote_peers._parse_notice(json.dumps(_notice())) == _notice()
  assert _receiver(GOOD).notice_problem({}) == "a notice without its fields"
  assert _receiver(GOOD).notice_problem(_notice(amount=0.0), average=True) is None
