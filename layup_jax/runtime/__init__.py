"""The per-device asynchronous engine that LayUp and the gossip and periodic baselines run on.

Owns: the engine (`engine.AsyncRuntime`: each device's compute task and updater task), the
cooperative tasks and the two host threads that run them (`scheduler`), a staged model's jitted
programs (`programs`) and the pass that dispatches them stage by stage (`staged_pass`), the
replicas and every write to them (`replicas`), the sends to peers (`sends`), the interface an
algorithm implements (`exchange`), what the engine reports (`stats`), straggler injection
(`straggler`), compilation before the timed loop (`warmup`), its checkpoint (`state`), and two
leaves: stage packing (`packing`) and the copy to a device (`transfer`).
Imports `models`, `pushsum`, `measure`, `multiprocess`, `checkpoint`, `platform`; never
`algorithms` or `run` (an algorithm is handed in as a factory of its `Exchange`).
docs/concepts/runtime.md walks through one iteration and the invariants the tests hold.
"""
