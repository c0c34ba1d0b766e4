"""LayUp: asynchronous gossip with layer-wise push-sum updates (paper Algorithm 1).

The updater thread of device i, for each iteration of its compute thread:

  Randomly select a peer j
  w_i <- w_i / 2                                          (per-model weights only)
  for each layer l, as its gradient arrives:
    Local update:  x^{i,l} <- x~^{i,l} - eta grad(S_k, x^^{i,l})
    Communication: send(x^{i,l}, j)
    Peer update:   x^{j,l} <- (w_j x^^{j,l} + w_i x^{i,l}) / (w_i + w_j)
  w_j <- w_j + w_i                                        (per-model weights only)

`layup.push_sum` chooses the weights. `per_stage` (the default) gives every (device, stage) its
own weight: sending layer l halves w_{i,l}, and the peer update uses w_{j,l} and adds the sent
amount to it in the same atomic write, so each layer is an exact push-sum instance and the
average model is kept to rounding error. `per_model` is Algorithm 1 as written: one weight per
device, w_j grown only after the last layer. Layers are sent one at a time, so a third device
mixing a layer into j in between reads a w_j that does not match that layer, and the average
drifts (measured in docs/results.md); the paper accepts such contention as lock-free noise,
per_stage removes it at no cost (a float per stage).

Beyond the paper, `layup.fanout` sends each stage to that many distinct random peers per
iteration (per-stage weights; each send halves what the stage holds then): more mixing per
iteration, at that many times the messages.
"""

import dataclasses

import jax

from layup_jax.runtime.exchange import Hooks


@dataclasses.dataclass(frozen=True)
class Iteration:
  peer: int | None  # j, or None without gossip
  model_weight: list[float] | None  # per-model push-sum: the halved w_i, per stage
  more_peers: tuple[int, ...] = ()  # `layup.fanout` > 1: the iteration's other peers


class LayUp(Hooks):
  """Algorithm 1's updater (module docstring), on the replica store and outboxes: `begin` picks
  j (and halves w_i per model), `on_stage` is the loop body for layer s, `end` lets the last
  sends go and grows w_j per model. Where each step of the loop body runs:

  - Local update: in the program of the stage's backward, as its gradient is computed
    (runtime/replicas.py `DeviceStages.backward`, the jitted `runtime/programs.py
    local_update`), under the same atomic write a merge takes; `on_stage` finds it applied
    (`ReplicaStore.local_step` with grads None). `tuning.fuse_local_step=False` applies it
    here instead, from the gradient.
  - Communication: `Outbox.send_halved` (runtime/sends.py) takes x^{i,s} and halves w_{i,s}
    in one atomic write (runtime/replicas.py `ReplicaStore.take`), then copies the computed
    stage to j's device (`Transport.send`).
  - Peer update: `ReplicaStore.merge` (runtime/replicas.py) parks the stage and its amount in
    j's inbox; j's next program of stage s mixes it in (`programs.mix_received`, the push-sum
    merge of pushsum/mixing.py) and adds the amount to w_{j,s} in the same atomic write.
  """

  fuses_local_step = True
  sends_stages = True  # its sends to other processes are compressed (`Exchange.sends_stages`)

  def begin(self, i: int) -> Iteration:
    j = self.peers.pick(i)
    per_model = j is not None and self.links.options.push_sum == "per_model"
    more: list[int] = []
    for _ in range(4 * (self.links.options.fanout - 1)):  # beyond the paper: more peers
      if j is None or len(more) == self.links.options.fanout - 1:
        break
      k = self.peers.pick(i)
      if k not in (None, j, *more):
        more.append(k)
    return Iteration(j, self.store.halve_model_weight(i) if per_model else None, tuple(more))

  def on_stage(self, i: int, it: Iteration, s: int, grads, step: jax.Array):
    x = self.store.local_step(i, s, grads, step)  # Local update
    if it.peer is None:
      return x
    outbox = self.links.outboxes[i]
    if it.model_weight is None:  # per stage: w_{i,s} halved as x^{i,s} leaves, w_{j,s} += it
      landed = outbox.send_halved(it.peer, s)  # Communication; the peer update on j's device
      for k in it.more_peers:  # each takes half of what the stage holds then
        outbox.send_halved(k, s)
      return landed
    return outbox.send_weighted(it.peer, s, it.model_weight[s])  # per model: w_i halved at begin

  def end(self, i: int, it: Iteration):
    if it.peer is None:
      return
    yield from self.links.outboxes[i].flush()  # every layer of this iteration sent
    if it.model_weight:
      self.store.add_model_weight(it.peer, it.model_weight)  # w_j <- w_j + w_i

