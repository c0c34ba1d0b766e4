"""Run records a user can plot: `metrics.jsonl` (one JSON object per line), `summary.json`, and
the same records as TensorBoard scalars (event files in `tensorboard/`, through tensorboardX:
no TensorFlow needed), and `progress/process_<k>.jsonl`, each process's iterations over time."""

import json
import math
import pathlib
import time
from typing import Any

import jax


def _clean(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return None  # JSON has no NaN; null reads back cleanly in pandas and jq
  return value


def scalars(record: dict[str, Any]) -> dict[str, float]:
  """A record's numbers as TensorBoard tags `<split>/<key>` (a list's entries as
  `<split>/<key>/<index>`: per device or per stage); null and non-numeric values left out."""
  split = record.get("split", "run")
  out = {}
  for key, value in record.items():
    if key in ("step", "split"):
      continue
    values = enumerate(value) if isinstance(value, list) else [(None, value)]
    for index, item in values:
      if isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item):
        out[f"{split}/{key}" + ("" if index is None else f"/{index}")] = float(item)
  return out


class MetricsWriter:
  """Appends records to `metrics.jsonl`. A fresh run (`keep_through_step=None`) starts the file
  anew; a resumed one keeps the records up to its checkpoint's step and drops the later ones,
  which it will write again. With `tensorboard`, each record's `scalars` also go to event files
  in `workdir/tensorboard`; a resumed run hides the events after its checkpoint's step there
  too (tensorboardX's `purge_step`)."""

  def __init__(self, workdir: pathlib.Path, keep_through_step: int | None = None,
               tensorboard: bool = False, files: bool = True):
    """`files=False` keeps the records in memory only (a multi-process run's processes > 0)."""
    self.workdir = workdir
    self._events, self._file = None, None
    self.records: list[dict[str, Any]] = []  # every record of the run, as written
    self.files = files
    if not files:
      return
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported here: only runs that log events need it

      self._events = SummaryWriter(
          str(workdir / "tensorboard"),
          purge_step=None if keep_through_step is None else keep_through_step + 1)
    self._path = workdir / "metrics.jsonl"
    kept = []
    if keep_through_step is not None and self._path.exists():
      kept = [r for r in read_metrics(workdir) if r.get("step", 0) <= keep_through_step]
    with self._path.open("w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    self._file = self._path.open("a")
    self.records = kept

  def write(self, record: dict[str, Any]) -> None:
    record = {k: _clean(v) for k, v in record.items()}
    self.records.append(record)
    if self._file is None:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._events is not None and "step" in record:
      for tag, value in scalars(record).items():
        self._events.add_scalar(tag, value, record["step"])
      self._events.flush()

  def write_summary(self, summary: dict[str, Any]) -> None:
    if self._file is None:
      return
    text = json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2)
    (self.workdir / "summary.json").write_text(text + "\n")

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._events is not None:
      self._events.close()


def read_metrics(workdir: pathlib.Path) -> list[dict[str, Any]]:
  """The records of `metrics.jsonl`; a last line cut short (its writer was killed mid-line) is
  left out."""
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines(keepends=True)
  if lines and not lines[-1].endswith("\n"):
    lines = lines[:-1]
  return [json.loads(line) for line in lines if line.strip()]


class ProgressLog:
  """Appends `{"t", "iterations", "step"}` to WORKDIR/progress/process_<k>.jsonl at most every
  `every_s` seconds (each process its own file: the workdir is shared)."""

  def __init__(self, workdir: pathlib.Path, every_s: float):
    directory = workdir / "progress"
    directory.mkdir(parents=True, exist_ok=True)
    self._file = (directory / f"process_{jax.process_index()}.jsonl").open("a")
    self._every_s, self._last = every_s, 0.0

  def write(self, iterations: int, step: int) -> None:
    now = time.time()
    if now - self._last >= self._every_s:
      self._last = now
      self._file.write(json.dumps({"t": now, "iterations": iterations, "step": step}) + "\n")
      self._file.flush()

  def close(self) -> None:
    self._file.close()
