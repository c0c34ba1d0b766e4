"""What jax's distributed runtime does when a process of a run dies, measured on the jax here.

    python scripts/probe_elastic.py [--out docs/results/probe_elastic_<python>.json]

Starts 3 processes of 2 CPU devices on this machine (coordinator: process 0), with
`jax_enable_recoverability` on or off, and SIGKILLs process 2 while process 1 waits in a pull
of an offer process 2 announced but never made; then starts process 2 again with the same id.
Prints one row per fact (docs/elastic.md cites them):

- `survivors_alive_s`: how long processes 0 and 1 kept running after the kill (within the
  probe's window), and how they ended if they did (exit status, last line);
- `pull_from_dead`: what the waiting pull did: raised (its first line, and when) or still waited;
- `kv_after_death`: whether the survivors' key-value writes and reads went on, a key the dead
  process wrote is still there, and a blocking read of one it never wrote times out;
- `barrier_of_survivors`: whether a barrier naming only processes 0 and 1 passes;
- `restart`: whether process 2, started again with its id, initializes, reads the key-value
  store, offers an array that process 1 pulls, and pulls one from process 0.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
WINDOW_S = 25.0  # how long the survivors are watched after the kill
HEARTBEAT_S = 6


def worker(port: int, k: int, recoverable: bool, restarted: bool) -> None:
  """One process of the probe: prints `EVENT <json>` lines."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import transfer

  def event(**fields):
    print("EVENT " + json.dumps({"process": k, "t": time.time(), **fields}), flush=True)

  def mark(name):  # tells the probe's parent (it has no client of the run)
    with open(os.path.join(os.environ["PROBE_DIR"], name), "w") as f:
      f.write(str(time.time()))

  jax.config.update("jax_enable_recoverability", recoverable)
  jax.distributed.initialize(f"127.0.0.1:{port}", 3, k, heartbeat_timeout_seconds=HEARTBEAT_S)
  client = jax._src.distributed.global_state.client
  server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0",
                                          ["127.0.0.1:0"] * 2)
  tag = "restarted" if restarted else "first"
  client.key_value_set(f"probe/{tag}/address/{k}", server.address(), allow_overwrite=True)
  event(what="ready", tag=tag)
  if restarted:
    try:
      event(what="kv_read", value=client.blocking_key_value_get("probe/written_by_0", 5000))
      client.key_value_set("probe/restarted_offer", "ready", allow_overwrite=True)
      server.await_pull(7002, [jnp.arange(4.0, device=jax.local_devices()[0])])
      address = client.blocking_key_value_get("probe/first/address/0", 5000)
      client.key_value_set("probe/pull_0_ready", "1", allow_overwrite=True)
      client.blocking_key_value_get("probe/offer_0_made", 20000)
      spec = jax.ShapeDtypeStruct((3,), jnp.float32,
                                  sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[1]))
      (pulled,) = jax.block_until_ready(server.connect(address).pull(7100, [spec]))
      event(what="restart_pulled", value=np.asarray(pulled).tolist())
      time.sleep(3)
    except Exception as error:  # noqa: BLE001 - the probe reports whatever happens
      event(what="restart_failed", error=f"{type(error).__name__}: {str(error)[:200]}")
    os._exit(0)
  if k == 2:
    client.key_value_set("probe/written_by_2", "still here")
    client.key_value_set("probe/offer_announced", "7001")  # announced, never offered
    mark("ready_2")
    time.sleep(3600)  # killed
  if k == 1:
    import threading

    def pull_unoffered():
      address = client.blocking_key_value_get("probe/first/address/2", 20000)
      spec = jax.ShapeDtypeStruct((4,), jnp.float32,
                                  sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
      connection = server.connect(address)
      client.blocking_key_value_get("probe/offer_announced", 20000)
      event(what="pull_started")
      mark("pulling")
      try:
        jax.block_until_ready(connection.pull(7001, [spec]))
        event(what="pull_returned")
      except Exception as error:  # noqa: BLE001
        event(what="pull_raised", error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")

    threading.Thread(target=pull_unoffered, daemon=True).start()
  if k == 0:
    client.key_value_set("probe/written_by_0", "from 0")
  mark(f"ready_{k}")
  step = jax.jit(lambda x: x * 2 + 1)
  x = jnp.ones(4)
  start, reported = time.time(), set()
  while time.time() - start < 120:
    try:
      x = step(x).block_until_ready() / 3
      client.key_value_set(f"probe/alive/{k}", str(time.time()), allow_overwrite=True)
      killed = _killed_at()
      if killed and "kv" not in reported:
        reported.add("kv")
        left = _try(client, "probe/written_by_2")
        t0 = time.time()
        try:
          client.blocking_key_value_get("probe/never_written_by_2", 1000)
          timed_out = False
        except Exception as error:  # noqa: BLE001
          timed_out = "DEADLINE_EXCEEDED" in str(error)
        event(what="kv_after_death", key_of_dead=left, blocking_read_timed_out=timed_out,
              waited_s=round(time.time() - t0, 2))
      if killed and k in (0, 1) and "barrier" not in reported and \
          time.time() - float(killed) > 2 * HEARTBEAT_S:
        reported.add("barrier")
        try:
          client.wait_at_barrier("probe_survivors", 10000, process_ids=[0, 1])
          event(what="barrier_of_survivors", passed=True)
        except Exception as error:  # noqa: BLE001
          event(what="barrier_of_survivors", passed=False,
                error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
      if k == 1 and _try(client, "probe/restarted_offer") and "restart_pull" not in reported:
        reported.add("restart_pull")
        address = client.blocking_key_value_get("probe/restarted/address/2", 5000)
        spec = jax.ShapeDtypeStruct((4,), jnp.float32,
                                    sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        (pulled,) = jax.block_until_ready(server.connect(address).pull(7002, [spec]))
        event(what="pulled_from_restarted", value=np.asarray(pulled).tolist())
      if k == 0 and _try(client, "probe/pull_0_ready") and "offer" not in reported:
        reported.add("offer")
        server.await_pull(7100, [jnp.full((3,), 5.0, device=jax.local_devices()[1])])
        client.key_value_set("probe/offer_0_made", "1")
      time.sleep(0.2)
    except Exception as error:  # noqa: BLE001
      event(what="survivor_raised", error=f"{type(error).__name__}: {str(error)[:200]}")
      break
  event(what="done")
  os._exit(0)


def _fatal_after(output: str, killed_at: float) -> float | None:
  """Seconds from the kill to the first fatal log line of `output` (glog's `Fmmdd hh:mm:ss.us`,
  local time), or None."""
  for line in output.splitlines():
    if line.startswith("F") and len(line) > 21 and line[5] == " ":
      hours, minutes, seconds = line[6:21].split(":")
      day = time.localtime(killed_at)
      midnight = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, 0, 0, 0, 0, 0, -1))
      return round(midnight + int(hours) * 3600 + int(minutes) * 60 + float(seconds)
                   - killed_at, 2)
  return None


def _killed_at() -> str | None:
  """When the probe's parent killed process 2 (it writes the file then), or None."""
  try:
    with open(os.path.join(os.environ["PROBE_DIR"], "killed_at")) as f:
      return f.read().strip() or None
  except FileNotFoundError:
    return None


def _try(client, key):
  try:
    return client.key_value_try_get(key)
  except Exception:  # noqa: BLE001 - NOT_FOUND
    return None


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def drill(recoverable: bool) -> dict:
  """Starts the three processes, kills 2, restarts it (recoverable only); returns the facts."""
  port = free_port()
  directory = tempfile.mkdtemp()
  def start(k, restarted=False):
    return subprocess.Popen([sys.executable, HERE, "--worker", str(port), str(k),
                             str(int(recoverable)), str(int(restarted))],
                            env={**os.environ, "PROBE_DIR": directory},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  processes = [start(k) for k in range(3)]
  waited = time.time()
  while not all(os.path.exists(os.path.join(directory, name))
                for name in ("ready_0", "ready_1", "ready_2", "pulling")):
    if time.time() - waited > 180:
      sys.exit("the probe's processes did not get ready within 180 s")
    time.sleep(0.2)
  time.sleep(1)  # the pull waiting
  killed_at = time.time()
  processes[2].send_signal(signal.SIGKILL)
  processes[2].wait()
  with open(os.path.join(directory, "killed_at"), "w") as f:  # tells the survivors
    f.write(str(killed_at))
  restarted = None
  if recoverable:
    time.sleep(2 * HEARTBEAT_S + 2)
    restarted = start(2, restarted=True)
  deadline = killed_at + WINDOW_S + (20 if recoverable else 0)
  watched = [(k, p) for k, p in [(0, processes[0]), (1, processes[1]), ("2r", restarted)]
             if p is not None]
  while time.time() < deadline and any(p.poll() is None for _, p in watched):
    time.sleep(0.2)
  # Each one's state at the window's end, before any is stopped (stopping the coordinator
  # would end the others).
  statuses = {k: ("still running at the window's end" if p.poll() is None else p.returncode)
              for k, p in watched}
  outputs = {}
  for k, p in reversed(watched):  # the coordinator last: its end would end the others
    p.kill()
    outputs[k] = p.communicate()[0]
  events = [json.loads(line[6:]) for out in outputs.values() for line in out.splitlines()
            if line.startswith("EVENT ")]
  def last_line(out):  # the first line of a fatal error, else the last one
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("EVENT")]
    fatal = [line for line in lines if line.startswith("F") and "]" in line[:60]]
    return (fatal or lines or [""])[-1 if not fatal else 0][:300]
  return {
      "recoverable": recoverable,
      "survivors": {str(k): {"exit": statuses[k], "last_line": last_line(outputs[k]),
                             "fatal_s_after_kill": _fatal_after(outputs[k], killed_at),
                             "log_tail": [line[:300] for line in outputs[k].splitlines()
                                          if not line.startswith("EVENT ")][-25:]}
                    for k in (0, 1)},
      "events": [{**e, "t": round(e["t"] - killed_at, 2)} for e in events],
      "restart_exit": statuses.get("2r"),
      "restart_last_line": last_line(outputs["2r"]) if "2r" in outputs else None,
  }


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    port, k, recoverable, restarted = (int(a) for a in sys.argv[2:6])
    worker(port, k, bool(recoverable), bool(restarted))
    return
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  import jax

  results = {"jax": jax.__version__, "python": sys.version.split()[0],
             "drills": [drill(False), drill(True)]}
  print(json.dumps(results, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
