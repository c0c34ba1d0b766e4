"""Compressed gossip sends to other processes, with the push-sum mass kept exact.

A send to another process's device carries stage s of device i with the push-sum amount a
(layup_jax/runtime/sends.py). Compressed, it carries `c = Q(x_{i,s} + e_{i,s} / a)` instead of
x_{i,s}, where Q is the codec's rounding and e_{i,s} is the error feedback: the mass the earlier
compressed sends of that stage left out,

    e_{i,s} <- e_{i,s} + a x_{i,s} - a c,

so the sum of `a c` over a device's sends equals the sum of `a x` minus the current e (in mass
units, the error telescopes whatever the amounts). Push-sum weights never go through Q: every
stage's weights still sum to 1 exactly. Between consistent points the replicas' mass is short
of e; at each one (`Compressor.settle`, every task idle) device i takes its residual back into
its own replica, `x_{i,s} <- x_{i,s} + e_{i,s} / w_{i,s}`, and the push-sum average is exact
again there (checkpoints and evaluations need nothing new). The residuals' sum over the run's
devices, against the stage's mass, is the compression's effect on the average in between
(`residual_mass`; docs/records/multihost.md reports it).

Codecs: "bf16" (2 bytes a value) and "int8" (1 byte a value, one float32 scale per block of
`BLOCK` values: blockwise, so a packed stage's small conv weights are not rounded on the scale
of its BatchNorm gammas). Only the parameters are compressed; BatchNorm statistics, when mixed,
travel as they are.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
CODECS = ("none", "bf16", "int8")  # config.distributed.compression
BLOCK = 256  # int8: values per scale


def _is_float(leaf) -> bool:
  return jnp.issubdtype(leaf.dtype, jnp.floating)


def encode_leaf(x: jax.Array, codec: str) -> PyTree:
  """What travels for one float array: bf16 values, or its int8 values (flat, no padding) and
  one scale per block."""
  if codec == "bf16":
    return x.astype(jnp.bfloat16)
  flat = x.astype(jnp.float32).ravel()
  blocks = _blocks(flat)  # [n_blocks, block]
  scale = jnp.max(jnp.abs(blocks), axis=1) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.round(blocks / safe[:, None]).astype(jnp.int8)
  return q.ravel()[:flat.size], scale


def decode_leaf(wire: PyTree, like: jax.ShapeDtypeStruct, codec: str) -> jax.Array:
  """`encode_leaf`'s inverse, up to its rounding, as an array like `like`."""
  if codec == "bf16":
    return wire.astype(like.dtype)
  q, scale = wire
  flat = (_blocks(q.astype(jnp.float32)) * scale[:, None]).ravel()[:q.size]
  return flat.reshape(like.shape).astype(like.dtype)


def _blocks(flat: jax.Array) -> jax.Array:
  """`flat` zero-padded into rows of `BLOCK` (one row if it is smaller): int8's blocks."""
  block = max(1, min(BLOCK, flat.size))
  return jnp.pad(flat, (0, (-flat.size) % block)).reshape(-1, block)


def _params_half(part: PyTree) -> tuple[PyTree, PyTree | None]:
  """The parameters of a send, and its BatchNorm statistics (None unless mixed)."""
  return part if isinstance(part, tuple) else (part, None)


def encode(part: PyTree, residual: PyTree, amount: jax.Array, codec: str
           ) -> tuple[PyTree, PyTree]:
  """(what travels, the new residual) for a send of `part` carrying push-sum `amount`, given
  the stage's residual (module docstring). Pure: jitted per codec."""
  params, state = _params_half(part)

  treedef = jax.tree.structure(params)
  wires, residuals = [], []
  for x, e in zip(jax.tree.leaves(params), treedef.flatten_up_to(residual)):
    if not _is_float(x):
      wires.append(x)
      residuals.append(e)
      continue
    wire = encode_leaf(x + e / amount, codec)
    wires.append(wire)
    residuals.append(e + amount * (x - decode_leaf(wire, x, codec)))
  wire = treedef.unflatten(wires)
  return ((wire, state) if state is not None else wire), treedef.unflatten(residuals)


