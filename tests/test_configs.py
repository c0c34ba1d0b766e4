"""Every config in configs/ starts and trains 2 steps under layup and ddp on 2 devices, on mocked
TFDS records, with its model shrunk. A new config file is picked up without touching this test."""

import importlib
import json
import math
import pathlib

import pytest

from layup_jax import data, defaults
from layup_jax.errors import ConfigError
from layup_jax.run import runner
from layup_jax.run.validation import column_notes, run_notes, validate_config
from tests.helpers import write_fashion_mnist
from tests.tfds_fakes import mocked_tfds

CONFIG_DIR = pathlib.Path(__file__).parent.parent / "configs"
EXPERIMENTS = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("base", "__init__"))
TFDS_NAMES = [spec.tfds_name for spec in data.DATASETS.values() if spec.tfds_name]


def shrink(config, tmp_path):
  """Tiny model, 2 steps, 2 devices (each compiles every stage: fewer, faster), small batches;
  the data pipeline stays the config's."""
  config.num_devices, config.num_steps, config.eval_every = 2, 2, 0
  config.progress_bar = False
  config.data.data_dir, config.data.token_cache_dir = str(tmp_path / "tfds"), ""
  config.data.batch_size, config.data.eval_batch_size, config.data.max_eval_batches = 2, 4, 1
  config.data.seq_len, config.data.image_size, config.data.eval_resize = 16, 32, 36
  config.data.read_threads = 1
  if config.data.name == "fashion_mnist":  # the idx files, written here (random images)
    config.data.data_dir = str(tmp_path / "fashion_mnist")
    write_fashion_mnist(config.data.data_dir)
  if config.model.name in ("resnet18", "resnet50"):
    config.model.name, config.model.widths = "digits_resnet", (4,)
  if config.model.name == "digits_resnet":
    config.model.widths = (4,)
  if config.model.name == "gpt2":
    config.model.size, config.model.pretrained, config.model.max_len = "tiny", "", 16
  if config.model.name == "lstm":
    config.model.hidden_size = 8
  return config


@pytest.mark.parametrize("algorithm", ["layup", "ddp"])
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_config_trains_two_steps(experiment, algorithm, tmp_path):
  config = importlib.import_module(f"configs.{experiment}").get_config(algorithm)
  assert config.algorithm == algorithm
  shrink(config, tmp_path)
  with mocked_tfds(tmp_path / "tfds", TFDS_NAMES, num_examples=64):
    summary = runner.run(config, tmp_path / "run")
  assert summary["num_steps"] == 2 and math.isfinite(summary["final_eval_loss"])
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r["step"] for r in rows if r["split"] == "test"] == [0, 2]


def test_the_paper_columns_differ_where_the_paper_does():
  layup = importlib.import_module("configs.cifar100_resnet18").get_config("layup")
  ddp = importlib.import_module("configs.cifar100_resnet18").get_config("ddp")
  assert (layup.optimizer.learning_rate, ddp.optimizer.learning_rate) == (0.035, 0.045)
  assert (layup.optimizer.warmup_epochs, ddp.optimizer.warmup_epochs) == (5.0, 0.0)


def test_an_algorithm_without_a_column_runs_the_configs_values_and_says_so_in_one_line():
  module = importlib.import_module("configs.cifar100_resnet18")
  config = module.get_config("local_sgd")  # the paper gives no Local SGD column for CIFAR
  assert (config.algorithm, config.column) == ("local_sgd", "")
  assert config.optimizer.learning_rate == defaults.get_config().optimizer.learning_rate
  validate_config(config, 8)
  (note,) = column_notes(config)
  assert "no hyper-parameter column for local_sgd (it has co2, ddp, gosgd, layup, slowmo)" in note
  with pytest.raises(ConfigError, match="config.algorithm='sync': must be one of"):
    validate_config(module.get_config("sync"), 8)


def test_an_algorithm_override_names_the_values_it_keeps_from_another_column():
  # `--config configs/fashion_mnist.py --config.algorithm=ddp`: LayUp's column, DDP's run.
  config = importlib.import_module("configs.fashion_mnist").get_config()
  config.algorithm = "ddp"
  (note,) = column_notes(config)
  assert note == ("note: this run of ddp keeps optimizer.learning_rate=0.8, "
                  f"optimizer.warmup_fraction={1 / 3!r} where the config's ddp column has "
                  "optimizer.learning_rate=0.4, optimizer.warmup_fraction=0.0; "
                  "`--config <config file>:ddp` takes that column")
  config.algorithm = "gosgd"  # the same values as LayUp's column: nothing to say
  assert column_notes(config) == []
  assert column_notes(importlib.import_module("configs.fashion_mnist").get_config("ddp")) == []


@pytest.mark.parametrize("algorithm", ["layup", "ddp", "gosgd", "adpsgd", "local_sgd", "slowmo",
                                       "co2", "diloco"])
def test_every_algorithm_by_name_on_the_digits_config(algorithm):
  by_suffix = importlib.import_module("configs.digits").get_config(algorithm)
  by_override = importlib.import_module("configs.digits").get_config()
  by_override.algorithm = algorithm
  for config in (by_suffix, by_override):
    validate_config(config, 8)  # DiLoCo too: out_freq 0 follows tau
    assert column_notes(config) == []  # digits has no columns: every algorithm, same values


def test_the_papers_variant_runs_by_name_with_algorithm_1s_settings():
  """`:layup_paper` is Algorithm 1 as written (one weight per device, a stage per layer) on any
  config; naming it with `--config.algorithm` alone, on `layup`'s defaults, is refused in one
  line that says how to run it."""
  for experiment in ("digits", "fashion_mnist"):
    config = importlib.import_module(f"configs.{experiment}").get_config("layup_paper")
    assert (config.layup.push_sum, config.model.granularity) == ("per_model", "per_layer")
    validate_config(config, 8)
  config = importlib.import_module("configs.digits").get_config()
  config.algorithm = "layup_paper"
  with pytest.raises(ConfigError, match=r"config.layup.push_sum='per_stage': layup_paper runs "
                                        r"with layup.push_sum='per_model' \(`--config <file>:"):
    validate_config(config, 8)


def test_a_fanout_above_the_other_devices_is_said_in_one_line_before_the_run():
  config = defaults.get_config()
  assert config.algorithm == "layup" and config.layup.fanout == 2
  config.num_devices = 8
  assert run_notes(config) == []
  config.num_devices = 2
  (note,) = run_notes(config)
  assert note == ("note: layup.fanout=2 asks for more peers than the 1 other device of this "
                  "run: each stage goes to 1")
  config.algorithm = "gosgd"  # one peer per send: fanout is LayUp's alone
  assert run_notes(config) == []
