"""docs/ARCHITECTURE.md's module map names every module of every package folder, and only
modules that exist, so a file added, moved or deleted without its line in the map fails here.

A map that drifts is worse than none: the first thing a newcomer reads is wrong. The folders
are pyproject's package-dir folders plus `bench/scripts/` and `tests/`; package folders list one
file per line, tests by groups (a name without a slash matches a file's name in any subfolder,
so globs such as `test_e2e*.py` cover a group). Pure text, no processes.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
MAPPED_SUFFIXES = {".py", ".c", ".h"}
NOT_PACKAGES = ["bench/scripts", "tests"]  # mapped like packages, but pyproject does not list them
MAX_LINE = 160


def _section(title: str) -> list[str]:
    lines = MAP.read_text().splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _module_map() -> dict[str, list[list[str]]]:
    """Folder of each `### folder/` heading -> the names each of its bullets lists (before the dash)."""
    folders: dict[str, list[list[str]]] = {}
    folder = None
    for line in _section("Module map"):
        if line.startswith("### "):
            folder = line[4:].split()[0].rstrip("/")
            folders[folder] = []
        elif line.startswith("- ") and folder is not None:
            names = re.findall(r"`([^`]+)`", line.split(" — ")[0])
            folders[folder].append(names)
    return folders


def _mapped_folders() -> list[str]:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted(set(package_dir.values()) | set(NOT_PACKAGES))


def _files_in(folder: str) -> set[str]:
    """The mapped kinds of file directly in a package folder (subpackages are their own folders)."""
    return {p.name for p in (ROOT / folder).iterdir() if p.suffix in MAPPED_SUFFIXES and p.is_file()}


def _test_files() -> set[str]:
    tests = ROOT / "tests"
    return {p.relative_to(tests).as_posix() for p in tests.rglob("*.py")
            if "__pycache__" not in p.parts and not any(part.startswith(".") for part in p.parts)}


def _matches(pattern: str, path: str) -> bool:
    return fnmatch.fnmatch(path if "/" in pattern else path.rsplit("/", 1)[-1], pattern)


def test_every_package_folder_has_a_section_of_the_module_map():
    missing = [f for f in _mapped_folders() if f not in _module_map()]
    assert not missing, f"docs/ARCHITECTURE.md's module map has no `### folder/` section for {missing}"


def test_every_section_of_the_module_map_is_a_folder_that_exists():
    gone = [f for f in _module_map() if not (ROOT / f).is_dir()]
    assert not gone, f"docs/ARCHITECTURE.md maps folders that no longer exist: {gone}"


def test_every_module_of_a_package_folder_has_its_line_in_the_map():
    sections = _module_map()
    missing = [f"{folder}/{name}" for folder in _mapped_folders() if folder != "tests"
               for name in sorted(_files_in(folder))
               if [name] not in sections.get(folder, [])]
    assert not missing, f"add a line for each to docs/ARCHITECTURE.md's module map: {missing}"


def test_every_file_the_map_lists_still_exists():
    gone = [f"{folder}/{name}" for folder, bullets in _module_map().items() if folder != "tests"
            for names in bullets for name in names if not (ROOT / folder / name).is_file()]
    assert not gone, f"docs/ARCHITECTURE.md's module map lists files that no longer exist: {gone}"


def test_a_package_folder_lists_one_file_per_line():
    crowded = [names for folder, bullets in _module_map().items() if folder != "tests"
               for names in bullets if len(names) != 1]
    assert not crowded, f"one file per line in the module map, not {crowded}"


def test_every_test_module_belongs_to_a_listed_group():
    patterns = [p for names in _module_map().get("tests", []) for p in names]
    unlisted = sorted(f for f in _test_files() if not any(_matches(p, f) for p in patterns))
    assert not unlisted, f"add these to a group under `### tests/` in docs/ARCHITECTURE.md: {unlisted}"


def test_every_test_group_still_matches_a_file():
    files = _test_files() | {p.relative_to(ROOT / "tests").as_posix() for p in (ROOT / "tests").rglob("*.sh")}
    stale = [p for names in _module_map().get("tests", []) for p in names
             if not any(_matches(p, f) for f in files)]
    assert not stale, f"docs/ARCHITECTURE.md's tests map names files that no longer exist: {stale}"


def test_module_map_lines_stay_short():
    long = [line[:60] + "…" for line in _section("Module map") if len(line) > MAX_LINE]
    assert not long, f"module map lines over {MAX_LINE} characters (the why goes in the module's docstring): {long}"


def test_one_request_takes_at_most_a_dozen_steps_each_naming_a_file_that_exists():
    steps = [line for line in _section("One request, from HTTP to sampled token") if re.match(r"\d+\. ", line)]
    assert 0 < len(steps) <= 12
    mapped = [p.relative_to(ROOT).as_posix() for folder in _mapped_folders() for p in (ROOT / folder).glob("*.py")]
    for step in steps:
        named = re.findall(r"`([^`]+\.py)`", step)
        assert named, f"a step names no file: {step}"
        gone = [n for n in named if not any(p == n or p.endswith("/" + n) for p in mapped)]
        assert not gone, f"a step of the request path names files that do not exist: {gone}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _anchors(path: Path) -> dict[str, str]:
    """Each heading of a markdown file -> its anchor (a repeated one gets -1, -2, ... as GitHub numbers them)."""
    anchors, seen, fence = {}, {}, False
    for line in path.read_text().splitlines():
        fence ^= line.startswith("```")
        if fence or not re.match(r"#{1,6} ", line):
            continue
        text = line.lstrip("#").strip()
        n = seen.get(_slug(text), 0)
        seen[_slug(text)] = n + 1
        anchors.setdefault(text, _slug(text) + (f"-{n}" if n else ""))
    return anchors


def test_every_measurement_docs_decisions_points_to_is_a_section_of_its_dated_log():
    """`→ [DATE "heading"](../bench/log/DATE.md#anchor)`: the log exists, a heading of it starts with the quoted
    text, and the anchor is that heading's, so the link lands on it."""
    text = (ROOT / "docs" / "DECISIONS.md").read_text()
    assert "→ RESULTS" not in text, "docs/DECISIONS.md points to bench/RESULTS.md sections; they live in bench/log/"
    links = re.findall(r'\[(\d{4}-\d\d-\d\d) "([^"]+)"\]\(\.\./bench/log/([^)#]+)\.md#([^)\s]+)\)', text)
    assert len(links) >= text.count("→ ["), "an arrow of docs/DECISIONS.md points to no dated log"
    wrong = []
    for date, quoted, log, anchor in links:
        path = ROOT / "bench" / "log" / f"{log}.md"
        anchors = _anchors(path) if path.is_file() and date == log else {}
        if not any(h.startswith(quoted) and a == anchor for h, a in anchors.items()):
            wrong.append(f'{date} "{quoted}" #{anchor}')
    assert not wrong, f"docs/DECISIONS.md points to no heading of its bench/log/ file: {wrong}"
