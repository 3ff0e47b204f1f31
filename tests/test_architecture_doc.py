"""docs/architecture.md is checked against the code: its module map names every module under spectr/ and
pipeline/, its row schema every column a job writes. Adding a module or a column without a line fails here."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.generate.output import output_schema
from pipeline.row_columns import OUTPUT_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def section(text: str, heading: str) -> str:
    """The text of the `## heading` section (up to the next `## `)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no '## {heading}' section"
    return match.group(1)


def modules() -> list[tuple[str, str]]:
    """(package path, module name) of every module under spectr/ and pipeline/ (packages' __init__ aside)."""
    found = []
    for top in ("spectr", "pipeline"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name != "__init__.py":
                found.append((path.parent.relative_to(ROOT).as_posix(), path.stem))
    return found


def unmapped(text: str, wanted: list[tuple[str, str]]) -> list[str]:
    """The modules the page's module map does not name: each must appear in backticks in the subsection whose
    heading names its package (`spectr/planner/`), and where that subsection has a row for the package (its
    first cell `ray_data`), in that row."""
    subsections = re.split(r"^### ", section(text, "Module map"), flags=re.M)[1:]
    missing = []
    for package, name in wanted:
        place = next((s for s in subsections if f"`{package}/`" in s.split("\n", 1)[0]), None)
        if place is None:
            missing.append(f"{package}/{name}.py (no subsection for `{package}/`)")
            continue
        row = re.search(rf"^\| `{re.escape(package.rsplit('/', 1)[-1])}` \|.*$", place, re.M)
        if f"`{name}`" not in (row.group(0) if row else place):
            missing.append(f"{package}/{name}.py")
    return missing


def columns() -> list[str]:
    """Every column a row can have: the schema with every option on, and the names kept columns may not take."""
    schema = output_schema("str", logprobs=5)
    return list(dict.fromkeys([*schema.names, *OUTPUT_COLUMNS]))


def undocumented_columns(text: str, wanted: list[str]) -> list[str]:
    rows = section(text, "Row schema")
    return [c for c in wanted if f"`{c}`" not in rows]


def test_the_module_map_names_every_module():
    missing = unmapped(PAGE.read_text(encoding="utf-8"), modules())
    assert not missing, f"docs/architecture.md's module map lacks {len(missing)} module(s): {missing}"


def test_the_row_schema_names_every_output_column():
    missing = undocumented_columns(PAGE.read_text(encoding="utf-8"), columns())
    assert not missing, f"docs/architecture.md's row schema lacks column(s): {missing}"


def test_a_missing_module_or_column_is_named():
    """The negative controls: a module the page does not list, a column removed from the page."""
    text = PAGE.read_text(encoding="utf-8")
    assert unmapped(text, [("spectr", "no_such_module")]) == ["spectr/no_such_module.py"]
    assert unmapped(text, [("pipeline/ray_data", "job")]) == ["pipeline/ray_data/job.py"]  # benchmark's row has it
    assert unmapped(text, [("pipeline/nowhere", "x")]) == ["pipeline/nowhere/x.py (no subsection for `pipeline/nowhere/`)"]
    without = text.replace("`stop_token_id`", "stop token id")
    assert undocumented_columns(without, columns()) == ["stop_token_id"]
    assert "completion_top_logprobs" in columns() and "prompt_logprobs" in columns()  # every option on
