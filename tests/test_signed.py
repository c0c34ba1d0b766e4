"""What the processes of a run exchange through the coordination store is authenticated with the
run's secret: a value without its tag is ignored, named once, and read as absent."""

import pytest

from layup_jax import launch
from layup_jax.multiprocess import signed
from tests.test_membership import FakeStore


def _stores():
  raw = FakeStore()
  return raw, signed.SignedStore(raw, b"the run's secret")


def test_the_runs_own_values_read_back_as_written():
  raw, store = _stores()
  store.key_value_set("layup_jax/lost/2", "40", allow_overwrite=True)
  store.key_value_set_bytes("layup_jax/gather/7/1", b"\x00\x01part")
  assert store.blocking_key_value_get("layup_jax/lost/2", 10) == "40"
  assert store.blocking_key_value_get_bytes("layup_jax/gather/7/1", 10) == b"\x00\x01part"
  assert store.key_value_try_get("layup_jax/lost/2") == "40"
  assert store.key_value_dir_get("layup_jax/lost/") == [("layup_jax/lost/2", "40")]
  assert raw.values["layup_jax/lost/2"] != "40"  # tagged in the store
  assert store.ignored == 0


@pytest.mark.parametrize("forge", [
    lambda raw, other: raw.key_value_set("layup_jax/lost/1", "5"),  # no tag at all
    lambda raw, other: other.key_value_set("layup_jax/lost/1", "5"),  # another secret's
    lambda raw, other: raw.key_value_set(  # a tag of this run's, moved to another key
        "layup_jax/lost/1", raw.values["layup_jax/lost/9"]),
])
def test_a_value_without_the_runs_tag_is_ignored_deleted_and_named_once(capsys, forge):
  raw, store = _stores()
  store.key_value_set("layup_jax/lost/9", "5")
  forge(raw, signed.SignedStore(raw, b"another secret"))
  assert store.key_value_dir_get("layup_jax/lost/") == [("layup_jax/lost/9", "5")]
  assert "layup_jax/lost/1" not in raw.values  # deleted: the run's own writer may write it
  with pytest.raises(RuntimeError, match="DEADLINE_EXCEEDED"):  # a blocking read waits on
    forge(raw, signed.SignedStore(raw, b"another secret"))
    store.blocking_key_value_get("layup_jax/lost/1", 10)
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines == ["ignored the value at layup_jax/lost/1: it does not carry this run's tag "
                   "(written from outside the run, or with another LAYUP_JAX_RUN_SECRET)"]
  assert store.ignored == 2
  store.key_value_set("layup_jax/lost/1", "6")  # the key is free again for the run's own value
  assert store.blocking_key_value_get("layup_jax/lost/1", 10) == "6"


def test_jaxs_own_keys_and_a_run_without_a_secret_pass_through():
  raw, store = _stores()
  store.key_value_set("jax/topology", "x")
  assert raw.values["jax/topology"] == "x" and store.blocking_key_value_get("jax/topology", 1)
  open_store = signed.SignedStore(raw, None)
  open_store.key_value_set("layup_jax/done/1", "1")
  assert raw.values["layup_jax/done/1"] == "1"


def test_the_launcher_gives_its_processes_one_fresh_secret_or_the_callers(monkeypatch):
  monkeypatch.delenv(signed.SECRET_VARIABLE, raising=False)
  assert launch.SECRET_VARIABLE == signed.SECRET_VARIABLE
  first, second = launch.environment(4), launch.environment(4)
  secret = first[signed.SECRET_VARIABLE]
  assert len(secret) == 64 and int(secret, 16) and secret != second[signed.SECRET_VARIABLE]
  monkeypatch.setenv(signed.SECRET_VARIABLE, "given")
  assert launch.environment(4)[signed.SECRET_VARIABLE] == "given"


def test_a_value_set_as_text_reads_back_as_bytes():
  """A gather's member list is written as text and read as bytes (`gathers.await_value`)."""
  _, store = _stores()
  store.key_value_set("layup_jax/gather/3/members", "[0, 1]")
  assert store.blocking_key_value_get_bytes("layup_jax/gather/3/members", 10) == b"[0, 1]"
  assert store.ignored == 0
