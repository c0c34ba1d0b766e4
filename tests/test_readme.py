"""The README stays true: its test command is CI's, and its model snippet runs as written."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
  first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1).strip().splitlines()
  assert len(first_block) == 2
  assert "python -m layup_jax.train --config configs/digits.py" in first_block[0]
  assert first_block[1].endswith("python -m pytest -q -n 2 tests")
  assert "grep -m1 -E '^python3 -m venv .*pytest' README.md" in (ROOT / ".ci/run").read_text()


def _snippet_accuracy(heading: str, workdir: str, tmp_path) -> float:
  """Runs the README section's Python snippet as written (its workdir moved to tmp_path) and
  returns the test accuracy it prints."""
  section = README.split(heading, 1)[1]
  snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
  snippet = snippet.replace(repr(workdir).replace("'", '"'), repr(str(tmp_path)))
  result = subprocess.run([sys.executable, "-c", snippet], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1))


def test_bring_your_own_model_snippet_trains(tmp_path):
  assert _snippet_accuracy("## Bring your own model", "runs/my_mlp", tmp_path) > 0.9


def test_bring_your_own_dataset_snippet_trains(tmp_path):
  assert _snippet_accuracy("## Bring your own dataset", "runs/stripes", tmp_path) > 0.9
