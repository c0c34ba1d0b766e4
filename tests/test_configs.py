"""Every config in configs/ starts and trains 2 steps under layup and ddp on 4 devices, on mocked
TFDS records, with its model shrunk. A new config file is picked up without touching this test."""

import importlib
import json
import math
import pathlib

import pytest

from layup_jax import data, runner
from tests.helpers import write_fashion_mnist
from tests.tfds_fakes import mocked_tfds

CONFIG_DIR = pathlib.Path(__file__).parent.parent / "configs"
EXPERIMENTS = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("base", "__init__"))
TFDS_NAMES = [spec.tfds_name for spec in data.DATASETS.values() if spec.tfds_name]


def shrink(config, tmp_path):
  """Tiny model, 2 steps, 4 devices, small batches; the data pipeline stays the config's."""
  config.num_devices, config.num_steps, config.eval_every = 4, 2, 0
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
  with pytest.raises(ValueError, match=r"hyper-parameters for \['co2', 'ddp', 'gosgd', "
                                      r"'layup', 'slowmo'\], not 'sync'"):
    importlib.import_module("configs.cifar100_resnet18").get_config("sync")
