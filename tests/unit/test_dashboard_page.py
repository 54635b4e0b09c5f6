"""The dashboard as a page of our own (freetoken_infra/dashboard.py): every panel of
dashboards/freetoken.json drawn from a real Prometheus holding the known load
(tests/unit/promfixture.py), untrusted labels escaped, a Prometheus that does not answer a clear
error; and the page rendered by a real headless browser (Debian's chromium), its DOM and its
screenshot checked.

The helpers here (``chromium``, ``screenshot``, ``dump_dom``, ``png_colours``) also make the
docs' picture (bench/dashboard_picture.py).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from freetoken_infra import dashboard
from freetoken_infra.ledger import Prometheus
from tests.unit.promfixture import SPAN_S, _free_port, loaded_prometheus  # noqa: F401

CHROMIUM_PACKAGE = "Debian's 'chromium' package (apt-get install --no-install-recommends chromium: /usr/bin/chromium)"
WINDOW = (1400, 2000)
EVIL = "<script>alert(1)</script>"


# --------------------------------------------------------------------------- reading a page
@dataclass
class PanelSeen:
    kind: str
    title: str = ""
    svgs: int = 0
    paths: int = 0
    tables: int = 0
    nodata: bool = False
    names: list[str] = field(default_factory=list)  # legend items, row labels, table rows


class PageReader(HTMLParser):
    """The panels of a page (ours, or the DOM chromium made of it): per ``section.panel``, its
    title, its SVGs and their paths, its tables, and the texts of its legends and labels."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.panels: dict[str, PanelSeen] = {}
        self.scripts = 0
        self._panel: PanelSeen | None = None
        self._depth = 0
        self._text: list[str] | None = None
        self._into = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "script":
            self.scripts += 1
        if tag == "section" and "panel" in classes:
            self._panel, self._depth = PanelSeen(kind=a.get("data-kind") or ""), 0
            self.panels[a.get("data-panel-id") or ""] = self._panel
        p = self._panel
        if p is None:
            return
        if tag == "section":
            self._depth += 1
        if tag == "svg":
            p.svgs += 1
        elif tag == "path":
            p.paths += 1
        elif tag == "table":
            p.tables += 1
        elif tag == "p" and "nodata" in classes:
            p.nodata = True
        if tag == "h2" or "rowlabel" in classes or "name" in classes:
            self._text, self._into = [], "title" if tag == "h2" else "name"

    def handle_endtag(self, tag: str) -> None:
        p = self._panel
        if p is None:
            return
        if self._text is not None and tag in ("h2", "span", "text", "td"):
            text = "".join(self._text)
            if self._into == "title":
                p.title = text
            else:
                p.names.append(text)
            self._text = None
        if tag == "section":
            self._depth -= 1
            if self._depth == 0:
                self._panel = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


def read_page(text: str) -> PageReader:
    reader = PageReader()
    reader.feed(text)
    reader.close()
    return reader


# --------------------------------------------------------------------------- chromium
def chromium() -> str:
    found = shutil.which("chromium")
    if not found:
        pytest.fail(f"chromium is not installed: this test needs {CHROMIUM_PACKAGE}", pytrace=False)
    return found


def _chromium(page: Path, profile: Path, *extra: str, window: tuple[int, int] = WINDOW) -> str:
    argv = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={profile}",
        f"--window-size={window[0]},{window[1]}",
        *extra,
        page.resolve().as_uri(),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def dump_dom(page: Path, profile: Path) -> str:
    return _chromium(page, profile, "--dump-dom")


def screenshot(page: Path, png: Path, profile: Path, window: tuple[int, int] = WINDOW) -> None:
    _chromium(page, profile, f"--screenshot={png}", window=window)


