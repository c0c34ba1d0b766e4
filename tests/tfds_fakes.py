"""TFDS datasets that look prepared (metadata only) and read mocked records.

`tfds.testing.mock_data` replaces the records a prepared dataset would return; the metadata
written here makes a data dir look prepared, so the project's real checks (is it prepared,
which splits exist) run unchanged. Hugging Face datasets get the directory layout
`tfds build huggingface:...` leaves.
"""

import contextlib
import json
import pathlib

import tensorflow_datasets as tfds
from google.protobuf import json_format

TEXT = tfds.features.FeaturesDict({"text": tfds.features.Text()})


def write_metadata(path: pathlib.Path, name: str, version: str, features, splits: dict[str, int],
                   config: str = "") -> None:
  path.mkdir(parents=True, exist_ok=True)
  info = {
      "name": name, "version": version, "fileFormat": "array_record",
      "features": json_format.MessageToDict(features.to_proto()),
      "splits": [{"name": split, "shardLengths": [str(n)]} for split, n in splits.items()],
  }
  if config:
    info["configName"] = config
  (path / "dataset_info.json").write_text(json.dumps(info))
  features.save_config(str(path))


def fake_prepare(data_dir: pathlib.Path, name: str, splits: dict[str, int]) -> None:
  """Makes `data_dir` hold metadata of the TFDS dataset `name` (native or `huggingface:`)."""
  if name.startswith("huggingface:"):
    dataset, _, config = name.removeprefix("huggingface:").partition("/")
    config = config.lower().replace("-", "_") or "default"
    write_metadata(data_dir / dataset / config / "1.0.0", dataset, "1.0.0", TEXT, splits, config)
    return
  builder = tfds.builder(name, data_dir=str(data_dir))
  write_metadata(pathlib.Path(builder.data_path), builder.name, str(builder.version),
                 builder.info.features, splits, builder.builder_config.name
                 if builder.builder_config else "")


@contextlib.contextmanager
def mocked_tfds(data_dir: pathlib.Path, names: list[str], num_examples: int,
                splits: tuple[str, ...] = ("train", "test", "validation")):
  for name in names:
    fake_prepare(data_dir, name, {split: num_examples for split in splits})
  with tfds.testing.mock_data(num_examples=num_examples, data_dir=str(data_dir)):
    yield
