"""Several processes (hosts, or GPUs of one host) as one run, on JAX's distributed runtime.

Owns: joining a run (`setup`), which processes are lost or rejoin (`membership`), gathers of
host values through the coordination service (`gathers`), the heartbeat watchdog (`watchdog`),
the transfer wire between processes (`wire`), gossip with other processes' devices
(`remote_peers`), what an elastic run does when a process is lost or rejoins (`elastic`) and
the bytes that cross between hosts (`traffic`). Imports `platform` and `errors`; the runtime
imports it, never the other way round (it is given the runtime's store as callbacks).
"""
