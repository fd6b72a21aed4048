"""The user's pages: README.md as a page to read in minutes, every code block in README and docs/
either checked against the file it shows or marked illustrative, the help defaults in step with
the registries they name, and the license and citation files present."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text().splitlines()


def first_line(text: str) -> int:
    """1-based number of the README's first line containing `text`."""
    return next(i for i, line in enumerate(README, 1) if text in line)


def test_readme_is_a_short_page_with_the_essentials_first():
    assert len(README) <= 200
    dated = [line for line in README if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, dated  # measurements with dates live in docs/ and benchmarks/results/
    assert first_line("make demo") <= 30 and first_line("make test") <= 30
    assert first_line("attnprobe run probes/gender.yaml") <= 60 and first_line("In plain words") <= 60
    assert first_line("same-as: probes/minimal.yaml") <= 150 and first_line("import attnprobe as ap") <= 150


def fenced_blocks(path: Path):
    """(marker line before the block, the block's text) for every fenced block of a page."""
    lines = path.read_text().splitlines()
    inside, start, blocks = False, 0, []
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if not inside:
                start = i
            else:
                blocks.append((lines[start - 1] if start else "", "\n".join(lines[start + 1 : i])))
            inside = not inside
    assert not inside, f"{path}: an unclosed code block"
    return blocks


def test_every_code_block_is_checked_or_marked_illustrative():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    count = 0
    for page in pages:
        for marker, body in fenced_blocks(page):
            count += 1
            same = re.fullmatch(r"<!-- same-as: (\S+) -->", marker)
            if same:  # the block shows a shipped file: it must be that file
                assert body + "\n" == (ROOT / same[1]).read_text(), f"{page}: block differs from {same[1]}"
            elif body.startswith("--8<--"):  # included from the file itself at build time
                assert (ROOT / body.split('"')[1]).is_file()
            else:
                assert marker == "<!-- illustrative -->", (
                    f"{page}: a code block without a marker: {body[:60]}"
                )
    assert count > 10


def test_help_defaults_name_what_the_registries_hold():
    from attnprobe.defaults import DTYPE_NAMES, EDIT_KIND_NAMES
    from attnprobe.edits.kinds import KINDS
    from attnprobe.model import DTYPES

    assert EDIT_KIND_NAMES == tuple(KINDS) and DTYPE_NAMES == tuple(DTYPES)


def test_license_citation_and_changelog():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert 'license = "MIT"' in (ROOT / "pyproject.toml").read_text()
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "MIT" and citation["title"]
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert citation["version"] == version and f"## {version}" in (ROOT / "CHANGELOG.md").read_text()


def _room_rows() -> dict[str, str]:
    """docs/extending.md's room table: first cell (the room's or the files' names) -> the row."""
    rows = {}
    for line in (ROOT / "docs" / "extending.md").read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].removeprefix("| ")] = line
    return rows


def test_the_room_table_names_every_module_of_the_tree():
    """Each module is named in its room's row (`stem`), each top-level file in a row of its own."""
    rows, missing = _room_rows(), []
    for path in sorted((ROOT / "attnprobe").rglob("*.py")):
        relative = path.relative_to(ROOT / "attnprobe")
        if len(relative.parts) == 1:
            if not any(f"`{relative.name}`" in first for first in rows):
                missing.append(str(relative))
        elif relative.name != "__init__.py":
            row = rows.get(f"`{relative.parts[0]}/`", "")
            if not any(f"`{relative.stem}{end}" in row for end in ("`", " ", ".")):
                missing.append(str(relative))
    assert missing == [], f"docs/extending.md's room table does not name: {missing}"
    rooms = {p.name for p in (ROOT / "attnprobe").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    named = {first.strip("`/") for first in rows if first.endswith("/`")}
    assert named == rooms, f"rooms in the table but not the tree, or the reverse: {named ^ rooms}"


def test_dated_figures_live_in_the_pages_for_them():
    """A dated measurement belongs to docs/findings.md, performance.md or gpus.md (each keeps its dated
    tables); every other page is a manual that stays true without a date."""
    dated_pages = {"findings.md", "performance.md", "gpus.md"}
    for page in sorted(Path("docs").glob("*.md")):
        dated = [line for line in page.read_text().splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
        assert page.name in dated_pages or not dated, (page.name, dated[:2])
