"""Bad configs fail at start with one line that names the key."""

import dataclasses
import subprocess
import sys

import pytest

from layup_jax import data, defaults
from layup_jax.run.validation import ConfigError, validate_config
from layup_jax.runtime.options import CONFIG_KEYS, RuntimeOptions


@pytest.mark.parametrize("key, value, message", [
    ("optimizer.learning_rate", -0.1, r"config.optimizer.learning_rate=-0.1: must be >= 0"),
    ("num_devices", 9, r"config.num_devices=9: must be between 1 and the 8 devices"),
    ("data.eval_resize", 100, r"config.data.eval_resize=100: must be >= data.image_size=224"),
    ("algorithm", "sync", r"config.algorithm='sync': must be one of \['adpsgd', 'co2', 'ddp'"),
    ("layup.bn_policy", "skip", r"config.layup.bn_policy='skip'"),
    ("straggler.device", 8, r"config.straggler.device=8: must name one of the 8"),
    ("straggler.mode", "gpu", r"config.straggler.mode='gpu': must be one of \['host'"),
    ("straggler.process", -2, r"config.straggler.process=-2: must be >= -1"),
    ("layup.push_sum", "exact", r"config.layup.push_sum='exact': must be one of \['per_stage'"),
    ("layup.fanout", 0, r"config.layup.fanout=0: must be >= 1"),
    ("distributed.heartbeat_timeout_s", 0,
     r"config.distributed.heartbeat_timeout_s=0: must be above 0 s"),
    ("layup.push_sum", "per_model",
     r"config.layup.fanout=2: more than one peer needs layup.push_sum='per_stage' \(per_model: set "),
    ("tuning.pin_host_threads", "yes", r"config.tuning.pin_host_threads='yes': must be one of \['auto'"),
    ("metrics.stop_at_target", True, r"config.metrics.stop_at_target=True: needs a target"),
    ("distributed.remote_peer_probability", 1.5,
     r"config.distributed.remote_peer_probability=1.5: must be in \[0, 1\], or -1"),
    ("distributed.max_remote_backlog", -1, r"config.distributed.max_remote_backlog=-1: must be >= 0"),
    ("precise_bn_batches", -1, r"config.precise_bn_batches=-1: must be >= 0"),
    ("distributed.compression", "fp8",
     r"config.distributed.compression='fp8': must be one of \['none', 'bf16', 'int8'\]"),
])
def test_impossible_values_name_their_key(tiny_config, key, value, message):
  section, _, name = key.rpartition(".")
  target = tiny_config[section] if section else tiny_config
  target[name] = value
  with pytest.raises(ConfigError, match=message):
    validate_config(tiny_config, 8)


def test_a_batch_larger_than_a_device_shard_is_refused_when_the_data_is_built(tiny_config):
  tiny_config.data.batch_size = 500
  with pytest.raises(ConfigError, match=r"config.data.batch_size=500: each of the 8 devices has "
                                        r"only 179 training samples"):
    data.make_dataset(tiny_config.data, 8, 0)


def test_a_token_dataset_needs_a_model_with_room_for_its_tokens(tiny_config):
  tiny_config.data.name = "text_files"
  with pytest.raises(ConfigError, match=r"config.model.name='digits_resnet': data.name="):
    validate_config(tiny_config, 8)
  tiny_config.model.name, tiny_config.model.vocab_size = "gpt2", 256
  with pytest.raises(ConfigError, match=r"config.model.vocab_size=256: the tokenizer .* has 257"):
    validate_config(tiny_config, 8)


def test_a_key_that_is_not_in_the_schema_is_unknown(tiny_config):
  tiny_config.optimizer.learnig_rate = 0.1
  with pytest.raises(ConfigError, match=r"unknown config key config.optimizer.learnig_rate"):
    validate_config(tiny_config, 8)


def test_pretrained_weights_need_a_model_that_imports_them_and_a_checkpoint(tiny_config, tmp_path):
  tiny_config.model.pretrained = str(tmp_path)
  with pytest.raises(ConfigError, match=r"model 'digits_resnet' has no weight import"):
    validate_config(tiny_config, 8)
  tiny_config.model.name = "gpt2"
  with pytest.raises(ConfigError, match=r"no model.safetensors in that directory"):
    validate_config(tiny_config, 8)


def test_the_default_config_is_valid(tiny_config):
  validate_config(tiny_config, 8)


