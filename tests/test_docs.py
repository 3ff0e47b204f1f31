"""The README is a front page and the docs' links hold: size, relative links, anchors (GitHub-style slugs).

What this is not: a check of the pages' content or of external (http) links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12_000
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and HTML comments (headings and links there do not count)."""
    return HTML_COMMENT.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, _ and - kept),
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a Markdown page; repeated headings get -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """Link and image targets in a page's prose that are not URLs (http, https, mailto)."""
    prose = INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_slug_is_githubs():
    assert slug("From Python: `spectr.generate`") == "from-python-spectrgenerate"
    assert slug("Splitting the target over GPUs (`model.device_map`)") == "splitting-the-target-over-gpus-modeldevice_map"
    assert slug("DEFAULT_PACK_BELOW") == "default_pack_below"


def test_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}: move detail to docs/"


DOCS_MAX_BYTES = 90 * 1024  # docs/ is read in an afternoon: at most 90 KB of pages in all
PAGE_MAX_BYTES = 15 * 1024  # and no page over 15 KB (history goes beside its data in benchmarks/results/)


def oversized(folder: Path) -> list[str]:
    """The budget's breaches in a folder of Markdown pages: each page over PAGE_MAX_BYTES, and the total."""
    sizes = {page.name: len(page.read_bytes()) for page in sorted(folder.glob("*.md"))}
    found = [f"{name} is {size} bytes (at most {PAGE_MAX_BYTES})" for name, size in sizes.items()
             if size > PAGE_MAX_BYTES]
    if sum(sizes.values()) > DOCS_MAX_BYTES:
        found.append(f"the pages are {sum(sizes.values())} bytes in all (at most {DOCS_MAX_BYTES})")
    return found


def test_the_docs_fit_their_budget():
    breaches = oversized(ROOT / "docs")
    assert not breaches, "; ".join(breaches) + ": say what is true now, move history to benchmarks/results/"


def test_the_budget_check_names_a_page_and_the_total(tmp_path):
    (tmp_path / "small.md").write_text("x" * 100)
    assert oversized(tmp_path) == []
    (tmp_path / "big.md").write_text("x" * (PAGE_MAX_BYTES + 1))
    assert oversized(tmp_path) == [f"big.md is {PAGE_MAX_BYTES + 1} bytes (at most {PAGE_MAX_BYTES})"]
    for i in range(6):
        (tmp_path / f"page{i}.md").write_text("x" * PAGE_MAX_BYTES)
    assert oversized(tmp_path)[-1].startswith("the pages are ")


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file does not exist, or whose #anchor is no heading of that page."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_negative_control_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n", encoding="utf-8")
    page.write_text("[ok](other.md#a-section) [bad anchor](other.md#nope) [gone](missing.md) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n", encoding="utf-8")
    assert relative_links(page) == ["other.md#a-section", "other.md#nope", "missing.md"]
    assert broken_links(page) == ["other.md#nope: no heading #nope in other.md", "missing.md: no such file"]


def test_readme_links_the_docs():
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README) if t.startswith("docs/")}
    assert len(linked) >= 3, f"README.md links {sorted(linked)} of docs/; at least 3 pages"
    assert all((ROOT / "docs" / name).exists() for name in linked)


# -- docs/configuration.md lists every key of the generation job's config ------------------------------------------

CONF = ROOT / "conf"
GENERATE_GROUPS = ("model", "data", "spectr", "ray", "mlflow")  # conf/generate.yaml's groups (its other keys: top level)


