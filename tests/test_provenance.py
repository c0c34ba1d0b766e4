"""A run names the code it came from: the commit, and whether Python files differed from it."""

import pathlib
import subprocess

from layup_jax.measure import provenance
from layup_jax.run import runner

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _git(where, *args):
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                        cwd=where, capture_output=True, text=True, check=True).stdout.strip()


def test_the_code_version_is_the_commit_and_dirty_only_when_python_files_changed(tmp_path):
  (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
  assert provenance.code_version(tmp_path) is None  # a source tree outside git
  (tmp_path / "code.py").write_text("A = 1\n")
  (tmp_path / "notes.md").write_text("figures\n")
  _git(tmp_path, "init", "-q")
  _git(tmp_path, "add", ".")
  _git(tmp_path, "commit", "-q", "-m", "first")
  commit = _git(tmp_path, "rev-parse", "--short", "HEAD")
  assert provenance.code_version(tmp_path) == commit
  (tmp_path / "notes.md").write_text("new figures\n")  # results written beside the code
  assert provenance.code_version(tmp_path) == commit
  (tmp_path / "code.py").write_text("A = 2\n")
  assert provenance.code_version(tmp_path) == f"{commit}-dirty"


def test_a_source_tree_exported_inside_another_checkout_has_no_version(tmp_path):
  """An older tree measured from a folder of this checkout is not labelled with this commit."""
  (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
  _git(tmp_path, "init", "-q")
  _git(tmp_path, "add", ".")
  _git(tmp_path, "commit", "-q", "-m", "first")
  exported = tmp_path / ".before"
  exported.mkdir()
  (exported / "pyproject.toml").write_text("[project]\nname = 'x'\n")
  assert provenance.code_version(tmp_path) == _git(tmp_path, "rev-parse", "--short", "HEAD")
  assert provenance.code_version(exported) is None


def test_an_installed_copy_without_its_source_tree_has_no_version(tmp_path):
  _git(tmp_path, "init", "-q")  # no pyproject.toml: a copy in site-packages
  assert provenance.code_version(tmp_path) is None


def test_a_run_is_labelled_with_the_code_it_started_with(tiny_config, tmp_path, monkeypatch):
  """A commit made while a run trains does not relabel the run."""
  version = {"now": "start"}
  monkeypatch.setattr(provenance, "code_version", lambda: version["now"])

  def commit_meanwhile() -> bool:  # polled while the run trains
    version["now"] = "later"
    return False

  tiny_config.num_steps, tiny_config.checkpoint.enabled = 4, False
  summary = runner.run(tiny_config, tmp_path, should_stop=commit_meanwhile)
  assert version["now"] == "later"
  assert summary["code_version"] == "start"


def test_the_runs_code_version_is_this_checkouts_commit():
  """Without arguments, the checkout the package runs from (its tests run from one)."""
  top = _git(ROOT, "rev-parse", "--short", "HEAD")
  assert provenance.code_version() in (top, f"{top}-dirty")
