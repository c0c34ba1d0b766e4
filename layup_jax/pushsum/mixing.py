"""Push-sum maths (Kempe et al. 2003) as used by LayUp: no threads, no devices.

Replica i holds, per stage s, parameters x_{i,s} and a host weight w_{i,s} (float64, 1/M at
start). Sending stage s to a peer j halves w_{i,s} and ships x_{i,s} with the halved amount a;
the peer mixes `x_{j,s} <- (w_{j,s} x_{j,s} + a x_{i,s}) / (w_{j,s} + a)` and adds a to w_{j,s}.
The mass `sum_i w_{i,s} x_{i,s}` and the weight sum of every stage are invariant under a send,
so each stage's consensus `x_bar_s = sum_i w_{i,s} x_{i,s} / sum_i w_{i,s}` only moves through
the local optimizer steps: every stage is an exact push-sum instance.

Paper Algorithm 1 keeps one weight per device instead: w_i is halved when an iteration's sends
begin, each stage is mixed in with the peer's current w_j, and w_j grows by the sent amount
after the last stage. With stages sent one at a time, a third device can mix a stage into j
between two of i's stages and read a w_j that does not match the stage it mixes into, so the
average drifts (layup.push_sum=per_model keeps this form, as columns of equal weights).
"""

from collections.abc import Sequence

import jax
import optax

PyTree = object


def merge(receiver: PyTree, sent: PyTree, receiver_share: jax.Array) -> PyTree:
  """`receiver_share * receiver + (1 - receiver_share) * sent`, leaf by leaf, in their dtype."""
  mixed = optax.tree.add_scale(sent, receiver_share, optax.tree.sub(receiver, sent))
  return optax.tree.cast_like(mixed, receiver)


def toward_average(current: PyTree, mine: PyTree, theirs: PyTree) -> PyTree:
  """`current + (theirs - mine) / 2`: a symmetric pairwise average applied as a correction.

  With `current == mine` it is `(mine + theirs) / 2`. Both sides of a pair receive opposite
  corrections, so the sum of the two models is kept exactly (up to rounding) even when a
  local step landed on `current` after `mine` was read, and that step is kept too.
  """
  moved = optax.tree.add_scale(current, 0.5, optax.tree.sub(theirs, mine))
  return optax.tree.cast_like(moved, current)


class PushSumWeights:
  """The host-side push-sum weights w_{i,s}: one float64 per device and stage, 1/M at start.

  Plain floats without a lock of their own: the replica store changes w_{i,s} only while it
  holds the lock of stage s of device i, in the same atomic write as the stage it weighs.
  """

  def __init__(self, num_devices: int, num_stages: int, total_devices: int | None = None):
    """`total_devices`: the run's device count where these are some of them (one process of
    several), so that the sum over the whole run is 1."""
    share = 1.0 / (total_devices or num_devices)
    self.values = [[share] * num_stages for _ in range(num_devices)]
    # A device's weight at equal shares, 1 / (devices in the average): what `update_scale`
    # divides by the device's weight (set anew when an elastic run loses or regains devices).
    self.equal_share = share

  def halve(self, sender: int, s: int) -> float:
    """`w_{i,s} <- w_{i,s} / 2`; returns the halved amount, which travels with the stage."""
    sent = self.values[sender][s] / 2.0
    self.values[sender][s] -= sent
    return sent

  def receiver_share(self, receiver: int, s: int, sent: float) -> float:
    """The receiver's coefficient `w_{j,s} / (w_{j,s} + sent)` in the merge."""
    w_receiver = self.values[receiver][s]
    return w_receiver / (w_receiver + sent)

  def add(self, receiver: int, s: int, sent: float) -> None:
    self.values[receiver][s] += sent

  def rescale(self, factors: Sequence[float]) -> None:
    """`w_{i,s} <- factors[s] w_{i,s}` for every device (at a consistent point: nothing in
    flight carries weight)."""
    for row in self.values:
      row[:] = [w * f for w, f in zip(row, factors)]

  def update_scale(self, i: int, s: int, max_scale: float, arriving: float = 0.0) -> float:
    """The factor of device i's local update of stage s in the numerator form: its equal
    share over its weight, `(1/n) / w_{i,s}`, at most `max_scale` (`arriving`: an amount a
    merge adds to w_{i,s} just before the update).

    A local step `x_{i,s} <- x_{i,s} - eta u` moves the push-sum average
    `sum_i w_{i,s} x_{i,s}` by `eta w_{i,s} u`: each gradient counts by its device's weight at
    that moment, and random-peer push-sum weights spread wide (a device that sent twice and
    received nothing holds a quarter of its share), which makes the average's gradient as noisy
    as a smaller batch's. Scaled by `(1/n) / w_{i,s}`, the step moves the average by
    `eta u / n` whatever the weight, as the step on the push-sum numerator `w x` does in
    stochastic gradient push (Assran et al. 2019); the bound keeps a device whose weight is
    near 0 from taking a step many times the learning rate."""
    return min(self.equal_share / max(self.values[i][s] + arriving, 1e-300), max_scale)

  def sums(self) -> list[float]:
    """The weight sum of each stage (1 while no weight is lost)."""
    return [float(sum(column)) for column in zip(*self.values)]