def config_keys(conf: Path = CONF) -> dict[str, set[str]]:
    """The generation job's keys by table row ("model", ..., "top level"): every key of every YAML file of its
    groups (all options, e.g. ray/cluster.yaml too; a nested key as `parent.child`), of conf/generate.yaml
    itself (not `defaults` or `hydra`), and of the typed schema the job checks (`pipeline.generate.config`:
    keys with a default and no YAML line count too). The other jobs' files (benchmark, train_*) are documented
    on their own pages."""
    import dataclasses

    import yaml

    from pipeline.config import DataConfig, MlflowConfig, ModelConfig
    from pipeline.generate.config import GenerateConfig, RayConfig, SpectrConfig

    def flat(mapping: dict, prefix: str = "") -> set[str]:
        keys = set()
        for key, value in mapping.items():
            if key in ("defaults", "hydra"):
                continue
            keys.add(prefix + key)
            if isinstance(value, dict):
                keys |= flat(value, prefix + key + ".")
        return keys

    keys: dict[str, set[str]] = {group: set() for group in GENERATE_GROUPS}
    for group in GENERATE_GROUPS:
        for path in sorted((conf / group).glob("*.yaml")):
            keys[group] |= flat(yaml.safe_load(path.read_text()) or {})
    keys["top level"] = flat(yaml.safe_load((conf / "generate.yaml").read_text()) or {})
    schema = {"model": ModelConfig, "data": DataConfig, "spectr": SpectrConfig, "ray": RayConfig,
              "mlflow": MlflowConfig}
    for group, cls in schema.items():
        keys[group] |= {f.name for f in dataclasses.fields(cls)}
    keys["top level"] |= {f.name for f in dataclasses.fields(GenerateConfig) if f.name not in schema}
    return keys


def table_rows(text: str) -> dict[str, str]:
    """docs/configuration.md's config table: group -> the row's text."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\| `?([a-z ]+?)`? \| (.*) \|$", line)
        if match and match.group(1) in (*GENERATE_GROUPS, "top level"):
            rows[match.group(1)] = match.group(2)
    return rows


def undocumented(text: str, keys: dict[str, set[str]]) -> list[str]:
    """`group.key` of every key that its group's row of the table does not name in backticks (a nested key
    `a.b` counts as named by `a.b` or by `b`)."""
    rows = table_rows(text)
    missing = []
    for group, names in keys.items():
        named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)", rows.get(group, "")))
        for key in sorted(names):
            if key not in named and key.rsplit(".", 1)[-1] not in named:
                missing.append(key if group == "top level" else f"{group}.{key}")
    return missing


def test_the_configuration_page_lists_every_key_of_the_job():
    missing = undocumented((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"), config_keys())
    assert not missing, (f"docs/configuration.md has no line for {len(missing)} key(s) of conf/ and the job's "
                         f"schema: {', '.join(missing)} (name each, as `key` (default): meaning, in its group's row "
                         "of the table under 'The config groups')")


def test_a_key_added_to_conf_without_a_line_is_named(tmp_path):
    """The control: a copy of conf/ with one more key in a group's YAML (and one nested key) fails the check,
    which names exactly those."""
    import shutil

    shutil.copytree(CONF, tmp_path / "conf")
    with open(tmp_path / "conf" / "spectr" / "default.yaml", "a") as f:
        f.write("brand_new_key: 1\nnew_section:\n  inner_key: 2\n")
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    added = set(undocumented(text, config_keys(tmp_path / "conf"))) - set(undocumented(text, config_keys()))
    assert sorted(added) == ["spectr.brand_new_key", "spectr.new_section", "spectr.new_section.inner_key"]


# -- the README's first override example does something under the default method (auto) --------------------------

IGNORED_UNDER_AUTO = {"spectr.num_drafts", "spectr.draft_length"}  # a fixed method's K and L: auto picks its own


def overrides_without_effect(example: str) -> list[str]:
    """The overrides of an `ARGS="..."` example; empty when one of them changes something under method=auto."""
    keys = [word.split("=", 1)[0] for word in example.split()]
    return [] if any(key not in IGNORED_UNDER_AUTO for key in keys) else keys


def test_the_readmes_first_override_changes_something_under_auto():
    example = re.search(r'ARGS="([^"]+)"', README.read_text(encoding="utf-8")).group(1)
    assert "spectr.method" not in example  # the example runs under the default method, auto
    assert overrides_without_effect(example) == [], f"README's first override example {example!r} does nothing " \
        "under spectr.method=auto (num_drafts / draft_length are a fixed method's)"
    assert overrides_without_effect("spectr.num_drafts=8") == ["spectr.num_drafts"]  # the control: the old example
