"""What decides, before training, whether checkpoints can be written here and whether a saved
one can resume this run's config."""

import json
import os
import pathlib
import shutil
from typing import Any

import jax
from absl import logging

from layup_jax import defaults
from layup_jax.errors import ConfigError, StorageError

# Keys that decide the shapes and structure of the saved arrays: a checkpoint written with other
# values cannot be loaded into this run.
STRUCTURAL_KEYS = ("algorithm", "model", "optimizer.name", "data.name", "tuning.pack_stages")


def check_storage(workdir: pathlib.Path, checkpoint_bytes: int, keep: int) -> None:
  """Fails before training when the workdir cannot be written or cannot hold the checkpoints.

  Orbax writes a new checkpoint before it deletes the oldest, so `keep + 1` must fit.
  """
  directory = workdir / "checkpoints"
  try:
    directory.mkdir(parents=True, exist_ok=True)
    # One name per process: processes sharing the workdir must not remove each other's probe.
    probe = directory / f".write_test.{jax.process_index()}.{os.getpid()}"
    probe.write_bytes(b"0" * 4096)
    probe.unlink()
  except OSError as error:
    raise StorageError(f"the workdir {workdir} is not writable ({error.strerror or error}); "
                       f"choose another --workdir") from error
  needed = checkpoint_bytes * (keep + 1)
  free = shutil.disk_usage(directory).free
  if free < needed:
    raise StorageError(
        f"the checkpoints need about {needed / 2**20:.1f} MiB in {directory} ({keep} kept + 1 "
        f"being written, {checkpoint_bytes / 2**20:.1f} MiB each) but only "
        f"{free / 2**20:.1f} MiB are free; free space, lower checkpoint.keep, choose another "
        f"--workdir, or set checkpoint.enabled=False")


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{name}."))
    else:
      flat[name] = value
  return flat


def config_differences(saved_json: str, current_json: str) -> dict[str, tuple[Any, Any]]:
  """`{key: (saved, current)}` for every config value that differs.

  A key the saved config lacks was added after the checkpoint was written; that run behaved as
  the key's default does (or as `defaults.BEFORE_THE_KEY` says, where the default changed later),
  which stands in for it: a checkpoint written before `model.attention` existed resumes.
  """
  saved = {defaults.RENAMED.get(k, k): v for k, v in _flatten(json.loads(saved_json)).items()}
  current = _flatten(json.loads(current_json))
  before = {**_flatten(json.loads(defaults.get_config().to_json_best_effort())),
            **defaults.BEFORE_THE_KEY}
  saved.update({k: before[k] for k in current.keys() - saved.keys() if k in before})
  return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
          if saved.get(k) != current.get(k)}


def check_compatible(saved_json: str, current_json: str, where: pathlib.Path) -> None:
  """ConfigError if the checkpoint cannot resume this config; a warning for other changes."""
  differences = config_differences(saved_json, current_json)
  structural = {k: v for k, v in differences.items()
                if any(k == s or k.startswith(f"{s}.") for s in STRUCTURAL_KEYS)}
  if structural:
    key, (saved, current) = next(iter(structural.items()))
    raise ConfigError(
        f"the checkpoint in {where} was written with {key}={saved!r} (this run: {current!r}), "
        f"which changes what is saved; resume with the config it was written with, or use "
        f"another --workdir to start afresh")
  changed = [k for k in differences if k not in ("restore", "progress_bar")]
  if changed:
    logging.warning("resuming from %s with a config that differs in %s", where,
                    ", ".join(f"{k} ({differences[k][0]!r} -> {differences[k][1]!r})"
                              for k in changed))