def decode(wire: PyTree, template: PyTree, codec: str) -> PyTree:
  """The part a received `wire` stands for, shaped as `template` (a send's part)."""
  params, state = _params_half(template)
  wire_params, wire_state = _params_half(wire) if state is not None else (wire, None)
  treedef = jax.tree.structure(params)
  decoded = [decode_leaf(w, like, codec) if _is_float(like) else w
             for w, like in zip(treedef.flatten_up_to(wire_params), jax.tree.leaves(params))]
  params = treedef.unflatten(decoded)
  return (params, wire_state) if state is not None else params


def wire_template(template: PyTree, codec: str) -> PyTree:
  """Shapes and dtypes of what travels for a part shaped as `template`."""
  params, _ = _params_half(template)  # a residual has the parameters' shapes
  return jax.eval_shape(functools.partial(encode, codec=codec), template, params,
                        jax.ShapeDtypeStruct((), jnp.float32))[0]


class Compressor:
  """Each local device's per-stage residuals, and the jitted encode and decode of one codec."""

  def __init__(self, codec: str, templates: list[PyTree], devices: list[jax.Device]):
    """`templates[s]`: a send of stage s (`ReplicaStore.part_template`); `devices`: this
    process's."""
    if codec not in CODECS[1:]:
      raise ValueError(f"compression must be one of {CODECS[1:]}, got {codec!r}")
    self.codec = codec
    self._encode = jax.jit(functools.partial(encode, codec=codec), donate_argnums=(1,))
    self._decode = [jax.jit(functools.partial(decode, template=t, codec=codec))
                    for t in templates]
    self.wire_templates = [wire_template(t, codec) for t in templates]
    self._residuals = [[self._zeros(t, device) for t in templates] for device in devices]

  @staticmethod
  def _zeros(template: PyTree, device: jax.Device) -> PyTree:
    params, _ = _params_half(template)
    return jax.device_put(jax.tree.map(lambda t: np.zeros(t.shape, t.dtype), params), device)

  def encode(self, i: int, s: int, part: PyTree, amount: float) -> PyTree:
    """What travels for device i's send of stage s (`part`, on its device) with `amount`;
    dispatched after the send's part, so it is computed right after it."""
    wire, self._residuals[i][s] = self._encode(part, self._residuals[i][s], np.float32(amount))
    return wire

  def decode(self, s: int, wire: PyTree) -> PyTree:
    """The part a received send of stage s stands for (on the wire's device)."""
    return self._decode[s](wire)

  def compile(self, params: list[list[PyTree]]) -> list:
    """Runs encode and decode once per stage on every device (the runtime's compile: none
    may compile inside the timed loop), on `params[i][s]` as they are; the residuals stay
    zero (`settle`'s own programs are compiled by calling it). Returns the outputs to wait
    for."""
    outputs = []
    for i, stages in enumerate(self._residuals):
      for s, residual in enumerate(stages):
        zeros = jax.tree.map(jnp.zeros_like, residual)
        wire, _ = self._encode(params[i][s], zeros, np.float32(0.5))
        outputs.append(self._decode[s](wire))
    return outputs

  def residual_mass(self, s: int) -> PyTree:
    """The mass this process's sends of stage s hold back now (the sum of its devices'
    residuals, on the host): the push-sum average is short of it over the run's weight sum."""
    total = None
    for stages in self._residuals:
      host = jax.tree.map(np.asarray, jax.device_get(stages[s]))
      total = host if total is None else jax.tree.map(np.add, total, host)
    return total

  def settle(self, weight, add_to_params) -> None:
    """At a consistent point: each residual goes back into its own replica,
    `add_to_params(i, s, e_{i,s} / weight(i, s))`, and is zero again."""
    for i, stages in enumerate(self._residuals):
      for s, residual in enumerate(stages):
        share = np.float32(1.0 / weight(i, s))
        add_to_params(i, s, jax.tree.map(lambda e, share=share: e * share, residual))
        stages[s] = jax.tree.map(jnp.zeros_like, residual)
