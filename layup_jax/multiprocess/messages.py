"""What crosses a process boundary through the coordination store: data only.

A message is msgpack of nested dicts (string or integer keys), lists, numbers (integers of any
size), strings, booleans, None and NumPy arrays of numeric dtypes (an array: its dtype's name,
its shape and its bytes).
Decoding builds nothing else: no class is looked up and no code runs, whatever the bytes (unlike
pickle, whose payload can name any callable). A decoded message is then checked against the
receiver's own value of the same gather (`like`): the same keys, arrays where it has arrays (of
its dtype and rank), numbers where it has numbers, lists item by item; anything else is
refused with `MessageError`, naming what differed.
"""

from typing import Any

import msgpack
import numpy as np

from layup_jax.errors import UserError

_ARRAY = 1  # msgpack extension code of an array
_BIG_INT = 2  # of an integer beyond 64 bits (a random generator's state), as its decimal digits
_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                     "uint64", "float16", "bfloat16", "float32", "float64"})


class MessageError(UserError):
  """Bytes from another process that are not a message of the expected form."""

  exit_code = 4


def _pack(obj: Any) -> Any:
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, int) and not isinstance(obj, bool):  # beyond msgpack's 64 bits
    return msgpack.ExtType(_BIG_INT, str(obj).encode())
  if hasattr(obj, "__array__") and hasattr(obj, "dtype"):  # NumPy and JAX arrays
    array = np.ascontiguousarray(np.asarray(obj))
    if array.dtype.name not in _DTYPES:
      raise TypeError(f"an array of dtype {array.dtype} is not sent between processes")
    return msgpack.ExtType(_ARRAY, msgpack.packb(
        [array.dtype.name, list(array.shape), array.tobytes()], use_bin_type=True))
  raise TypeError(f"a {type(obj).__name__} is not data that is sent between processes")


def encode(value: Any) -> bytes:
  """`value` as a message (tuples travel as lists)."""
  return msgpack.packb(value, default=_pack, use_bin_type=True)


def _unpack_extension(code: int, data: bytes) -> np.ndarray | int:
  if code == _BIG_INT:
    text = data.decode("ascii", errors="replace")
    if not (0 < len(text) <= 400 and text.lstrip("-").isdigit()):
      raise MessageError("a large integer is malformed")
    return int(text)
  if code != _ARRAY:
    raise MessageError(f"unknown extension type {code}")
  parts = msgpack.unpackb(data, raw=False)
  if not (isinstance(parts, list) and len(parts) == 3 and parts[0] in _DTYPES
          and isinstance(parts[1], list) and isinstance(parts[2], bytes)
          and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                  for n in parts[1])):
    raise MessageError("an array's header is malformed")
  dtype = np.dtype(parts[0])
  if len(parts[2]) != int(np.prod(parts[1], dtype=np.int64)) * dtype.itemsize:
    raise MessageError(f"an array of shape {parts[1]} and dtype {dtype} has "
                       f"{len(parts[2])} bytes")
  return np.frombuffer(parts[2], dtype).reshape(parts[1]).copy()


def decode(data: bytes, like: Any = None, what: str = "a message") -> Any:
  """The value of a message, checked against `like` (the receiver's own value of the same
  kind; None checks nothing beyond its being data). `what` names it in the error."""
  try:
    value = msgpack.unpackb(data, ext_hook=_unpack_extension, raw=False, strict_map_key=False)
  except MessageError as error:
    raise MessageError(f"{what} is not a valid message: {error}") from None
  except Exception as error:  # noqa: BLE001 - any malformed bytes: refused alike
    raise MessageError(f"{what} is not a valid message ({type(error).__name__}: "
                       f"{str(error)[:120]})") from None
  problem = _unlike(value, like, "")
  if problem:
    raise MessageError(f"{what} does not have the expected form: {problem}")
  return value


def _unlike(value: Any, like: Any, path: str) -> str | None:
  """Where `value` departs from the form of `like` (None: it does not)."""
  where = path or "the message"
  if like is None or value is None:
    return None
  if isinstance(like, dict):
    if not isinstance(value, dict):
      return f"{where} is a {type(value).__name__}, not a dict"
    if set(value) != set(like):
      return f"{where} has keys {sorted(map(str, value))[:8]}, not {sorted(map(str, like))[:8]}"
    for key in like:
      problem = _unlike(value[key], like[key], f"{path}/{key}")
      if problem:
        return problem
    return None
  if isinstance(like, (list, tuple)):
    if not isinstance(value, list):
      return f"{where} is a {type(value).__name__}, not a list"
    # A list as long as the receiver's is read item by item (a model's stages); another length
    # (a list per device, where processes drive different counts) item by item against its first.
    for k, item in enumerate(value):
      template = like[k] if len(value) == len(like) else (like[0] if like else None)
      problem = _unlike(item, template, f"{path}/{k}")
      if problem:
        return problem
    return None
  if isinstance(like, bool):
    return None if isinstance(value, bool) else f"{where} is not a boolean"
  if isinstance(like, (int, float, np.number)):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return None if ok else f"{where} is not a number"
  if isinstance(like, str):
    return None if isinstance(value, str) else f"{where} is not a string"
  if hasattr(like, "__array__") and hasattr(like, "dtype"):
    if not isinstance(value, np.ndarray):
      return f"{where} is not an array"
    if value.dtype != np.dtype(like.dtype) or value.ndim != np.ndim(like):
      return (f"{where} is a {value.dtype} array of rank {value.ndim}, not {like.dtype} of "
              f"rank {np.ndim(like)}")
    return None
  return None
