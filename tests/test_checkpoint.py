"""Checkpoint and resume: a stopped run continues where it stopped, and faults are named.

DDP is deterministic, so a stopped and resumed run must reproduce the uninterrupted one; LayUp's
thread interleaving is not, so a resumed runtime must hold exactly what was saved.
"""

import json
import pathlib
import threading
import types

import chex
import jax
import numpy as np
import pytest

from layup_jax import defaults
from layup_jax.algorithms import periodic
from layup_jax.algorithms.outer import CO2Outer
from layup_jax.algorithms.periodic import make_exchange
from layup_jax.checkpoint import checks, layout
from layup_jax.checkpoint.layout import DeviceRows
from layup_jax.checkpoint.manager import Checkpoints
from layup_jax.data.pipeline import Batch
from layup_jax.errors import ConfigError, NonFiniteError, StorageError
from layup_jax.pushsum import consensus, remap
from layup_jax.run import runner
from layup_jax.run.records import read_metrics
from tests.helpers import make_layup_runtime, mlp_model, plain_mlp


class StopAfter:
  """`should_stop` that turns true at its n-th call (DDP calls it once per step)."""

  def __init__(self, calls: int):
    self.calls, self.remaining = calls, calls

  def __call__(self) -> bool:
    self.remaining -= 1
    return self.remaining < 0


def _records(workdir, split):
  return [r for r in read_metrics(workdir) if r["split"] == split]


def test_ddp_stopped_and_resumed_reproduces_the_uninterrupted_run(tiny_config, tmp_path):
  tiny_config.algorithm, tiny_config.num_devices = "ddp", 4
  tiny_config.checkpoint.every = 3  # saves while DDP's next steps donate the saved buffers
  whole = runner.run(tiny_config, tmp_path / "whole")
  stopped = runner.run(tiny_config, tmp_path / "resumed", should_stop=StopAfter(9))
  assert stopped["stopped"] and 0 < stopped["step"] < tiny_config.num_steps
  assert stopped["checkpoint"].endswith(f"checkpoints/{stopped['step']}")
  resumed = runner.run(tiny_config, tmp_path / "resumed")  # the same command again
  assert resumed["resumed_from_step"] == stopped["step"]
  for key in ("final_eval_accuracy", "final_eval_loss", "consensus_distance"):
    np.testing.assert_allclose(resumed[key], whole[key], rtol=1e-6, atol=1e-7)
  for split in ("train", "test"):
    got, want = _records(tmp_path / "resumed", split), _records(tmp_path / "whole", split)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6)

  tiny_config.model.widths = (4, 8, 16)  # another model cannot resume from these checkpoints
  with pytest.raises(ConfigError, match=r"model\.widths"):
    runner.run(tiny_config, tmp_path / "resumed")


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _save_and_restore(runtime, fresh, directory, step=1):
  checkpoints = Checkpoints(directory, keep=2)
  arrays, meta = runtime.checkpoint.state_dict()
  checkpoints.save(step, arrays, {"runtime": meta})
  checkpoints.wait()
  restored = checkpoints.restore(lambda m: fresh.checkpoint.restore_template(m["runtime"]))
  checkpoints.close()
  fresh.checkpoint.load_state_dict(restored[1], restored[2]["runtime"])
  return restored


def test_layup_resumes_with_the_replicas_opt_states_and_weights_it_saved(tmp_path):
  runtime = make_layup_runtime(4, bn_policy="mix")
  runtime.compile()
  runtime.run_until(4 * 12, lambda done: None)  # threaded: weights are no longer uniform
  saved_arrays, saved_meta = runtime.checkpoint.state_dict()
  saved = _host(saved_arrays)
  runtime.close()

  fresh = make_layup_runtime(4, seed=1)  # other initial params, keys and peers
  _save_and_restore(runtime, fresh, tmp_path / "checkpoints")
  arrays, meta = fresh.checkpoint.state_dict()
  _assert_trees_equal(_host(arrays), saved)
  assert meta["weights"] == saved_meta["weights"] and meta["iterations"] == saved_meta["iterations"]
  assert fresh.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  for replica in fresh.replicas:  # every replica back on its own device
    assert {d for leaf in jax.tree.leaves(replica.params) for d in leaf.devices()} == {
        replica.device}
  fresh.compile()
  fresh.run_until(fresh.iterations_done() + 8, lambda done: None)
  assert fresh.iterations_done() == 4 * 12 + 8
  assert fresh.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  fresh.close()


