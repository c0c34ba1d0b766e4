"""Every paper config's column equals the paper's appendix tables (appendix "Hyperparameters for
the experiments"), transcribed here as printed, and its hardware: vision on C1 (3 GPUs),
pre-training on C2 (8), fine-tuning on C3 (4), all in 32-bit floats (Section 5)."""

import importlib

import pytest

# The tables, column by column, as the paper prints them. `t_max` and `warmup` are in `unit`;
# the GPT-2 tables' batch sizes are global (Section 5: 48 and 4 per worker); None: "-".
ROWS = ("batch_size", "optimizer", "lr", "t_max", "warmup", "warmup_lr", "weight_decay",
        "out_freq", "tau")


def _table(devices, unit, batch, schedule, columns):
  return {"devices": devices, "unit": unit, "batch": batch, "schedule": schedule,
          "columns": {name: dict(zip(ROWS, values)) for name, values in columns.items()}}


TABLES = {
    # Vision ran on C1 (3 GPUs). ImageNet: the text's linear decay (its table says cosine).
    "imagenet_resnet50": _table(3, "epochs", "per worker", "linear", {
        "ddp": (256, "sgd", 0.3, 90, 2, 0.1, 0.0001, None, None),
        "co2": (256, "sgd", 0.3, 90, 2, 0.1, 0.0001, 48, 12),
        "slowmo": (256, "sgd", 0.3, 90, 2, 0.1, 0.0001, 48, 12),
        "layup": (256, "sgd", 0.1, 90, 2, 0.03, 0.0001, None, None),
        "gosgd": (256, "sgd", 0.1, 90, 2, 0.03, 0.0001, None, None),
    }),
    "cifar100_resnet18": _table(3, "epochs", "per worker", "cosine", {
        "ddp": (128, "sgd", 0.045, 100, 0, 0, 0.005, None, None),
        "co2": (128, "sgd", 0.045, 100, 0, 0, 0.005, 48, 12),
        "slowmo": (128, "sgd", 0.045, 100, 0, 0, 0.005, 48, 12),
        "layup": (128, "sgd", 0.035, 100, 5, 0.012, 0.003, None, None),
        "gosgd": (128, "sgd", 0.045, 100, 5, 0.015, 0.005, None, None),
    }),
    "cifar100_resnet50": _table(3, "epochs", "per worker", "cosine", {
        "ddp": (128, "sgd", 0.045, 100, 0, 0, 0.005, None, None),
        "co2": (128, "sgd", 0.045, 100, 0, 0, 0.005, 48, 12),
        "slowmo": (128, "sgd", 0.045, 100, 0, 0, 0, 48, 12),
        "layup": (128, "sgd", 0.035, 100, 5, 0.01, 0.005, None, None),
        "gosgd": (128, "sgd", 0.022, 100, 5, 0.0073, 0.014, None, None),
    }),
    # Pre-training ran on C2 (8 GPUs).
    "minipile_gpt2_medium": _table(8, "iterations", "global", "cosine", {
        "ddp": (384, "adamw", 0.76978, 45_539, 0, 0, 0, None, None),
        "co2": (384, "adamw", 0.9645, 45_539, 0, 0, 0, 20, 5),
        "slowmo": (384, "adamw", 0.9645, 45_539, 0, 0, 0, 20, 5),
        "layup": (384, "adamw", 0.00075249, 138_972, 3_488, 0.00014011, 0.0031235, None, None),
        "gosgd": (384, "adamw", 0.00075249, 138_972, 3_488, 0.00014011, 0.0031235, None, None),
    }),
    # Fine-tuning ran on C3 (4 GPUs).
    "wikitext103_gpt2_xl": _table(4, "iterations", "global", "cosine", {
        "ddp": (16, "adamw", 0.31645, 7_286, 0, 0.005, 0, None, None),
        "co2": (16, "adamw", 0.38939, 7_286, 0, 0.005, 0, 48, 12),
        "slowmo": (16, "adamw", 0.32855, 7_286, 0, 0.005, 0, 48, 12),
        "layup": (16, "adamw", 0.0003, 29_144, 7_000, 0.0002, 0, None, None),
        "gosgd": (16, "adamw", 0.0003, 29_144, 7_000, 0.0002, 0, None, None),
    }),
    # IMDb: DDP and LayUp only, T_max read as epochs; its machine is not stated.
    "imdb_lstm": _table(None, "epochs", "per worker", "cosine", {
        "ddp": (75, "adam", 0.001, 150, 0, 0, 0, None, None),
        "layup": (75, "adam", 0.0015, 150, 0, 0, 0, None, None),
    }),
}
CASES = [(experiment, algorithm) for experiment, table in TABLES.items()
         for algorithm in table["columns"]]


def _config(experiment, algorithm):
  return importlib.import_module(f"configs.{experiment}").get_config(algorithm)


@pytest.mark.parametrize(("experiment", "algorithm"), CASES)
def test_the_config_column_is_the_paper_table_column(experiment, algorithm):
  table = TABLES[experiment]
  column, config = table["columns"][algorithm], _config(experiment, algorithm)
  devices = config.num_devices
  if table["devices"] is not None:
    assert devices == table["devices"]
  assert config.model.dtype == "float32"
  per_worker = column["batch_size"] // devices if table["batch"] == "global" else column[
      "batch_size"]
  assert config.data.batch_size == per_worker
  assert config.optimizer.name == column["optimizer"]
  assert config.optimizer.learning_rate == column["lr"]
  assert config.optimizer.schedule == table["schedule"]
  assert config.optimizer.warmup_init_lr == column["warmup_lr"]
  assert config.optimizer.weight_decay == column["weight_decay"]
  if table["unit"] == "epochs":
    assert (config.num_steps, config.num_epochs) == (0, column["t_max"])
    assert (config.optimizer.warmup_steps, config.optimizer.warmup_epochs) == (0, column["warmup"])
  else:
    # LayUp's and GoSGD's columns count iterations summed over the workers; a step here is
    # one iteration of every device (the configs' docstrings).
    summed = algorithm in ("layup", "gosgd")
    workers = devices if summed else 1
    assert config.num_steps == round(column["t_max"] / workers)
    assert config.optimizer.warmup_steps == column["warmup"] // workers
    if summed:
      assert column["warmup"] % workers == 0
  if algorithm in ("slowmo", "co2"):
    assert (config.baselines.tau, config.baselines.out_freq) == (column["tau"],
                                                                 column["out_freq"])


def test_every_paper_config_and_column_is_transcribed():
  """A config or column added without its table row fails here."""
  for experiment, table in TABLES.items():
    module = importlib.import_module(f"configs.{experiment}")
    assert sorted(module.PAPER) == sorted(table["columns"]), experiment


def test_fine_tuning_t_max_of_layup_is_the_workers_times_ddp_and_pre_training_is_not():
  """The rule's evidence, and the exception the MiniPile config's docstring reports."""
  wikitext, minipile = TABLES["wikitext103_gpt2_xl"], TABLES["minipile_gpt2_medium"]
  assert wikitext["columns"]["layup"]["t_max"] == 4 * wikitext["columns"]["ddp"]["t_max"]
  assert minipile["columns"]["layup"]["t_max"] != 8 * minipile["columns"]["ddp"]["t_max"]
  assert _config("minipile_gpt2_medium", "layup").num_steps == 17_372