@pytest.mark.parametrize("override, message", [
    ("--config.optimizer.learnig_rate=0.1",
     'error: unknown config key config.optimizer.learnig_rate (did you mean "learning_rate"'),
    ("--config.num_devices=abc", "error: flag --config.num_devices=abc: invalid literal"),
    ("--config.optimizer.learning_rate=-1",
     "error: config.optimizer.learning_rate=-1.0: must be >= 0"),
    ("--config.tuning.host_allocator=mimalloc",
     "error: config.tuning.host_allocator=mimalloc: must be one of auto, tcmalloc, jemalloc, system"),
    ("--config.layup.pack_stages=False",
     "error: config key config.layup.pack_stages is now config.tuning.pack_stages"),
])
def test_the_cli_reports_a_bad_override_in_one_line(tmp_path, override, message):
  result = subprocess.run(
      [sys.executable, "-m", "layup_jax.train", "--config", "configs/digits.py", override,
       f"--workdir={tmp_path}"],
      capture_output=True, text=True, timeout=120, check=False,
  )
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(message), result.stderr


@pytest.mark.parametrize("text, message", [
    ("not python\n", "error: the config file failed: {path} line 1: NameError: name 'python'"),
    ("def get_config(:\n", "error: the config file failed: {path} line 1: SyntaxError"),
    ("x = 1\n", "error: the config file {path} has no get_config()"),
    ("def get_config():\n  return {}['nope']\n",
     "error: the config file failed: {path} line 2: KeyError: 'nope'"),
])
def test_a_config_file_that_fails_or_has_no_get_config_is_one_line(tmp_path, text, message):
  path = tmp_path / "mine.py"
  path.write_text(text)
  result = subprocess.run(
      [sys.executable, "-m", "layup_jax.train", "--config", str(path), f"--workdir={tmp_path}"],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(message.format(path=path)), result.stderr


def test_train_help_prints_the_usage_and_exits_0():
  for flag in ("--help", "-h"):
    result = subprocess.run([sys.executable, "-m", "layup_jax.train", flag], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stdout.startswith(
        "usage: python -m layup_jax.train --config FILE[:ALGORITHM]"), result.stderr


def test_the_cli_says_in_one_line_how_to_prepare_a_missing_dataset(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "layup_jax.train", "--config", "configs/cifar100_resnet18.py",
       f"--config.data.data_dir={tmp_path}", f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, timeout=120, check=False,
  )
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith(f"error: dataset 'cifar100' is not prepared in the data dir {tmp_path}")
  assert f"tfds build cifar100 --data_dir={tmp_path} --file_format=array_record" in lines[0]


def test_runtime_options_are_built_from_the_config_keys():
  config = defaults.get_config()
  config.layup.push_sum, config.straggler.mode = "per_model", "device"
  config.metrics.latency_every = 3
  options = RuntimeOptions.from_config(config)
  assert (options.push_sum, options.straggler_mode, options.latency_every) == (
      "per_model", "device", 3)
  assert set(CONFIG_KEYS) == {field.name for field in dataclasses.fields(RuntimeOptions)}


def test_a_coordinator_port_in_use_is_one_line(tmp_path):
  """Process 0 starts the coordination service on the address's port; when another program
  holds that port the run stops in one line naming the key, not in jaxlib's error."""
  import socket

  with socket.socket() as taken:
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "layup_jax.train", "--config", "configs/digits.py",
         f"--workdir={tmp_path}", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
         "--config.distributed.num_processes=2", "--config.distributed.process_id=0"],
        capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert errors == [f"error: config.distributed.coordinator_address='127.0.0.1:{port}': the "
                    f"coordination service cannot listen on port {port} here (in use by another "
                    f"program or run?); choose a free port"]


def test_an_adam_normalized_as_by_the_mean_needs_own_gradients_adam_and_an_even_batch(
    tiny_config):
  tiny_config.optimizer.adam_mean_of, tiny_config.optimizer.name = 8, "adamw"
  tiny_config.algorithm = "ddp"
  with pytest.raises(ConfigError, match=r"adam_mean_of=8: ddp's Adam already sees"):
    validate_config(tiny_config, 8)
  tiny_config.algorithm, tiny_config.optimizer.name = "layup", "sgd"
  with pytest.raises(ConfigError, match=r"applies to Adam and AdamW"):
    validate_config(tiny_config, 8)
  tiny_config.optimizer.name, tiny_config.data.batch_size = "adamw", 7
  with pytest.raises(ConfigError, match=r"batch_size=7: must be even"):
    validate_config(tiny_config, 8)
  tiny_config.data.batch_size = 8
  validate_config(tiny_config, 8)
