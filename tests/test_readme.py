"""The README stays true: its test command is CI's; the guide's API example runs as written."""

import pathlib
import re
import subprocess
import sys

from layup_jax.run.records import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
  first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1).strip().splitlines()
  assert len(first_block) == 2
  assert "python -m layup_jax.train --config configs/digits.py" in first_block[0]
  assert first_block[1].endswith("python -m pytest -q -n 2 tests")
  assert "grep -m1 -E '^python3 -m venv .*pytest' README.md" in (ROOT / ".ci/run").read_text()


def test_the_guides_api_example_trains_a_linen_and_an_nnx_model_with_a_metric_of_its_own(
    tmp_path):
  """docs/guide/your_model.md's first snippet, run as written with its runs moved to tmp_path:
  a model and a dataset of one's own, registered and trained through `layup_jax.train` with
  linen stages and with NNX stages, a test metric of one's own in each run's records, and the
  exported model reading back the first run's accuracy."""
  guide = (ROOT / "docs" / "guide" / "your_model.md").read_text()
  snippet = re.search(r"```python\n(.*?)```", guide, re.DOTALL).group(1)
  assert snippet.count('RUNS = "runs"') == 1
  snippet = snippet.replace('RUNS = "runs"', f"RUNS = {str(tmp_path)!r}")
  result = subprocess.run([sys.executable, "-c", snippet], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  accuracies = dict(re.findall(r"(\w+): test accuracy (\d\.\d+)", result.stdout))
  assert set(accuracies) == {"my_mlp", "my_nnx_mlp", "model"}  # "exported model: ..."
  assert all(float(a) > 0.9 for a in accuracies.values())
  assert accuracies["model"] == accuracies["my_mlp"]
  for name in ("my_mlp", "my_nnx_mlp"):
    tests = [r for r in read_metrics(tmp_path / name) if r["split"] == "test"]
    assert len(tests) >= 2 and all(0.0 <= r["brier_score"] <= 2.0 for r in tests)
    assert tests[-1]["brier_score"] < tests[0]["brier_score"]  # it measures the training


_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def test_the_readme_and_the_guide_say_what_holds_now_without_a_commit_or_a_date():
  """Figures live on the results page or in a record, linked once: no commit hash (7-40 hex
  characters holding a letter and a digit) and no date in README.md or docs/guide/, the README
  at most 160 lines, the guide, concepts and reference at most 1,500 lines together."""
  pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
  found = {str(p.relative_to(ROOT)): _HASH.findall(p.read_text()) + _DATE.findall(p.read_text())
           for p in pages}
  assert {page: hits for page, hits in found.items() if hits} == {}
  assert len(README.splitlines()) <= 160
  docs = [p for part in ("guide", "concepts", "reference")
          for p in (ROOT / "docs" / part).glob("*.md")]
  assert sum(len(p.read_text().splitlines()) for p in docs) <= 1500
  assert _HASH.findall("at 043c248 on") == ["043c248"] and _DATE.findall("on 2026-12-07")


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
  """A link to a file of the repository (and to a heading of it) in README.md, docs/guide,
  docs/concepts, docs/reference and docs/index.md points at something that exists."""
  def anchors(path: pathlib.Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}
    return slugs | set(re.findall(r'<a (?:name|id)="([^"]+)"', path.read_text()))

  pages = [ROOT / "README.md", ROOT / "docs" / "index.md",
           *[p for part in ("guide", "concepts", "reference")
             for p in sorted((ROOT / "docs" / part).glob("*.md"))]]
  broken = []
  for page in pages:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      file, _, anchor = target.partition("#")
      path = (page.parent / file).resolve()
      if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
        broken.append(f"{page.relative_to(ROOT)}: {target}")
  assert broken == []