def _consensus(replica_params, weights):
  return consensus.consensus([jax.tree.map(np.asarray, p) for p in replica_params],
                           np.asarray(weights))


def test_each_devices_unit_is_a_row_of_one_array_per_dtype_read_back_per_device_or_whole(
    tmp_path):
  """Every device's replica becomes a row of one array per dtype, sharded over the run's
  devices: across processes each process writes and reads the rows of its own devices (here
  devices 2 and 3 of 4, as the second of two processes), and one process reads every row."""
  devices = jax.devices()[:4]
  units = [{"w": jax.device_put(np.full((2, 3), k, np.float32), d),
            "step": jax.device_put(np.int32(k), d)} for k, d in enumerate(devices)]
  packed = layout.pack({"replicas": DeviceRows(units, 0, 4, devices)})["replicas"]
  assert {dtype: a.shape for dtype, a in packed.items()} == {"float32": (4, 6), "int32": (4, 1)}
  assert [s.device for s in packed["float32"].addressable_shards] == devices
  checkpoints = Checkpoints(tmp_path / "checkpoints", keep=1)
  checkpoints.save(1, {"replicas": DeviceRows(units, 0, 4, devices)}, {})
  checkpoints.wait()
  second = DeviceRows(units[2:], first=2, total=4, devices=devices)
  got = checkpoints.restore(lambda meta: {"replicas": second})[1]["replicas"]
  assert [int(u["step"]) for u in got] == [2, 3]
  assert got[1]["w"].devices() == {devices[3]} and (np.asarray(got[1]["w"]) == 3).all()
  every = DeviceRows(units)  # no devices: every row, to the host and onto the units' devices
  got = checkpoints.restore(lambda meta: {"replicas": every})[1]["replicas"]
  assert [int(u["step"]) for u in got] == [0, 1, 2, 3]
  assert [u["w"].devices() for u in got] == [{d} for d in devices]
  checkpoints.close()


def test_the_only_writer_left_of_several_processes_writes_its_rows_as_host_arrays(
    tmp_path, monkeypatch):
  """An elastic run down to one writing process (the others lost, or rejoined, which write
  none): its rows, every row of the checkpoint, would be an array one process addresses whole,
  which Orbax refuses across processes ("Cannot serialize host local jax.Array": the run's
  final save failed). They go as host arrays, and read back as every row."""
  devices = jax.devices()[:2]
  units = [{"w": jax.device_put(np.full((2, 3), k, np.float32), d)}
           for k, d in enumerate(devices)]
  monkeypatch.setattr(layout, "_several_processes", lambda: True)
  packed = layout.pack({"replicas": DeviceRows(units, 0, 2, devices)})["replicas"]
  assert type(packed["float32"]) is np.ndarray and packed["float32"].shape == (2, 6)
  checkpoints = Checkpoints(tmp_path / "checkpoints", keep=1)
  checkpoints.save(1, {"replicas": DeviceRows(units, 0, 2, devices)}, {})
  checkpoints.wait()
  got = checkpoints.restore(lambda meta: {"replicas": DeviceRows(units)})[1]["replicas"]
  assert [float(u["w"][0, 0]) for u in got] == [0.0, 1.0]
  assert [u["w"].devices() for u in got] == [{d} for d in devices]
  checkpoints.close()


