"""The README stays true: its test command is CI's; the guide's own-model snippet runs as written."""

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


def test_the_guides_own_model_and_data_snippet_trains_as_written(tmp_path):
  """docs/guide/your_model.md's first snippet (a model and a dataset of one's own, registered
  and trained under LayUp), run as written with its workdir moved to tmp_path."""
  guide = (ROOT / "docs" / "guide" / "your_model.md").read_text()
  snippet = re.search(r"```python\n(.*?)```", guide, re.DOTALL).group(1)
  assert '"runs/my_mlp"' in snippet
  snippet = snippet.replace('"runs/my_mlp"', repr(str(tmp_path)))
  result = subprocess.run([sys.executable, "-c", snippet], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1)) > 0.9
