"""docs/reference/settings.md from layup_jax/defaults.py: every key, its default and its meaning.

  python scripts/settings_reference.py          # writes docs/reference/settings.md
  python scripts/settings_reference.py --check  # exit 1 if the page is not what defaults.py gives

A key's meaning is the comment right above its line in layup_jax/defaults.py (no blank line between)
and the comment beside it; a section's is the comment above `config.<section> = ConfigDict()`.
tests/test_settings_reference.py fails when a key has no meaning or the page is out of date.
"""

import argparse
import ast
import io
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ROOT / "layup_jax" / "defaults.py"
PAGE = ROOT / "docs" / "reference" / "settings.md"
_HEADER = """# Settings

Every key of `layup_jax/defaults.py`, its default and its meaning; generated from that file by
`python scripts/settings_reference.py` (edit the comments there, not this page). Set a key in an
experiment config, or on the command line: `--config.<key>=<value>`. The `tuning` section holds
the runtime's host-side knobs: each default serves every workload measured, and no experiment
config sets one ([performance](../guide/performance.md)).
"""


def _comments(source: str) -> dict[int, str]:
  """{line: comment text} of every comment in `source`."""
  found = {}
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      found[token.start[0]] = token.string.lstrip("#").strip()
  return found


def _dotted(target: ast.expr) -> str | None:
  """`config.a.b` as "a.b"; None for anything else."""
  parts = []
  while isinstance(target, ast.Attribute):
    parts.append(target.attr)
    target = target.value
  if isinstance(target, ast.Name) and target.id == "config" and parts:
    return ".".join(reversed(parts))
  return None


def settings(source: str) -> list[dict]:
  """Each `config.<key> = <default>` of `get_config`, in order: key, default (source text),
  meaning, and whether it opens a section."""
  comments = _comments(source)
  lines = source.splitlines()
  function = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.FunctionDef) and node.name == "get_config")
  rows = []
  for node in function.body:
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
      continue
    key = _dotted(node.targets[0])
    if key is None:
      continue
    above, line = [], node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
      above.insert(0, comments[line])
      line -= 1
    beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    default = ast.get_source_segment(source, node.value)
    section = default.endswith("ConfigDict()")
    rows.append({"key": key, "default": default, "section": section,
                 "meaning": " ".join(above + beside)})
  return rows


def page(source: str) -> str:
  """The page: the run's top-level keys, then each section's keys, in the file's order."""
  rows = settings(source)
  sections = {r["key"]: r["meaning"] for r in rows if r["section"] and r["key"] != "columns"}
  groups: dict[str, list[dict]] = {"": []}
  groups.update({name: [] for name in sections})
  for row in rows:
    head = row["key"].split(".")[0] if "." in row["key"] else ""
    if not (row["section"] and head == "" and row["key"] in sections):
      groups[head].append(row)
  out = [_HEADER]
  for name, members in groups.items():
    out.append(f"\n## `{name}`\n\n{sections[name]}\n" if name else
               "\n## The run\n\nKeys outside any section.\n")
    out.append("| key | default | meaning |\n|---|---|---|")
    for row in members:
      meaning = row["meaning"].replace("|", "\\|")
      out.append(f"| `{row['key']}` | `{row['default']}` | {meaning} |")
  return "\n".join(out) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="exit 1 if docs/reference/settings.md differs from what base.py gives")
  args = parser.parse_args()
  text = page(BASE.read_text())
  if args.check:
    if not PAGE.exists() or PAGE.read_text() != text:
      print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/settings_reference.py",
            file=sys.stderr)
      sys.exit(1)
    return
  PAGE.parent.mkdir(parents=True, exist_ok=True)
  PAGE.write_text(text)
  print(f"wrote {PAGE.relative_to(ROOT)} ({len(settings(BASE.read_text()))} keys and sections)")


if __name__ == "__main__":
  main()
