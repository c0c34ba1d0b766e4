"""One run, from its config to its records.

Owns: `runner.run(config, workdir)`, the only orchestrator, which never branches on the
algorithm (`runner`); the run's session: build, resume, the training loop and its hooks,
evaluation and checkpoints (`session`); resuming from a checkpoint (`resume`); checking a config
once, before anything is built (`validation`); evaluating the consensus model (`evaluation`);
and the records a user plots (`records`: metrics.jsonl, summary.json, TensorBoard, progress).
Imports every package below it; only the command line (`layup_jax.train`) imports it.
"""
