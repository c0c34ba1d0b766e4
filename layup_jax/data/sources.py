"""Opens prepared TFDS splits for random access (`tfds.data_source`, no TensorFlow), offline.

Nothing is downloaded here. A dataset that is not prepared in the data dir, a split it does not
have, or a record that does not decode raises `DataError` with what to do about it.

Hugging Face datasets in TFDS's `huggingface:` namespace are found by their prepared directory
(`DATA_DIR/<name>/<config>/<version>`), because resolving them by name asks the Hugging Face Hub.
"""

import contextlib
import os
import pathlib
import re
from typing import Any

import tensorflow_datasets as tfds
from absl import logging

from layup_jax.errors import DataError

HF_PREFIX = "huggingface:"


def resolve_data_dir(data_dir: str) -> pathlib.Path:
  """`data_dir`, else `$TFDS_DATA_DIR`, else TFDS's default `~/tensorflow_datasets`."""
  return pathlib.Path(data_dir or os.environ.get("TFDS_DATA_DIR")
                      or "~/tensorflow_datasets").expanduser()


def prepare_command(name: str, data_dir: pathlib.Path) -> str:
  """How to prepare `name` once, on a machine with internet and TensorFlow."""
  command = f"tfds build {name} --data_dir={data_dir} --file_format=array_record"
  needs = "pip install tensorflow tensorflow-datasets"
  if name.startswith(HF_PREFIX):
    needs += " huggingface_hub datasets"
  if name.startswith("imagenet2012"):
    command += (f" --manual_dir={data_dir}/downloads/manual (after putting ILSVRC2012_img_train.tar"
                " and ILSVRC2012_img_val.tar from image-net.org there)")
  return f"`{needs} && {command}`"


def _not_prepared(name: str, data_dir: pathlib.Path, searched: str) -> DataError:
  return DataError(
      f"dataset {name!r} is not prepared in the data dir {data_dir} (looked for {searched}); "
      f"nothing is downloaded at run time. Prepare it once with {prepare_command(name, data_dir)}, "
      f"then pass --config.data.data_dir={data_dir} or set TFDS_DATA_DIR.")


def _tfds_name(part: str) -> str:
  """A Hugging Face name as TFDS spells it: lowercase, `/` -> `__`, `-` -> `_`."""
  return re.sub(r"[^a-z0-9_]", "_", part.lower().replace("/", "__"))


def _hf_builder(name: str, data_dir: pathlib.Path):
  """The prepared `huggingface:` dataset read from its directory (no Hub access)."""
  dataset, _, config = name[len(HF_PREFIX):].partition("/")
  parts = [_tfds_name(dataset)] + ([_tfds_name(config)] if config else ["*"])
  pattern = "/".join(parts + ["*", "dataset_info.json"])
  found = sorted(data_dir.glob(pattern)) + sorted(data_dir.glob("huggingface/" + pattern))
  if not found:
    raise _not_prepared(name, data_dir, f"{data_dir}/{pattern}")
  return tfds.builder_from_directory(found[-1].parent)  # the newest version


@contextlib.contextmanager
def _quiet():
  """TFDS logs a warning for each folder it finds empty; our error says it in one line."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    yield
  finally:
    logging.set_verbosity(verbosity)


def open_builder(name: str, data_dir: pathlib.Path):
  """A prepared TFDS builder, or a `DataError` saying how to prepare it."""
  if name.startswith(HF_PREFIX):
    return _hf_builder(name, data_dir)
  with _quiet():
    try:
      builder = tfds.builder(name, data_dir=str(data_dir))
    except tfds.core.registered.DatasetNotFoundError:
      raise DataError(f"TFDS has no dataset {name!r} (see tfds.list_builders("
                      f"with_community_datasets=False))") from None
    if not builder.is_prepared():
      raise _not_prepared(name, data_dir, str(builder.data_path))
  return builder


def check_split(name: str, split: str, available: list[str]) -> None:
  """`split` (`train`, `train[:10%]`, `test+validation`, ...) names only splits that exist."""
  if not available:  # TFDS's test mocks carry no split metadata
    return
  for part in split.split("+"):
    base = part.split("[")[0].strip()
    if base not in available:
      raise DataError(f"dataset {name!r} has no split {base!r} (in {split!r}); its splits are "
                      f"{sorted(available)}")


class RecordSource:
  """A TFDS split read one record at a time; a record that fails to decode is named."""

  def __init__(self, source, description: str):
    self._source, self.description = source, description

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    try:
      return self._source[int(index)]
    except Exception as error:
      raise DataError(f"corrupt record {index} of {self.description}: "
                      f"{type(error).__name__}: {error}") from error


def open_split(name: str, split: str, data_dir: str) -> RecordSource:
  """Random access to one prepared split of a TFDS dataset."""
  root = resolve_data_dir(data_dir)
  builder = open_builder(name, root)
  check_split(name, split, list(builder.info.splits.keys()))
  try:
    source = builder.as_data_source(split=split)
  except NotImplementedError as error:  # prepared as TFRecord, which has no random access
    raise DataError(f"dataset {name!r} in {root} is prepared in a format without random access; "
                    f"prepare it again with {prepare_command(name, root)}") from error
  return RecordSource(source, f"{name}/{split} in {root}")
