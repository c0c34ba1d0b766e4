"""Checks a config before anything is built, so that a user's mistake fails in one clear line.

`layup_jax/defaults.py` is the schema: a key it does not have is reported as unknown.
"""

import pathlib

import jax
import ml_collections

from layup_jax import algorithms, data, defaults, models, optim
from layup_jax.algorithms import ddp
from layup_jax.errors import ConfigError
from layup_jax.models import gpt2
from layup_jax.platform import allocator
from layup_jax.pushsum import compression
from layup_jax.runtime import options, programs, stats, straggler


def _unknown_keys(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict,
                  prefix: str) -> list[str]:
  unknown = []
  for key, value in config.items():
    name = f"{prefix}.{key}"
    if name == "config.columns":  # the experiment's table: any algorithm, any key
      continue
    if key not in schema:
      unknown.append(name)
    elif isinstance(value, ml_collections.ConfigDict) and isinstance(
        schema[key], ml_collections.ConfigDict
    ):
      unknown.extend(_unknown_keys(value, schema[key], name))
  return unknown


def _require(ok: bool, key: str, value, why: str) -> None:
  if not ok:
    raise ConfigError(f"config.{key}={value!r}: {why}")


def _one_of(config, key: str, choices) -> None:
  value = _get(config, key)
  _require(value in choices, key, value, f"must be one of {list(choices)}")


def _get(config, key: str):
  value = config
  for part in key.split("."):
    value = value[part]
  return value


def _at_least(config, key: str, bound: float) -> None:
  value = _get(config, key)
  _require(value >= bound, key, value, f"must be >= {bound}")


