"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is the repository's README.md and its
architecture page ARCHITECTURE.md, read from the repository root at build time. Each text has one
source: the README stays the repository's front page (what GitHub shows), the pages under docs/
are written for GitHub too, and this hook turns the links each of them writes relative to its own
place in the repository into the site's (`docs/gateway.md` from the README is `gateway.md` on the
site, `../README.md#settings` from a page is `index.md#settings`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]

# site page -> the repository file it is made from
GENERATED = {"index.md": "README.md", "architecture.md": "ARCHITECTURE.md"}
SITE_NAME = {repo: site for site, repo in GENERATED.items()}

# a Markdown link's target: path, optional #anchor
LINK = re.compile(r"\]\((?P<path>[^)\s#]*)(?P<anchor>#[^)\s]*)?\)")


def on_files(files: Files, config: Any) -> Files:
    for site, repo in GENERATED.items():
        files.append(File.generated(config, site, abs_src_path=str(ROOT / repo)))
    return files


def site_path(path: str, at_root: bool) -> str:
    """A link as written in the repository, as the site reads it."""
    if at_root:  # README.md, ARCHITECTURE.md: at the repository root
        if path.startswith("docs/"):
            return path.removeprefix("docs/")
        return SITE_NAME.get(path, path)
    if path.startswith("../"):  # a page under docs/ linking to the root
        return SITE_NAME.get(path.removeprefix("../"), path)
    return path


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    at_root = page.file.src_uri in GENERATED

    def fix(m: re.Match[str]) -> str:
        return f"]({site_path(m['path'], at_root)}{m['anchor'] or ''})"

    return LINK.sub(fix, markdown)
