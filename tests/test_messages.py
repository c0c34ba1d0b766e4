"""Nothing read from another process is executed: a gather's parts are messages of data only
(`multiprocess.messages`), checked against the receiver's own part before use."""

import os
import pickle

import jax
import ml_dtypes
import numpy as np
import pytest

from layup_jax.errors import UserError
from layup_jax.multiprocess import gathers, membership, messages
from layup_jax.platform import compat
from tests.test_membership import FakeStore


class _CreatesAFile:
  """Unpickled, it creates `path` (what a stranger's payload could do with any callable)."""

  def __init__(self, path):
    self.path = str(path)

  def __reduce__(self):
    return (open, (self.path, "w"))


def _evaluation_part(scale: float = 1.0) -> dict:
  """The form of a run's gathered statistics: per-stage trees of arrays, lists of numbers."""
  return {"mass": [{"dense": {"kernel": scale * np.ones((3, 2), np.float32)}}, {}],
          "weights": [[0.5, 0.25]], "losses": [2.5], "bytes_sent": 120, "process": 1,
          "first": 4, "saves": True, "exchange": {"moments": np.zeros(4, ml_dtypes.bfloat16)}}


def test_data_with_arrays_goes_through_a_message_unchanged():
  value = {**_evaluation_part(), "pair": (1, 2.0), "none": None, "name": "layup",
           "ints": np.arange(6, dtype=np.int64).reshape(2, 3), "scalar": np.float32(1.5)}
  back = messages.decode(messages.encode(value), like=value)
  assert back["pair"] == [1, 2.0] and back["none"] is None and back["scalar"] == 1.5
  np.testing.assert_array_equal(back["ints"], value["ints"])
  assert back["exchange"]["moments"].dtype == ml_dtypes.bfloat16
  assert back["mass"][0]["dense"]["kernel"].dtype == np.float32
  assert back["mass"][1] == {} and back["weights"] == [[0.5, 0.25]]


def test_a_pickled_payload_is_refused_and_runs_nothing(tmp_path):
  payload = pickle.dumps({"mass": _CreatesAFile(tmp_path / "ran")})
  with pytest.raises(messages.MessageError, match="not a valid message"):
    messages.decode(payload, like=_evaluation_part())
  assert not (tmp_path / "ran").exists()
  with pytest.raises(TypeError):  # and nothing but data can be sent
    messages.encode({"mass": _CreatesAFile(tmp_path / "ran")})


@pytest.mark.parametrize("change,problem", [
    (lambda v: v.pop("losses"), "keys"),
    (lambda v: v.__setitem__("mass", "x"), "not a list"),
    (lambda v: v["mass"][0]["dense"].__setitem__("kernel", "text"), "not an array"),
    (lambda v: v["mass"][0]["dense"].__setitem__("kernel", np.ones(3, np.float64)),
     "float64 array of rank 1"),
    (lambda v: v["weights"].append(["half"]), "not a number"),
    (lambda v: v.__setitem__("saves", 1), "not a boolean"),
])
def test_a_part_not_of_the_receivers_form_is_refused_naming_where(change, problem):
  theirs = _evaluation_part()
  change(theirs)
  with pytest.raises(messages.MessageError, match=problem):
    messages.decode(messages.encode(theirs), like=_evaluation_part(), what="part 0")


def test_an_arrays_header_must_match_its_bytes():
  import msgpack

  forged = msgpack.ExtType(1, msgpack.packb(["float32", [1000, 1000], b"\0" * 8]))
  with pytest.raises(messages.MessageError, match="has 8 bytes"):
    messages.decode(msgpack.packb({"a": forged}))
  unknown = msgpack.ExtType(1, msgpack.packb(["object", [1], b"\0" * 8]))
  with pytest.raises(messages.MessageError, match="malformed"):
    messages.decode(msgpack.packb({"a": unknown}))


def test_a_stranger_writing_to_the_store_runs_no_code(tmp_path, monkeypatch):
  """A client of the coordination service writes, under the key a gather of process 0 reads
  next, a payload that would create a file if unpickled: no file appears, and the gather stops
  this process with one line (a `UserError`, which the command prints alone) naming the part."""
  store = FakeStore()
  monkeypatch.setattr(compat, "coordination_client", lambda: store)
  monkeypatch.setattr(membership.gather_order, "next", 7)
  monkeypatch.setattr(membership, "members", membership.Membership())
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  store.key_value_set_bytes("layup_jax/gather/7/1",
                            pickle.dumps({"mass": _CreatesAFile(tmp_path / "ran")}))
  with pytest.raises(UserError) as stopped:
    gathers.all_gather_data(_evaluation_part())
  assert not (tmp_path / "ran").exists() and not os.path.exists("ran")
  assert "part 1 of gather layup_jax/gather/7" in str(stopped.value)
  assert "\n" not in str(stopped.value) and stopped.value.exit_code == 4
  # A well-formed part of another process is read as it was sent.
  monkeypatch.setattr(membership.gather_order, "next", 8)
  store.key_value_set_bytes("layup_jax/gather/8/1", messages.encode(_evaluation_part(2.0)))
  mine, theirs = gathers.all_gather_data(_evaluation_part())
  assert float(theirs["mass"][0]["dense"]["kernel"][0, 0]) == 2.0


def test_a_random_generators_state_goes_through_a_message():
  """A device's peer generator state (PCG64: 128-bit integers) travels in a checkpoint's gather."""
  state = np.random.default_rng(3).bit_generator.state
  back = messages.decode(messages.encode({"peer_rngs": [state]}))
  generator = np.random.default_rng()
  generator.bit_generator.state = back["peer_rngs"][0]
  expected = np.random.default_rng(3)
  assert generator.integers(0, 1 << 30, 5).tolist() == expected.integers(0, 1 << 30, 5).tolist()
  assert messages.decode(messages.encode(-(1 << 100))) == -(1 << 100)