def test_a_checkpoint_of_an_earlier_format_is_refused_in_one_line_and_kept(tmp_path):
  runtime = make_layup_runtime(2)
  checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2)
  arrays, meta = runtime.checkpoint.state_dict()
  checkpoints.save(1, arrays, {"runtime": {**meta, "format": 2}})
  checkpoints.wait()
  with pytest.raises(ConfigError, match="earlier layup_jax .checkpoint format 2, this version"):
    checkpoints.restore(lambda m: runtime.checkpoint.restore_template(m["runtime"]))
  assert checkpoints.steps() == [1]  # not moved aside as unreadable
  checkpoints.close()
  runtime.close()


@pytest.mark.parametrize("new_devices", [3, 8])  # fewer and more devices
def test_a_changed_device_count_keeps_the_consensus_model(tmp_path, new_devices):
  runtime = make_layup_runtime(4)
  for k in range(3):  # scripted gossip: weights (1/8, 3/16, ...) differ
    for i in range(4):
      runtime.iterate_serial(i, (i + 1 + k) % 4)
  arrays, meta = runtime.checkpoint.state_dict()
  want = _consensus([r["params"] for r in _host(arrays)["replicas"]], meta["weights"])

  fresh = make_layup_runtime(new_devices)
  _save_and_restore(runtime, fresh, tmp_path / "checkpoints")
  got = _consensus([r.params for r in fresh.replicas], fresh.store.weights.values)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert fresh.stats.weight_sums() == pytest.approx([1.0] * 3, abs=1e-12)
  assert [r.iteration for r in fresh.replicas] == [3] * new_devices  # each device's step counter
  fresh.iterate_serial(0)  # and it trains on


def test_remap_preserves_each_stages_mass_and_weight_sum():
  # Two stages whose push-sum weights differ (per-stage push-sum).
  replicas = [{"params": [np.full(3, float(i), np.float32), np.full(2, -2.0 * i, np.float32)],
               "opt_state": [np.int32(i), np.int32(2 * i)]} for i in range(5)]
  weights = [[0.1, 0.3], [0.3, 0.1], [0.2, 0.2], [0.25, 0.05], [0.15, 0.35]]

  def masses(replicas, weights):
    return [sum(w[s] * r["params"][s] for w, r in zip(weights, replicas)) for s in range(2)]

  for m in (1, 2, 5, 7, 10):
    new, new_weights, source = remap.remap_replicas(replicas, weights, m)
    assert len(new) == len(new_weights) == len(source) == m
    assert [sum(w[s] for w in new_weights) for s in range(2)] == pytest.approx([1.0, 1.0])
    for got, want in zip(masses(new, new_weights), masses(replicas, weights)):
      np.testing.assert_allclose(got, want, rtol=1e-6)


def _co2(correct: bool = True):
  return make_layup_runtime(4, model=plain_mlp(), exchange=make_exchange(
      tau=2, out_freq=4, lag=1, outer=CO2Outer(0.5, 0.5, 1.0), correct_stale=correct))


