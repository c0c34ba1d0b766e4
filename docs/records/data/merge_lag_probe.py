"""Probe: how many iterations apart sender and receiver are when a received stage is mixed in.

Runs a config (default: the LM benchmark's LayUp) on the threaded runtime for `--steps` steps
and records, for every received stage at the moment it is mixed into its receiver, the sender's
iteration count when it took the stage minus the receiver's count then (both count dispatched
iterations, so 0 is "the same iteration"). Positive: the receiver gets a stage from a sender
ahead of it, as every device but the first does in the serial rounds of
`serial_runtime_probe.py`. Prints the histogram and writes it as JSON (`--out`).

  python docs/records/data/merge_lag_probe.py --steps 60 [--set tuning.fuse_local_step=False]
"""

import argparse
import ast
import collections
import json
import os
import tempfile
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import layup_jax  # noqa: E402
from layup_jax import defaults  # noqa: E402
from layup_jax.runtime import replicas, sends  # noqa: E402

LAGS: collections.Counter = collections.Counter()
_taken: dict[int, int] = {}  # id(part) -> the sender's iteration when it took the part
_parked: dict[int, int] = {}  # id(received) -> the same, while it waits in an inbox
_sending = threading.local()


def _patch() -> None:
  store_cls, outbox_cls = replicas.ReplicaStore, sends.Outbox
  take, merge, merge_now = store_cls.take, store_cls.merge, store_cls._merge_now
  take_inbox, send = store_cls._take_inbox, outbox_cls._send

  def taking(self, i, s, halve):
    part, amount = take(self, i, s, halve)
    _taken[id(part)] = self.replicas[i].iteration
    return part, amount

  def sending(self, peer, s, part, *rest):
    _sending.iteration = _taken.pop(id(part), self._store.replicas[self._sender].iteration)
    try:
      return send(self, peer, s, part, *rest)
    finally:
      _sending.iteration = None

  def merging(self, j, s, received, sent, add_weight):
    iteration = getattr(_sending, "iteration", None)
    if iteration is not None:
      _parked[id(received)] = iteration
    return merge(self, j, s, received, sent, add_weight)

  def merging_now(self, j, s, received, sent, add_weight=True):
    sender = _parked.pop(id(received), None)
    if sender is not None:
      LAGS[sender - self.replicas[j].iteration] += 1
    return merge_now(self, j, s, received, sent, add_weight)

  def taking_inbox(self, i, s):
    held = self._inbox[i][s]
    if held is not None:
      sender = _parked.pop(id(held[0]), None)
      if sender is not None:
        LAGS[sender - self.replicas[i].iteration] += 1
    return take_inbox(self, i, s)

  store_cls.take, store_cls.merge, store_cls._merge_now = taking, merging, merging_now
  store_cls._take_inbox, outbox_cls._send = taking_inbox, sending


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="configs/stdlib_gpt2_mini.py")
  parser.add_argument("--algorithm", default="layup")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--out")
  args = parser.parse_args()
  config = layup_jax.load_config(args.config, args.algorithm)
  config.num_steps, config.eval_every, config.progress_bar = args.steps, 0, False
  defaults.set_values(config, {key: ast.literal_eval(value)
                                for key, value in (item.split("=", 1) for item in args.set)})
  _patch()
  with tempfile.TemporaryDirectory() as workdir:
    layup_jax.train(config, workdir)
  total = sum(LAGS.values())
  for lag in sorted(LAGS):
    print(f"{lag:+d}: {LAGS[lag]} ({LAGS[lag] / total:.1%})")
  mean = sum(lag * n for lag, n in LAGS.items()) / max(total, 1)
  print(f"mixes {total}, mean lag {mean:+.3f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"set": args.set, "steps": args.steps, "lags": dict(sorted(LAGS.items())),
                 "mean": mean}, f, indent=1)


if __name__ == "__main__":
  main()
