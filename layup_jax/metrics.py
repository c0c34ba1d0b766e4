"""Run records a user can plot: `metrics.jsonl` (one JSON object per line) and `summary.json`."""

import json
import math
import pathlib
from typing import Any


def _clean(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return None  # JSON has no NaN; null reads back cleanly in pandas and jq
  return value


class MetricsWriter:
  """Appends records to `metrics.jsonl`. A fresh run (`keep_through_step=None`) starts the file
  anew; a resumed one keeps the records up to its checkpoint's step and drops the later ones,
  which it will write again."""

  def __init__(self, workdir: pathlib.Path, keep_through_step: int | None = None):
    self.workdir = workdir
    self._path = workdir / "metrics.jsonl"
    kept = []
    if keep_through_step is not None and self._path.exists():
      kept = [r for r in read_metrics(workdir) if r.get("step", 0) <= keep_through_step]
    with self._path.open("w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    self._file = self._path.open("a")
    self.records: list[dict[str, Any]] = kept  # every record of the run, as written

  def write(self, record: dict[str, Any]) -> None:
    record = {k: _clean(v) for k, v in record.items()}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    self.records.append(record)

  def write_summary(self, summary: dict[str, Any]) -> None:
    text = json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2)
    (self.workdir / "summary.json").write_text(text + "\n")

  def close(self) -> None:
    self._file.close()


def read_metrics(workdir: pathlib.Path) -> list[dict[str, Any]]:
  with (pathlib.Path(workdir) / "metrics.jsonl").open() as f:
    return [json.loads(line) for line in f if line.strip()]