@pytest.mark.parametrize("correct", [True, False], ids=["correct", "restart"])
def test_co2_resumed_mid_period_continues_exactly(correct, tmp_path):
  # After boundary 1's average (each device's correction is no longer zero), devices 0 and 1
  # past boundary 2 and one step into period 3, devices 2 and 3 one step into period 2:
  # boundary 2's average is pending, with contributions of two devices saved, and devices 2
  # and 3 have not taken boundary 1's result yet.
  schedule_before = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1, 0, 1, 2, 3]
  schedule_after = [2, 3, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
  original = _co2(correct)
  for i in schedule_before:
    original.iterate_serial(i)
  if correct:
    _, meta = original.exchange.state.state_dict()
    # Periods 0 and 1's corrections: devices 2 and 3 still take period 1's at boundary 2.
    assert meta["correction_slots"] == [[p, k] for p in (0, 1) for k in range(4)]
  fresh = _co2(correct)  # the same data order (the runner restores it), but trained elsewhere
  for i in range(4):
    fresh.iterate_serial(i)
  _save_and_restore(original, fresh, tmp_path / "checkpoints")
  for mine, theirs in zip(fresh.train_batches, original.train_batches):
    mine.set_state(theirs.get_state())
  for i in schedule_after:
    original.iterate_serial(i)
    fresh.iterate_serial(i)
  _assert_trees_equal(_host(fresh.checkpoint.state_dict()[0]), _host(original.checkpoint.state_dict()[0]))


@pytest.mark.parametrize("algorithm", ["slowmo", "co2"])
def test_a_periodic_run_resumed_after_several_periods_records_the_uninterrupted_losses(
    algorithm, tiny_config, tmp_path):
  """Resumed from step 10 (period 5 of 2 steps; 3 and 1 a step into period 3 under CO2's lag),
  the run records what the uninterrupted one recorded after it. A resumed runtime holds only
  its latest periods' results: compiling must not need period 0's (it did, a KeyError)."""
  tiny_config.algorithm, tiny_config.num_devices, tiny_config.num_steps = algorithm, 4, 16
  tiny_config.eval_every, tiny_config.checkpoint.every = 8, 10
  tiny_config.baselines.tau, tiny_config.baselines.out_freq = 2, 4
  runner.run(tiny_config, tmp_path / "whole")
  tiny_config.restore = str(tmp_path / "whole" / "checkpoints" / "10")
  summary = runner.run(tiny_config, tmp_path / "resumed")
  assert summary["resumed_from_step"] == 10
  after = [(r["step"], r["split"], r["loss"]) for r in read_metrics(tmp_path / "whole")
           if r["step"] > 10]
  again = [(r["step"], r["split"], r["loss"]) for r in read_metrics(tmp_path / "resumed")]
  assert [r[:2] for r in again] == [r[:2] for r in after] == [(16, "train"), (16, "test")]
  for (_, _, a), (_, _, b) in zip(again, after, strict=True):
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_a_periodic_checkpoint_across_processes_splits_into_each_process_part_and_back():
  """Across processes each process holds its devices' contributions to a pending average; one
  checkpoint holds the whole run's, and each process takes back exactly its own."""
  runtime = _co2()
  for i in [0, 1, 0, 1, 0, 1, 2, 3]:  # devices 0 and 1 contributed to boundary 1, 2 and 3 not
    runtime.iterate_serial(i)
  arrays, meta = runtime.exchange.state.state_dict()
  assert [k for _, k in meta["contribution_slots"]] == [0, 1]
  parts = [(*periodic.process_state(arrays, meta, first, 2), first) for first in (0, 2)]
  assert [len(a["contributions"]) for a, _, _ in parts] == [2, 0]
  # Each device's correction (CO2's, period 0's here) goes to its own process.
  assert [m["correction_slots"] for _, m, _ in parts] == [[[0, 0], [0, 1]]] * 2
  assert parts[0][1]["finished"] == meta["finished"][:2]
  assert parts[1][1]["finished"] == meta["finished"][2:] and parts[1][1]["applied"] == meta[
      "applied"][2:]
  joined_arrays, joined_meta = periodic.join_process_states(parts)
  assert joined_meta == meta
  _assert_trees_equal(_host(joined_arrays), _host(arrays))
  behind = (parts[1][0], {**parts[1][1], "periods_done": meta["periods_done"] - 1}, 2)
  with pytest.raises(RuntimeError, match="different periods"):
    periodic.join_process_states([parts[0], behind])


def test_partial_and_truncated_checkpoints_fall_back_to_the_previous_one(tmp_path, caplog):
  runtime = make_layup_runtime(2)
  directory = tmp_path / "checkpoints"
  checkpoints = Checkpoints(directory, keep=3)
  for step in (1, 2):
    runtime.iterate_serial(0)
    arrays, meta = runtime.checkpoint.state_dict()
    checkpoints.save(step, arrays, {"runtime": meta})
  checkpoints.wait()
  step_1 = _host(Checkpoints(directory, keep=3).restore(
      lambda m: runtime.checkpoint.restore_template(m["runtime"]), step=1)[1])
  partial = directory / "3.orbax-checkpoint-tmp-1700000000"  # a save killed before its rename
  (partial / "arrays").mkdir(parents=True)
  (partial / "arrays" / "half_written").write_bytes(b"\0" * 10)
  for path in (directory / "2" / "arrays").rglob("*"):
    if path.is_file() and path.stat().st_size > 0:
      path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a half-written disk
  checkpoints.close()
  checkpoints = Checkpoints(directory, keep=3)  # as the next run opens them
  with caplog.at_level("WARNING"):
    step, arrays, _ = checkpoints.restore(lambda m: runtime.checkpoint.restore_template(m["runtime"]))
  assert step == 1 and "checkpoints/2 is damaged" in caplog.text
  _assert_trees_equal(_host(arrays), step_1)
  assert checkpoints.steps() == [1]  # step 2 moved aside, so it can be saved again
  assert any((tmp_path / "checkpoints_unreadable").iterdir())
  checkpoints.close()


def test_a_transient_read_error_on_restore_does_not_start_the_run_again_from_step_0(
    tiny_config, tmp_path, monkeypatch, caplog):
  """A run with checkpoints 10 and 20, rerun while its storage fails every read (an I/O error):
  the read is tried again, then the run stops in one line naming the error; nothing is moved
  aside and nothing recorded (no start from step 0). Rerun while the storage fails twice: the
  third try reads checkpoint 20 and the run resumes from it."""
  import errno

  import orbax.checkpoint as ocp

  from layup_jax.checkpoint import manager

  tiny_config.algorithm, tiny_config.num_devices, tiny_config.checkpoint.every = "ddp", 2, 10
  runner.run(tiny_config, tmp_path)
  records = (tmp_path / "metrics.jsonl").read_bytes()
  monkeypatch.setattr(manager, "_RETRY_WAITS_S", (0.0, 0.0))
  restore, failures = ocp.CheckpointManager.restore, []

  def failing(self, step, *args, **kwargs):
    if len(failures) < failing.times:
      failures.append(step)
      raise OSError(errno.EIO, "Input/output error")
    return restore(self, step, *args, **kwargs)

  failing.times = 100
  monkeypatch.setattr(ocp.CheckpointManager, "restore", failing)
  with pytest.raises(StorageError, match=r"^checkpoint .*/checkpoints/20 could not be read "
                     r"\(process 0: OSError: \[Errno 5\] Input/output error\) after 3 tries; "
                     r"nothing was moved or restarted"):
    runner.run(tiny_config, tmp_path)
  assert failures == [20, 20, 20]  # tried 3 times; never step 10, never step 0
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "20"]
  assert not (tmp_path / "checkpoints_unreadable").exists()
  assert (tmp_path / "metrics.jsonl").read_bytes() == records

  failures.clear()
  caplog.clear()
  failing.times = 2
  with caplog.at_level("WARNING"):
    summary = runner.run(tiny_config, tmp_path)
  assert failures == [20, 20] and summary["resumed_from_step"] == 20
  assert caplog.text.count("trying again in 0 s") == 2


