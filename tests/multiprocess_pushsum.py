"""One process of the cross-process push-sum check (tests/test_multiprocess.py runs two).

    python tests/multiprocess_pushsum.py PORT NUM_PROCESSES PROCESS_ID ALGORITHM ITERATIONS \
        [OPTION=VALUE ...]

The threaded runtime on this process's devices of a 4-device run, learning rate 0, every
replica given its own parameters (drawn from its global position): only gossip moves them, and
push-sum must keep each stage's weighted average over all processes. Process 0 prints one JSON
line: the average's relative change, the weight sums, the disagreement before and after, the
iterations per device (OPTION=VALUE: `RuntimeOptions` fields, as Python literals; `stranger=True`:
process 1 first writes a notice and a `lost/1` key unsigned, as a client outside the run), the sends
that crossed processes and their bytes, each stage's bytes as sent, and with compression the
average's drift before the mass held back was returned (the run's residuals over the average).
"""

import ast
import json
import pathlib
import sys

import jax
import numpy as np

from layup_jax.multiprocess import gathers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main() -> None:
  port, processes, process_id, algorithm, iterations = sys.argv[1:6]
  options = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[6:])}
  stranger = options.pop("stranger", False)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=int(processes), process_id=int(process_id))
  if stranger and int(process_id) == 1:  # writes as a client without the run's secret would
    from layup_jax.platform import compat

    raw = compat.coordination_client()
    raw.key_value_set("layup_jax/gossip/0/1/0/1", json.dumps(
        {"uuid": 1, "peer": 0, "stage": 0, "amount": 1.0, "offered_at": 0.0,
         "average": False, "encoded": False}))
    raw.key_value_set("layup_jax/lost/1", "5")
  import optax

  from layup_jax.algorithms.gossip import ADPSGD, GoSGD
  from layup_jax.algorithms.layup import LayUp
  from layup_jax.multiprocess import traffic
  from layup_jax.platform import compile_cache
  from tests.helpers import make_layup_runtime

  compile_cache.enable("")  # the tests' folder (conftest.py), written by every process
  exchange = {"layup": LayUp, "gosgd": GoSGD, "adpsgd": ADPSGD}[algorithm]
  runtime = make_layup_runtime(4, learning_rate=0.0, exchange=exchange, **options)
  arrays, meta = runtime.checkpoint.state_dict()
  for i, replica in enumerate(arrays["replicas"]):  # i: this process's; rng: the run's position
    rng = np.random.default_rng(100 + runtime.first + i)
    replica["params"] = [jax.tree.map(lambda p, rng=rng: np.asarray(p) + 0.5 * rng.normal(
        size=p.shape).astype(np.float32), stage) for stage in replica["params"]]
  runtime.checkpoint.load_state_dict(arrays, meta)

  def average_and_spread():  # reduced across the processes from each one's weighted sums
    runtime.stats.collect()
    snapshot = runtime.stats.snapshot()
    return snapshot.center, snapshot.consensus_distance

  start, spread = average_and_spread()
  held = []  # each stage's residual mass on this process, just before it is returned
  compressor = runtime.transport.compressor
  if compressor is not None:
    settle = compressor.settle

    def recording_settle(*args):
      held[:] = [compressor.residual_mass(s) for s in range(runtime.num_stages)]
      settle(*args)

    compressor.settle = recording_settle
  runtime.compile()
  runtime.run_until(runtime.num_devices * int(iterations), lambda _: None)
  center, spread_after = average_and_spread()
  # LayUp's and GoSGD's sends are compressed; AD-PSGD's pairwise averages travel exact, and its
  # runs build no compressor (`Exchange.sends_stages`).
  compressed = compressor is not None
  drift = None
  if compressed:  # the run's residuals (every process's) against the average

    every = gathers.all_gather_data(held)
    total = jax.tree.map(lambda *parts: sum(parts), *every)
    drift = float(optax.tree.norm(total) / optax.tree.norm(center))
  sums = runtime.stats.weight_sums()
  per_device = runtime.stats.iterations_per_device()
  crossed = sum(jax.tree.leaves(distributed_sends(runtime)))
  sent = runtime.stats.bytes_between_processes()  # every process's, as of the last collect
  templates = (compressor.wire_templates if compressed else
               [runtime.store.part_template(s) for s in range(runtime.num_stages)])
  stage_bytes = [traffic.tree_bytes(jax.tree.leaves(t)) for t in templates]
  float32_bytes = [traffic.tree_bytes(jax.tree.leaves(runtime.store.part_template(s)))
                   for s in range(runtime.num_stages)]
  runtime.close()
  if jax.process_index() == 0:
    change = float(optax.tree.norm(optax.tree.sub(center, start)) / optax.tree.norm(start))
    print(json.dumps({"relative_change": change, "weight_sums": sums, "spread": spread,
                      "spread_after": spread_after, "iterations": per_device,
                      "sends_between_processes": crossed, "bytes_between_processes": sent,
                      "stage_bytes": stage_bytes, "rerouted": runtime.transport.rerouted,
                      "stage_bytes_float32": float32_bytes, "compression_drift": drift,
                      "codec": compressor.codec if compressed else None}),
          flush=True)


def distributed_sends(runtime) -> list[int]:
  """Every process's count of sends to other processes."""

  return gathers.all_gather_json(runtime.transport.remote_sends())


if __name__ == "__main__":
  main()
