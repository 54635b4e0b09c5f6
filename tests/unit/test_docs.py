"""The repository explains itself: README.md is a short front page that opens with the two
commands, every relative link in README.md, ARCHITECTURE.md and docs/ reaches a file (and a
heading, for a link into a Markdown file), and every page under docs/ is in the site's nav
(mkdocs.yml). `mkdocs build --strict` checks the built site the same way; these checks need no
build and name the file and link that broke."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify as mkdocs_slugify

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 500

# The two commands the README opens with, exactly: the main job on a fresh WSL distro
# (tests/unit/test_doctor_here.py runs it) and the whole test suite (what CI runs).
MAIN_COMMAND = (
    "S=$(command -v sudo); dpkg -s python3-venv >/dev/null 2>&1 || { $S apt-get update -qq && "
    "$S apt-get install -y -qq python3-venv; } && python3 -m venv .venv && .venv/bin/pip install -q -e . "
    "&& .venv/bin/pyinfra inventories/home.py deploys/freetoken.py"
)
TEST_COMMAND = "bash tests/run.sh"

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).*?\1", re.S)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and code spans: where links are links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def heading_text(raw: str) -> str:
    """A heading as the reader sees it: links by their text, no emphasis or code marks."""
    raw = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", "", raw)


def github_slug(text: str) -> str:
    # GitHub's: lower case, punctuation dropped (word characters, spaces and hyphens kept),
    # each space a hyphen.
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """The anchors of a Markdown file's headings, as GitHub makes them and as MkDocs does
    (Python-Markdown's toc slugify); a repeated heading gets GitHub's `-1` and MkDocs' `_1`."""
    github: set[str] = set()
    mkdocs: set[str] = set()
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for m in HEADING.finditer(text):
        title = heading_text(m.group(2))
        for made, slug, sep in ((github, github_slug(title), "-"), (mkdocs, mkdocs_slugify(title, "-"), "_")):
            unique, n = slug, 0
            while unique in made:
                n += 1
                unique = f"{slug}{sep}{n}"
            made.add(unique)
    return github, mkdocs


def relative_links(path: Path) -> list[str]:
    targets = [m["target"] for m in LINK.finditer(prose(path.read_text(encoding="utf-8")))]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: ({target})"
        if not dest.exists():
            broken.append(f"{where}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if anchor and dest.suffix == ".md":
            github, mkdocs = anchors(dest)
            if anchor not in github or anchor not in mkdocs:
                on = [name for name, made in (("GitHub", github), ("the site", mkdocs)) if anchor not in made]
                broken.append(f"{where}: no heading with anchor #{anchor} ({' and '.join(on)})")
    return broken


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def site_hook():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_short_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference text to a page under docs/"
    )


def test_the_readme_opens_with_the_main_job_and_the_test_suite():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    before_first_section = text.split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", before_first_section, re.M | re.S)
    assert [b.strip() for b in blocks] == [MAIN_COMMAND, TEST_COMMAND], (
        "README.md must open (before its first ## section) with exactly two ```sh blocks: "
        f"the main job and `{TEST_COMMAND}`; found {blocks}"
    )


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(path):
    assert broken_links(path) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    # The check above is no formality: a page with a link to a missing file and one to a
    # missing heading is reported, naming both; a good link is not.
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# A\n\n## The model: resumable, verified\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#the-model-resumable-verified) [gone](nowhere.md) [bad](a.md#no-such-heading) "
        "`[code](not-a-link.md)` [web](https://example.org/x.md)\n"
    )
    broken = broken_links(page)
    assert len(broken) == 2, broken
    assert "nowhere.md" in broken[0] and "#no-such-heading" in broken[1]


def test_the_readme_links_into_docs_relatively():
    # Absolute links to docs/ would show another copy (or none) on a fork or in the site.
    text = prose((ROOT / "README.md").read_text(encoding="utf-8"))
    absolute = [m["target"] for m in LINK.finditer(text) if "://" in m["target"] and "/docs/" in m["target"]]
    assert absolute == []


def test_every_page_under_docs_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    listed = nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if p not in listed]
    assert not missing, f"pages under docs/ missing from mkdocs.yml's nav: {missing}"
    generated = site_hook().GENERATED
    unknown = [p for p in listed if p not in pages and p not in generated]
    assert not unknown, f"mkdocs.yml's nav lists pages that do not exist: {unknown}"
    assert {generated[p] for p in listed if p in generated} == {"README.md", "ARCHITECTURE.md"}


@pytest.mark.parametrize(
    "at_root, written, on_site",
    [
        (True, "docs/gateway.md", "gateway.md"),
        (True, "ARCHITECTURE.md", "architecture.md"),
        (False, "../README.md", "index.md"),
        (False, "../ARCHITECTURE.md", "architecture.md"),
        (False, "security.md", "security.md"),
    ],
)
def test_the_site_reads_each_link_as_github_does(at_root, written, on_site):
    assert site_hook().site_path(written, at_root) == on_site


TRACKER_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.I)


def test_no_tracker_numbers_in_the_docs():
    # A reader has no tracker to look "issue 22" up in: say what the thing is.
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in markdown_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TRACKER_NUMBER.search(line)
    ]
    assert found == []


def test_no_tracker_numbers_in_the_code_either():
    # Other projects' issues (microsoft/WSL#7001) are sources and stay; this file names the pattern.
    code = [
        path
        for top in ("freetoken_infra", "facts", "operations", "deploys", "bench", "tests", "group_data", "inventories")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.name != "test_docs.py"
    ]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in code
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TRACKER_NUMBER.search(line)
    ]
    assert len(code) > 100 and found == []