@pytest.mark.parametrize(("error", "damage"), [
    (ValueError("DATA_LOSS: Error reading local file: Unexpected end of data"), True),
    (KeyError('Item "arrays" was not found in the checkpoint'), True),
    (json.JSONDecodeError("Expecting value", "{", 1), True),
    (FileNotFoundError(2, "No such file or directory"), True),
    (OSError(5, "Input/output error"), False),
    (MemoryError(), False),
    (ValueError("UNAVAILABLE: the storage did not answer"), False),
    (RuntimeError("something unknown"), False),
])
def test_only_damage_to_the_data_counts_as_a_damaged_checkpoint(error, damage):
  from layup_jax.checkpoint.manager import is_damage

  assert is_damage(error) is damage


def test_a_damage_error_raised_while_handling_an_io_error_is_not_damage():
  from layup_jax.checkpoint.manager import is_damage

  try:
    try:
      raise OSError(5, "Input/output error")
    except OSError as io:
      raise ValueError("could not parse what was read") from io
  except ValueError as error:
    assert not is_damage(error)


def test_a_save_waiting_for_a_lost_process_is_given_up_and_the_live_processes_save_on(
    tmp_path, monkeypatch):
  """An elastic run's save under way when a process is lost waits in Orbax's barrier for that
  process's part, which never comes; at the next save the live processes give it up after
  their patience and save on with a manager of their own; the saves written before are kept
  and not counted as given up. (Here Orbax's save of step 180 blocks, as its barrier does,
  until the test ends.)"""
  import orbax.checkpoint as ocp

  release = threading.Event()
  original_save = ocp.CheckpointManager.save

  def save(manager, step, *args, **kwargs):
    if step == 180:  # under way when the process is lost: waits for its part
      release.wait()
      raise RuntimeError("barrier timed out")
    return original_save(manager, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  runtime = make_layup_runtime(2)
  checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
  try:
    arrays, meta = runtime.checkpoint.state_dict()
    checkpoints.save(160, arrays, {"runtime": meta})
    checkpoints.wait()
    checkpoints.save(180, arrays, {"runtime": meta})
    # Given up after its patience, not waited for: the save of 180 blocks until the test ends.
    assert checkpoints.limit_to([0], 200, patience_s=0.5) == [180]
    runtime.iterate_serial(0)
    arrays, meta = runtime.checkpoint.state_dict()
    checkpoints.save(200, arrays, {"runtime": meta})
    checkpoints.wait()
    assert checkpoints.steps() == [160, 200]
    assert checkpoints.limit_to([0], 220, patience_s=0.5) == []  # the same set: nothing to do
  finally:
    release.set()
  checkpoints.close()


class _NaNAfter:
  """A device's batches, with NaN inputs from the `after`-th on."""

  def __init__(self, iterator, after: int):
    self.iterator, self.after, self.count = iterator, after, 0

  def __next__(self):
    batch = next(self.iterator)
    self.count += 1
    if self.count > self.after:
      batch = Batch(np.full_like(batch.inputs, np.nan), batch.targets)
    return batch


def test_an_injected_nan_stops_the_run_naming_device_stage_and_step():
  runtime = make_layup_runtime(4, model=mlp_model())
  runtime.train_batches[2] = _NaNAfter(runtime.train_batches[2], after=5)
  runtime.compile()
  with pytest.raises(NonFiniteError, match=r"on device 2 at its step \d+.*stage 2|stage 2 on "
                                           r"device 2 at its step \d+"):
    runtime.run_until(4 * 40, lambda done: None)


def test_a_stopping_run_never_writes_a_non_finite_step_into_a_replica():
  # Under `stop` too: a replica holding the NaN would send it to peers, whose losses would then
  # turn NaN and might be read (and named in the error) before the device it appeared on.
  runtime = make_layup_runtime(4, model=mlp_model())
  runtime.train_batches[2] = _NaNAfter(runtime.train_batches[2], after=0)
  runtime.compile()
  before = runtime.store.stage_params(2)
  with pytest.raises(NonFiniteError, match="on device 2"):
    runtime.iterate_serial(2, peer=1)
  after = runtime.store.stage_params(2)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(after))
  chex.assert_trees_all_equal(before, after)  # the step was not applied
  runtime.close()


