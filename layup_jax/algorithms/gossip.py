"""Gossip baselines on the asynchronous runtime: the same replicas, threads, data and stragglers.

GoSGD (Blot et al. 2016): after the full backward pass, push-sum gossip of the *whole* model to
one random peer. It is LayUp without layer-wise updates, the ablation that isolates them. Its
push-sum weights follow `layup.push_sum` as LayUp's do (per stage by default: each stage an
exact push-sum instance; per model: one weight per device, added to the peer after the last
stage).

AD-PSGD (Lian et al. 2018, ICML, Algorithm 1): a device computes its gradient on its local
model, averages its model with one random peer, both keeping the average, and only then
applies the gradient to the averaged model: the gradient stays with the device that computed
it. Here the average and the step go stage by stage as the gradients
arrive, each stage averaged before its gradient is applied; the average of each stage is one
atomic pairwise step of the replica store (`ReplicaStore.average_pair`): the sum of all models
is kept whatever local steps land meanwhile.
"""


import jax

from layup_jax.runtime.exchange import Hooks
from layup_jax.runtime.warmup import compile_pair_average


class GoSGD(Hooks):
  """Local steps stage by stage; after the last, the whole model pushed to one peer, stage by
  stage, with push-sum weights."""

  sends_stages = True

  def end(self, i: int, context):
    j = self.peers.pick(i)
    if j is None:
      return
    per_model = self.links.options.push_sum == "per_model"
    model_weight = self.store.halve_model_weight(i) if per_model else None
    outbox = self.links.outboxes[i]
    for s in range(self.store.num_stages):
      if model_weight is None:
        outbox.send_halved(j, s)
      else:
        outbox.send_weighted(j, s, model_weight[s])
    yield from outbox.flush()
    if model_weight:
      self.store.add_model_weight(j, model_weight)


class ADPSGD(Hooks):
  """Per stage, as its gradient arrives: averaged with the peer's (both keep the average), then
  the gradient applied to the average (Algorithm 1's last two steps): the update waits for the
  average, so it is not fused into the backward."""

  fuses_local_step = False

  def begin(self, i: int) -> int | None:
    return self.peers.pick(i)

  def on_stage(self, i: int, peer: int | None, s: int, grads, step: jax.Array):
    if peer is not None:
      yield from self.links.transport.average(i, peer, s)  # a task: waits for both models
    self.store.local_step(i, s, grads, step)

  def compile(self) -> None:
    jax.block_until_ready(compile_pair_average(self.store))

