"""The settings reference is generated from layup_jax/defaults.py: every key has a line that says
what it means, and the page in docs/ is what the file gives today."""

import importlib.util
import pathlib

from layup_jax import defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("settings_reference",
                                               ROOT / "scripts" / "settings_reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


def _keys(config, prefix=""):
  for key, value in config.items():
    if hasattr(value, "items") and key != "columns":
      yield from _keys(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def test_every_key_of_the_config_has_a_line_with_its_meaning():
  rows = {row["key"]: row for row in reference.settings(reference.BASE.read_text())
          if not row["section"] or row["key"] == "columns"}
  keys = list(_keys(defaults.get_config()))
  assert sorted(rows) == sorted(keys)
  assert [key for key in keys if not rows[key]["meaning"]] == []
  page = reference.PAGE.read_text()
  assert [key for key in keys if f"| `{key}` |" not in page] == []


def test_a_key_without_a_comment_is_found(tmp_path):
  source = reference.BASE.read_text().replace(
      "  config.seed = 0  # seeds parameters, data order, peer choice and dropout",
      "  config.seed = 0")
  rows = {row["key"]: row for row in reference.settings(source)}
  assert rows["seed"]["meaning"] == ""


def test_the_page_in_docs_is_what_configs_base_gives():
  assert reference.PAGE.read_text() == reference.page(reference.BASE.read_text()), (
      "docs/reference/settings.md is out of date: run python scripts/settings_reference.py")