def validate_config(config: ml_collections.ConfigDict, num_available_devices: int) -> None:
  """Raises ConfigError for the first problem found."""
  unknown = _unknown_keys(config, defaults.get_config(), "config")
  if unknown:
    moved = defaults.RENAMED.get(unknown[0].removeprefix("config."))
    if moved:
      raise ConfigError(f"config key {unknown[0]} is now config.{moved}")
    raise ConfigError(f"unknown config key {unknown[0]} (every key is listed in "
                      f"layup_jax/defaults.py)")
  _one_of(config, "algorithm", algorithms.names())
  _one_of(config, "tuning.host_allocator", allocator.CHOICES)
  _one_of(config, "model.name", models.names())
  _one_of(config, "model.variant", models.VARIANTS)
  _one_of(config, "model.granularity", models.GRANULARITIES)
  _one_of(config, "model.dtype", models.DTYPES)
  _one_of(config, "model.size", gpt2.SIZES)
  _one_of(config, "model.attention", gpt2.ATTENTION)
  _require(config.model.attention != "cudnn" or jax.default_backend() == "gpu",
           "model.attention", "cudnn",
           f"cuDNN's attention runs on GPUs only (devices here: {jax.default_backend()}); "
           f"use auto or xla")
  _one_of(config, "data.name", data.names())
  _one_of(config, "optimizer.name", optim.OPTIMIZERS)
  _one_of(config, "optimizer.schedule", optim.SCHEDULES)
  _one_of(config, "layup.bn_policy", options.BN_POLICIES)
  _one_of(config, "layup.push_sum", options.PUSH_SUM)
  _one_of(config, "layup.local_update", options.LOCAL_UPDATES)
  _at_least(config, "layup.fanout", 1)
  _require(config.layup.fanout == 1 or config.layup.push_sum == "per_stage", "layup.fanout",
           config.layup.fanout,
           "more than one peer needs layup.push_sum='per_stage' (per_model: set layup.fanout=1)")
  _one_of(config, "tuning.pin_host_threads", options.PIN_HOST_THREADS)
  _one_of(config, "tuning.remat", programs.REMAT_POLICIES)
  _one_of(config, "faults.nonfinite", stats.POLICIES)
  _one_of(config, "straggler.mode", straggler.MODES)
  _one_of(config, "baselines.ddp_batch_norm", ddp.BATCH_NORM)
  _one_of(config, "baselines.co2_resume", ("correct", "restart"))
  _one_of(config, "distributed.compression", compression.CODECS)
  _require(config.distributed.heartbeat_timeout_s > 0, "distributed.heartbeat_timeout_s",
           config.distributed.heartbeat_timeout_s,
           "must be above 0 s (at 0 every process would find every other silent at once)")

  for key, value in defaults.ALGORITHM_SETTINGS.get(config.algorithm, {}).items():
    _require(_get(config, key) == value, key, _get(config, key),
             f"{config.algorithm} runs with {key}={value!r} (`--config <file>:{config.algorithm}` "
             f"sets it)")

  pretrained = config.model.pretrained
  if pretrained:
    _require(models.supports_pretrained(config.model.name), "model.pretrained", pretrained,
             f"model {config.model.name!r} has no weight import (gpt2 has)")
    _require(pathlib.Path(pretrained, "model.safetensors").is_file(), "model.pretrained",
             pretrained, "no model.safetensors in that directory (nothing is downloaded)")

  num_devices = config.num_devices
  processes = config.distributed.num_processes if config.distributed.coordinator_address else 1
  _require(
      1 <= num_devices <= num_available_devices, "num_devices", num_devices,
      f"must be between 1 and the {num_available_devices} devices JAX sees (on CPU, set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count=N for N fake devices)" if processes == 1
      else f"must be between 1 and the {num_available_devices} devices of the run's "
           f"{processes} processes (python -m layup_jax.launch --devices-per-process D gives "
           f"each process D; on a cluster, each process brings its own devices)",
  )
  checks: list[tuple[str, float]] = [
      ("data.batch_size", 1), ("optimizer.learning_rate", 0), ("optimizer.momentum", 0),
      ("optimizer.weight_decay", 0), ("optimizer.warmup_steps", 0), ("optimizer.warmup_epochs", 0),
      ("optimizer.warmup_fraction", 0),
      ("optimizer.warmup_init_lr", 0), ("optimizer.adam_mean_of", 1), ("num_steps", 0),
      ("num_epochs", 0), ("eval_every", 0),
      ("precise_bn_batches", 0),
      ("tuning.max_dispatch_ahead", 1), ("straggler.delay_iters", 0), ("straggler.device", -1),
      ("straggler.process", -1),
      ("model.num_classes", 1), ("model.vocab_size", 1), ("model.vocab_multiple", 0), ("model.max_len", 1),
      ("model.hidden_size", 1), ("model.num_layers", 1), ("model.dropout", 0),
      ("checkpoint.every", 0), ("checkpoint.keep", 1), ("layup.max_update_scale", 1), ("metrics.target_accuracy", 0),
      ("metrics.target_perplexity", 0), ("metrics.target_loss", 0), ("metrics.latency_every", 0),
      ("metrics.progress_every_s", 0),
      ("tuning.max_sends_in_flight", 0), ("model.stages_per_group", 1),
      ("distributed.max_remote_backlog", 0), ("distributed.progress_timeout_s", 0),
      ("distributed.max_dropped_sends", 0),
  ]
  for key, bound in checks:
    _at_least(config, key, bound)
  probability = config.distributed.remote_peer_probability
  _require(probability == -1 or 0 <= probability <= 1, "distributed.remote_peer_probability",
           probability, "must be in [0, 1], or -1 for peers uniform over the run's devices")
  poll = config.tuning.idle_poll_s
  _require(poll == -1 or poll > 0, "tuning.idle_poll_s", poll,
           "must be > 0 (seconds), or -1 to choose by the devices' platform")
  _at_least(config, "baselines.tau", 1)
  _at_least(config, "baselines.out_freq", 0)
  for key in ("baselines.slow_lr", "baselines.slow_momentum", "baselines.co2_clip",
              "baselines.outer_lr", "baselines.outer_momentum"):
    _at_least(config, key, 0)
  _require(config.baselines.co2_gap_penalty > 0, "baselines.co2_gap_penalty",
           config.baselines.co2_gap_penalty, "must be > 0 (it divides the pseudo-gradient)")
  _require(config.baselines.out_freq % config.baselines.tau == 0, "baselines.out_freq",
           config.baselines.out_freq, f"must be a multiple of baselines.tau={config.baselines.tau}")
  _require(not algorithms.get(config.algorithm).outer_step_every_average
           or config.baselines.out_freq in (0, config.baselines.tau),
           "baselines.out_freq", config.baselines.out_freq,
           f"{config.algorithm} takes an outer step at every average: set it equal to "
           f"baselines.tau={config.baselines.tau}")
  metrics = config.metrics
  _require(not metrics.get("stop_at_target", False)
           or max(metrics.target_accuracy, metrics.target_perplexity, metrics.target_loss) > 0,
           "metrics.stop_at_target", True,
           "needs a target: set metrics.target_accuracy, metrics.target_loss or "
           "metrics.target_perplexity")
  mean_of = config.optimizer.adam_mean_of
  if mean_of > 1:
    _require(algorithms.get(config.algorithm).own_gradients, "optimizer.adam_mean_of", mean_of,
             f"{config.algorithm}'s Adam already sees its devices' mean gradient: leave it at 1")
    _require(config.optimizer.name in ("adam", "adamw"), "optimizer.adam_mean_of", mean_of,
             f"applies to Adam and AdamW, not optimizer.name={config.optimizer.name!r}")
    _require(config.data.batch_size % 2 == 0, "data.batch_size", config.data.batch_size,
             "must be even with optimizer.adam_mean_of > 1 (the noise is measured from the "
             "batch's two halves)")
  _require(config.optimizer.momentum < 1, "optimizer.momentum", config.optimizer.momentum,
           "must be < 1")
  _require(config.optimizer.warmup_fraction < 1, "optimizer.warmup_fraction",
           config.optimizer.warmup_fraction, "must be < 1 (a share of the run's steps)")
  _require(config.model.dropout < 1, "model.dropout", config.model.dropout, "must be < 1")
  _require(config.model.stages_per_group == 1 or not config.model.get("pretrained"),
           "model.stages_per_group", config.model.stages_per_group,
           "must be 1 with model.pretrained (pretrained weights are read stage by stage)")
  _require(0 < config.data.test_fraction < 1, "data.test_fraction", config.data.test_fraction,
           "must be between 0 and 1")
  _require(config.num_steps > 0 or config.num_epochs > 0, "num_steps", config.num_steps,
           "must be > 0 when num_epochs is 0")
  _require(config.straggler.device < num_devices, "straggler.device", config.straggler.device,
           f"must name one of the {num_devices} training devices (or -1 for none)")
  _require(config.straggler.process < 0 or config.straggler.device < 0, "straggler.process",
           config.straggler.process, "and straggler.device cannot both be set (-1: none)")
  for key in ("data.seq_len", "data.image_size", "data.eval_resize", "data.prefetch",
              "data.eval_batch_size"):
    _at_least(config, key, 1)
  _at_least(config, "data.read_threads", 0)
  _at_least(config, "data.max_eval_batches", 0)
  _require(config.data.eval_resize >= config.data.image_size, "data.eval_resize",
           config.data.eval_resize, f"must be >= data.image_size={config.data.image_size}")
  if config.data.tokenizer:
    _require(pathlib.Path(config.data.tokenizer).expanduser().is_dir(), "data.tokenizer",
             config.data.tokenizer, "is not a directory (it holds the tokenizer files)")
  _check_text_model(config)