def test_skipping_non_finite_steps_keeps_every_replica_finite():
  runtime = make_layup_runtime(4, model=mlp_model(), nonfinite="skip")
  runtime.train_batches[2] = _NaNAfter(runtime.train_batches[2], after=5)
  runtime.compile()
  runtime.run_until(4 * 20, lambda done: None)
  # Device 2's steps from its 6th on, however many it took of the 80 (the devices share them).
  taken = runtime.stats.iterations_per_device()[2]
  assert taken > 5 and runtime.stats.skipped == [0, 0, taken - 5, 0]
  assert runtime.stats.skipped_steps() == taken - 5
  arrays, _ = runtime.checkpoint.state_dict()
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(_host(arrays["replicas"])))
  runtime.close()


def test_an_unwritable_workdir_or_a_full_disk_fails_before_training(tiny_config, tmp_path,
                                                                    monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(StorageError, match="workdir"):
    runner.run(tiny_config, blocker / "run")
  monkeypatch.setattr(checks.shutil, "disk_usage",
                      lambda path: types.SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
  with pytest.raises(StorageError, match=r"MiB are free"):
    runner.run(tiny_config, tmp_path / "run")
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_processes_sharing_a_workdir_probe_it_without_removing_each_others_probe(
    tmp_path, monkeypatch):
  """Every process checks the shared workdir before training. With one probe name for all,
  a process that probed between another's write and removal removed that probe, the other's
  removal failed, and a resumed 2-process run stopped with 'the workdir is not writable (No
  such file or directory)'. Here process 0 probes inside process 1's write."""
  real_write, interleaved = pathlib.Path.write_bytes, []

  def write_then_process_0_probes(path, data):
    real_write(path, data)
    if not interleaved:
      interleaved.append(path)
      with monkeypatch.context() as patch:
        patch.setattr(checks.jax, "process_index", lambda: 0)
        checks.check_storage(tmp_path, 1, keep=1)

  monkeypatch.setattr(pathlib.Path, "write_bytes", write_then_process_0_probes)
  monkeypatch.setattr(checks.jax, "process_index", lambda: 1)
  checks.check_storage(tmp_path, 1, keep=1)
  assert interleaved and not any((tmp_path / "checkpoints").iterdir())  # both probes removed


def test_restore_starts_a_new_workdir_from_a_given_checkpoint(tiny_config, tmp_path):
  tiny_config.num_devices, tiny_config.num_steps, tiny_config.eval_every = 2, 6, 0
  runner.run(tiny_config, tmp_path / "first")
  tiny_config.num_steps, tiny_config.restore = 8, str(tmp_path / "first" / "checkpoints" / "6")
  summary = runner.run(tiny_config, tmp_path / "second")
  assert summary["resumed_from_step"] == 6
  assert json.loads((tmp_path / "second" / "summary.json").read_text())["num_steps"] == 8
  tiny_config.restore = str(tmp_path / "nowhere")
  with pytest.raises(ConfigError, match="config.restore"):
    runner.run(tiny_config, tmp_path / "third")


def test_a_checkpoint_written_before_a_key_existed_resumes_at_its_default_not_at_another_value(
    tmp_path):
  """A key added later (here `model.attention`) is absent from an older checkpoint's config: that
  run behaved as the default does, so only a value other than the default stops the resume."""
  current = defaults.get_config()
  saved = json.loads(current.to_json_best_effort())
  del saved["model"]["attention"]
  checks.check_compatible(json.dumps(saved), current.to_json_best_effort(), tmp_path)  # no error
  current.model.attention = "xla"
  with pytest.raises(ConfigError, match=r"model\.attention=.*'xla'"):
    checks.check_compatible(json.dumps(saved), current.to_json_best_effort(), tmp_path)
  current.model.attention = defaults.get_config().model.attention
  # `layup.fanout` came with one peer, the default later became two: a checkpoint without the
  # key ran one peer, which a resume at two is warned of (not structural).
  del saved["layup"]["fanout"]
  assert checks.config_differences(json.dumps(saved), current.to_json_best_effort()) == {
      "layup.fanout": (1, current.layup.fanout)}
  saved["model"]["granularity"] = "per_block"  # a key the checkpoint has: compared as saved
  with pytest.raises(ConfigError, match=r"model\.granularity='per_block'"):
    checks.check_compatible(json.dumps(saved), current.to_json_best_effort(), tmp_path)