def png_colours(path: Path, rows: int = 700) -> tuple[int, int, int]:
    """(width, height, distinct colours in the first ``rows`` rows) of an 8-bit RGB or RGBA PNG,
    decoded with the standard library (zlib and PNG's five row filters)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, f"{path}: a PNG form this reader does not know"
    bpp = 3 if colour_type == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    previous = bytearray(stride)
    colours: set[bytes] = set()
    for r in range(min(rows, height)):
        start = r * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        if kind == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif kind == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, previous, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + previous[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = previous[i], previous[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        colours.update(bytes(line[i : i + 3]) for i in range(0, stride, bpp))
        previous = line
    return width, height, len(colours)


# --------------------------------------------------------------------------- the page
@pytest.fixture(scope="module")
def page(loaded_prometheus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "dashboard.html"
    rc = dashboard.main(
        ["--prometheus", loaded_prometheus.url, "--since", f"{SPAN_S}s", "--until", str(loaded_prometheus.end)]
        + ["--out", str(out)]
    )
    assert rc == 0
    return out


def test_every_panel_of_the_json_is_on_the_page_with_a_chart_or_a_table(page):
    text = page.read_text()
    seen = read_page(text)
    assert seen.scripts == 0 and "src=" not in text and "href=" not in text, "the page loads or runs something"
    panels = dashboard.load_panels()
    assert len(panels) == 12
    assert {str(p.id) for p in panels} == set(seen.panels)
    for p in panels:
        got = seen.panels[str(p.id)]
        assert got.title == p.title
        assert not got.nodata, f"{p.title}: no data from the known load"
        if p.instant:
            assert got.tables == 1 and got.names, f"{p.title}: no table"
        else:
            assert got.svgs == 1 and got.paths >= 1, f"{p.title}: no chart ({got})"


def test_the_known_loads_hosts_are_in_the_legends(page):
    seen = read_page(page.read_text()).panels
    by_title = {p.title: p for p in seen.values()}
    assert {"ws1", "ws2"} <= set(by_title["Tokens per second per host"].names)
    assert {"ws1", "ws2", "ws3"} <= set(by_title["Sleeps and wakes: node_exporter answering"].names)
    assert {"ws1: game", "ws2: reboot_pending"} <= set(by_title["Hours yielded by reason (dashboard range)"].names)
    assert {"waiting for any host (freetoken)", "waiting for ws1"} <= set(by_title["Gateway queue"].names)
    # A state timeline's legend is its value mapping.
    assert {"serving", "yielded", "held"} <= set(by_title["Fleet: agent mode per host"].names)


def test_a_host_label_holding_markup_is_escaped_in_every_kind_of_panel(loaded_prometheus):
    evil = (
        f'label_replace(max by (host) (up{{job="freetoken-guard", host=~"$host"}}), "host", "{EVIL}$1", "host", "(.*)")'
    )
    panels = [
        dashboard.Panel(90 + i, f"{kind} {EVIL}", kind, EVIL, "short", {}, (0, i, 24, 8), targets)
        for i, (kind, targets) in enumerate(
            [
                ("timeseries", (dashboard.Target("A", evil, "{{host}}", False),)),
                ("state-timeline", (dashboard.Target("A", evil, "{{host}}", False),)),
                ("bargauge", (dashboard.Target("A", evil, "{{host}}", True),)),
                ("timeseries", (dashboard.Target("A", "freetoken_no_such_metric", "{{host}}", False),)),
            ]
        )
    ]
    window = dashboard.Window(end=loaded_prometheus.end, seconds=SPAN_S, step=60)
    values = dashboard.variables(SPAN_S, 60, 15)
    text = dashboard.build_page(Prometheus(loaded_prometheus.url), window, panels, values, EVIL)
    assert "<script" not in text and "&lt;script&gt;" in text
    seen = read_page(text)
    assert seen.scripts == 0
    for pid in ("90", "91", "92"):
        assert seen.panels[pid].title.endswith(EVIL) and not seen.panels[pid].nodata
        assert f"{EVIL}ws1" in seen.panels[pid].names or pid == "91", seen.panels[pid]
    # The state timeline's legend is its mapping; its host is in the row labels.
    assert f"{EVIL}ws3" in seen.panels["91"].names
    assert seen.panels["93"].nodata and "no data" in text


def test_prometheus_down_is_a_clear_error_and_exit_1(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    out = tmp_path / "page.html"
    assert dashboard.main(["--prometheus", url, "--out", str(out), "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach Prometheus at {url}" in err and "(query: " in err, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_variable_without_a_value_is_an_error_naming_it():
    with pytest.raises(dashboard.DashboardError, match=r"\$cluster"):
        dashboard.substitute('up{cluster="$cluster", host=~"$host"}', {"host": ".*"})
    assert (
        dashboard.substitute('label_replace(up, "a", "$1", "b", "(.*)")', {})
        == 'label_replace(up, "a", "$1", "b", "(.*)")'
    )


# --------------------------------------------------------------------------- a real browser
def test_chromium_renders_every_panel_and_a_screenshot_that_is_not_blank(page, tmp_path):
    dom = dump_dom(page, tmp_path / "profile")
    seen = read_page(dom)
    panels = dashboard.load_panels()
    titles = {p.title for p in seen.panels.values()}
    for p in panels:
        assert p.title in titles, f"chromium's DOM lacks {p.title!r}"
        got = next(s for s in seen.panels.values() if s.title == p.title)
        if not p.instant:
            assert got.svgs == 1 and got.paths >= 1, f"chromium's DOM: {p.title}: no chart"
    png = tmp_path / "dashboard.png"
    screenshot(page, png, tmp_path / "profile")
    width, height, colours = png_colours(png)
    assert (width, height) == WINDOW
    # A blank (or error) page has one or two colours; the charts have dozens with anti-aliasing.
    assert colours > 50, f"the screenshot has {colours} colours: blank?"