def _check_text_model(config: ml_collections.ConfigDict) -> None:
  """Token datasets need a model whose vocabulary holds every token and whose context fits."""
  vocab = data.token_vocab_size(config.data)
  if vocab is None:
    return
  _require(config.model.name in ("gpt2", "lstm"), "model.name", config.model.name,
           f"data.name={config.data.name!r} gives token sequences; use gpt2 or lstm")
  _require(config.model.vocab_size >= vocab, "model.vocab_size", config.model.vocab_size,
           f"the tokenizer of data.tokenizer={config.data.tokenizer!r} has {vocab} tokens")
  if config.model.name == "gpt2":
    _require(config.data.seq_len <= config.model.max_len, "data.seq_len", config.data.seq_len,
             f"must be <= model.max_len={config.model.max_len} (GPT-2's learned positions)")


def _flat(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def run_notes(config: ml_collections.ConfigDict) -> list[str]:
  """The lines a run prints before it starts about what it does other than its config says:
  `column_notes`, and a `layup.fanout` above the run's other devices (each stage then goes to
  every other device, no more)."""
  notes = column_notes(config)
  others = config.num_devices - 1
  if config.algorithm == "layup" and config.layup.fanout > others:
    notes.append(f"note: layup.fanout={config.layup.fanout} asks for more peers than the "
                 f"{others} other device{'s' if others != 1 else ''} of this run: each stage "
                 f"goes to {others}")
  return notes


def column_notes(config: ml_collections.ConfigDict) -> list[str]:
  """One line when the algorithm that runs has no column in the experiment's table, or has one
  whose values the config does not hold (`--config.algorithm=X` keeps the column the file was
  loaded with): which values the run keeps, and how to take X's column."""
  columns = config.columns.to_dict()
  algorithm = config.algorithm
  if not columns or config.column == algorithm:
    return []
  if algorithm not in columns:
    return [f"note: this config has no hyper-parameter column for {algorithm} (it has "
            f"{', '.join(sorted(columns))}): {algorithm} runs with the config's values as they "
            f"are" + (f", {config.column}'s column included" if config.column else "")]
  own = _flat(columns[algorithm])
  kept = {key: _get(config, key) for key in own if _get(config, key) != own[key]}
  if not kept:
    return []
  return [f"note: this run of {algorithm} keeps "
          + ", ".join(f"{key}={value!r}" for key, value in kept.items())
          + f" where the config's {algorithm} column has "
          + ", ".join(f"{key}={own[key]!r}" for key in kept)
          + f"; `--config <config file>:{algorithm}` takes that column"]


def resolve_num_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
  """`num_steps`, or `num_epochs` epochs of each device's shard."""
  return config.num_steps or config.num_epochs * steps_per_epoch
