"""Builds a run from its config, trains with evaluations at fixed steps, and writes the records.

The only orchestrator: it never looks at which algorithm runs; each one is a `Runtime`
(layup_jax/algorithms/base.py). `run` is the whole run in its order: check the config, build
(`Session`), resume or start, compile, train with the hooks, then stop or finish.
"""

import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from layup_jax import algorithms
from layup_jax.measure import provenance
from layup_jax.multiprocess import setup
from layup_jax.platform import compile_cache
from layup_jax.run.session import Every, Session
from layup_jax.run.validation import run_notes, validate_config


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path,
        should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
  """Trains `config` and returns the summary also written to `workdir/summary.json`.

  Resumes from the newest checkpoint in `workdir/checkpoints` (else from `config.restore`).
  When `should_stop()` turns true (SIGTERM, Ctrl-C) the run stops at the next consistent point,
  saves a checkpoint and returns `{"stopped": True, "step": ...}` without a summary.
  """
  validate_config(config, len(jax.devices()))
  if jax.process_index() == 0:
    for note in run_notes(config):
      print(note, file=sys.stderr, flush=True)
  setup.check_supported(config, algorithms.get(config.algorithm).gossip)
  code_version = provenance.code_version()  # the code that runs (a commit during it changes none)
  compile_cache.enable(config.get("compilation_cache_dir", ""))
  session = Session(config, workdir)  # build
  try:
    session.restore()  # restore (or start), then compile
    session.compile()
    hooks = [Every(config.eval_every, session.evaluate)]
    if config.checkpoint.enabled:
      hooks.append(Every(config.checkpoint.every, session.save))
    step = session.train(hooks, should_stop)  # the loop
    stopped = step < session.num_steps and not session.stopped_at_target
    result = session.stop(step) if stopped else None
    if not stopped:
      session.finish(step)
  except BaseException:
    _close_after(session)
    raise
  session.close()
  return result if stopped else session.summary(code_version)


def _close_after(session: Session) -> None:
  """Closes a session whose run failed. The run's own error is the one its process ends with:
  a thread still blocked by what failed (a receiver's pull from a peer that is gone) would make
  the close fail too, and that error would replace the first as the process's last line."""
  try:
    session.close()
  except Exception as error:  # noqa: BLE001 - said, not raised: the run's error follows
    print(f"note: closing the failed run also failed ({error})", file=sys.stderr, flush=True)
