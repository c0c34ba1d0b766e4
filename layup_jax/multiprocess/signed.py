"""The coordination store as the project uses it: every value it writes under `layup_jax/`
carries an HMAC-SHA256 tag of the run's secret over its key and value, and a value read there
without a valid tag is ignored.

The secret is the environment variable `LAYUP_JAX_RUN_SECRET` (`python -m layup_jax.launch`
makes one for its processes; on a cluster give every process the same one, e.g. from a file
only the run's user reads). Without it a multi-process run says once that its store is not
authenticated and goes on as before. A value whose tag does not verify (written by a client
outside the run, or with another secret) is deleted, named once in a line on stderr, and read
as absent: a blocking read goes on waiting for the run's own value, a directory read leaves
it out. JAX's own keys (outside `layup_jax/`) pass through unchanged.
"""

import hashlib
import hmac
import os
import sys
import threading

from layup_jax.platform import compat

SECRET_VARIABLE = "LAYUP_JAX_RUN_SECRET"
PREFIX = "layup_jax/"
_TAG_HEX = 64  # SHA-256's 32 bytes as hex: the first characters of every signed value


def run_secret() -> bytes | None:
  """The run's secret from the environment (None: the run's store is not authenticated)."""
  value = os.environ.get(SECRET_VARIABLE, "")
  return value.encode() if value else None


class SignedStore:
  """A coordination client (jax's, or anything with its key-value calls) whose values under
  `layup_jax/` are tagged on write and checked on read with `secret`; None: passed through."""

  def __init__(self, client, secret: bytes | None):
    self._client, self._secret = client, secret
    self._named: set[str] = set()
    self._lock = threading.Lock()
    self.ignored = 0  # values read without a valid tag

  def _signs(self, key: str) -> bool:
    return self._secret is not None and key.startswith(PREFIX)

  def _tag(self, key: str, data: bytes) -> bytes:
    return hmac.new(self._secret, key.encode() + b"\0" + data, hashlib.sha256).digest()

  def _ignore(self, key: str) -> None:
    """A value at `key` without a valid tag: deleted, counted and named once."""
    with self._lock:
      self.ignored += 1
      first = key not in self._named
      self._named.add(key)
    try:
      self._client.key_value_delete(key)
    except Exception:  # noqa: BLE001 - gone already: nothing to remove
      pass
    if first:
      print(f"ignored the value at {key}: it does not carry this run's tag (written from "
            f"outside the run, or with another {SECRET_VARIABLE})", file=sys.stderr, flush=True)

  def _open_text(self, key: str, raw: str) -> str | None:
    if not self._signs(key):
      return raw
    tag, value = raw[:_TAG_HEX], raw[_TAG_HEX:]
    if len(tag) == _TAG_HEX and hmac.compare_digest(
        tag, self._tag(key, value.encode()).hex()):
      return value
    self._ignore(key)
    return None

  def _open_bytes(self, key: str, raw: bytes) -> bytes | None:
    if not self._signs(key):
      return raw
    tag, value = raw[:_TAG_HEX], raw[_TAG_HEX:]
    if len(tag) == _TAG_HEX and hmac.compare_digest(tag, self._tag(key, value).hex().encode()):
      return value
    self._ignore(key)
    return None

  # --- the client's calls ----------------------------------------------------------------------

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    if self._signs(key):
      value = self._tag(key, value.encode()).hex() + value
    self._client.key_value_set(key, value, allow_overwrite=allow_overwrite)

  def key_value_set_bytes(self, key: str, value: bytes) -> None:
    if self._signs(key):  # the same form as text's: a value set as text may be read as bytes
      value = self._tag(key, value).hex().encode() + value
    self._client.key_value_set_bytes(key, value)

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    value = self._open_text(key, self._client.blocking_key_value_get(key, timeout_ms))
    if value is None:  # as if not written yet: the caller waits for the run's own value
      raise RuntimeError(f"DEADLINE_EXCEEDED: the value at {key} was ignored")
    return value

  def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
    value = self._open_bytes(key, self._client.blocking_key_value_get_bytes(key, timeout_ms))
    if value is None:
      raise RuntimeError(f"DEADLINE_EXCEEDED: the value at {key} was ignored")
    return value

  def key_value_try_get(self, key: str) -> str:
    value = self._open_text(key, self._client.key_value_try_get(key))
    if value is None:
      raise RuntimeError(f"NOT_FOUND: the value at {key} was ignored")
    return value

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    entries = []
    for key, raw in self._client.key_value_dir_get(prefix):
      value = self._open_text(key, raw)
      if value is not None:
        entries.append((key, value))
    return entries

  def key_value_delete(self, key: str) -> None:
    self._client.key_value_delete(key)

  def __getattr__(self, name: str):  # anything else: the client's own (JAX's keys)
    return getattr(self._client, name)


_store: SignedStore | None = None
_store_of = None  # the raw client the store wraps


def client() -> SignedStore:
  """This process's coordination client, signing and checking the project's values with the
  run's secret; says once when the run has none."""
  global _store, _store_of
  raw = compat.coordination_client()
  if _store is None or _store_of is not raw:
    secret = run_secret()
    if secret is None and raw is not None:
      print(f"note: {SECRET_VARIABLE} is not set: the values this run's processes exchange "
            f"through the coordination service are not authenticated (python -m "
            f"layup_jax.launch sets one; docs/guide/several_hosts.md)", file=sys.stderr,
            flush=True)
    _store, _store_of = SignedStore(raw, secret), raw
  return _store
