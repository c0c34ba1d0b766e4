"""Probe: the LM benchmark's LayUp on the runtime, its devices' iterations run one at a time.

Each `run_until` runs whole iterations round-robin, device after device, on the calling thread
(`AsyncRuntime.iterate_serial`): the same programs, sends, push-sum weights and merges as the
threaded mode, but no iteration overlaps another and every send is merged before the next
iteration starts. Against the threaded run it separates what LayUp's asynchrony costs from what
its mixing (one or two peers, push-sum weights) costs (docs/records/language_model.md).

With `--rounds parallel` every stage sent during a round is held and merged once the round's
last iteration is done: each device's iteration starts from what the previous round left, as
devices running side by side in lockstep would (no device sees another's same-round update).
With `--rounds serial` (the default) a device's iteration sees the sends of every device that
ran before it in the round.

  python docs/records/data/serial_runtime_probe.py WORKDIR [--rounds parallel] [--set KEY=VALUE ...]
"""

import argparse
import ast
import os
import random

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import layup_jax  # noqa: E402
from layup_jax import defaults  # noqa: E402
from layup_jax.runtime import engine  # noqa: E402

ROUNDS = {"value": "serial"}


def serial_run_until(self, iterations, on_progress, should_stop=lambda: False):
  order = random.Random(self.iterations_done()).sample(range(self.num_devices), self.num_devices)
  store = self.store
  while self.iterations_done() < iterations:
    held = []
    if ROUNDS["value"] == "parallel":  # sends land once the round is over
      store.merge = lambda *args: (held.append(args), jax.tree.leaves(args[2])[0])[1]
    for i in order:
      self.iterate_serial(i)
    if held:
      del store.merge  # the class's merge again
      for args in held:
        store.merge(*args)
      store.merge_waiting()
    on_progress(self.iterations_done())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("workdir")
  parser.add_argument("--config", default="configs/stdlib_gpt2_mini.py")
  parser.add_argument("--algorithm", default="layup")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--rounds", choices=("serial", "parallel"), default="serial")
  args = parser.parse_args()
  ROUNDS["value"] = args.rounds
  config = layup_jax.load_config(args.config, args.algorithm)
  defaults.set_values(config, {key: ast.literal_eval(value)
                                for key, value in (item.split("=", 1) for item in args.set)})
  config.progress_bar = False
  engine.AsyncRuntime.run_until = serial_run_until
  summary = layup_jax.train(config, args.workdir)
  print(f"final test loss {summary['final_eval_loss']:.4f}")


if __name__ == "__main__":
  main()
