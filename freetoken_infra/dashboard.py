"""The fleet's dashboard without Grafana: the panels of ``dashboards/freetoken.json`` read from
the gateway's Prometheus and written as one static HTML page (docs/ledger.md).

    python -m freetoken_infra.dashboard --prometheus http://gateway:9090 [--since 6h] [--out PAGE]

The page is made from the same JSON Grafana imports: each panel's title, description, unit,
value mappings and targets (``expr``, ``legendFormat``). Grafana's variables are given the
values Grafana would give them (``$host``: the ``--host`` names or all; ``$__range``: the
window; ``$__interval``: the step; ``$__rate_interval``: the larger of step + scrape interval
and four scrape intervals) and each target runs as a range query over the window, or as an
instant query at its end where the target says ``instant`` (a small table). A time series panel
is an inline SVG line chart, a state timeline an SVG band per series coloured by its mapping.

The page holds no JavaScript and loads nothing: it can be mailed, archived, opened from a file.
Everything Prometheus answers is untrusted: numbers are checked (a value that is not a number
is an error; NaN and infinities are gaps, as Grafana draws them), a series' labels and every
text made from them are HTML-escaped (and stripped of control characters), the series per
target are capped. The HTTP client, the bearer token (``--token-file`` or
``$FREETOKEN_PROMETHEUS_TOKEN``, never the command line) and the errors (naming the URL and the
query, exit status 1) are the ledger's.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from freetoken_infra.core.text import printable
from freetoken_infra.ledger import (
    LedgerError,
    Prometheus,
    _labels,
    _token,
    _ts,
    parse_duration,
    prometheus_arguments,
)

PROG = "python -m freetoken_infra.dashboard"
DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "freetoken.json"
# Points per series on the chart: about one per two pixels of a full-width panel.
POINTS = 400
# Steps a window is divided into, as Grafana rounds $__interval.
NICE_STEPS = (15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
# A target answering more series than this is cut (and the page says so): an answer we did not
# ask for must not make a page no browser opens.
MAX_SERIES = 60
# Grafana's palette (classic), for series in order.
PALETTE = ("#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0", "#508642")
# Grafana's named colours that the dashboard's value mappings use.
COLOURS = {
    "green": "#56a64b",
    "dark-red": "#a3232f",
    "red": "#e02f44",
    "blue": "#3274d9",
    "orange": "#ff780a",
    "purple": "#a352cc",
    "yellow": "#f2cc0c",
}
UNMAPPED = "#8e8e8e"
# ``$1`` (a label_replace's group) is not a variable: names start with a letter or ``_``.
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$([A-Za-z_]\w*)")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class DashboardError(LedgerError):
    """A panel the page cannot be made from, or an answer it cannot draw."""


# --------------------------------------------------------------------------- the panels
def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with each Grafana variable (``$name`` or ``${name}``) replaced by its value; a
    variable without a value is an error naming it (a query with a ``$`` left would be refused
    by Prometheus, or worse, mean something else)."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise DashboardError(f"a variable without a value: ${name} in {expr}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def variables(seconds: int, step: int, scrape_s: int, hosts: Sequence[str] = ()) -> dict[str, str]:
    """What Grafana gives its variables for a window of ``seconds`` drawn every ``step``."""
    # Host names are checked (main) to [A-Za-z0-9._-]: the dot is escaped, its backslash doubled
    # inside PromQL's double-quoted string, as Grafana's regex formatting does.
    host = "(" + "|".join(h.replace(".", "\\\\.") for h in hosts) + ")" if hosts else ".*"
    return {
        "host": host,
        "__range": f"{seconds}s",
        "__interval": f"{step}s",
        "__rate_interval": f"{max(step + scrape_s, 4 * scrape_s)}s",
    }


@dataclass(frozen=True)
class Target:
    ref: str
    expr: str
    legend: str
    instant: bool


@dataclass(frozen=True)
class Panel:
    id: int
    title: str
    kind: str  # Grafana's panel type: timeseries, state-timeline, bargauge, ...
    description: str
    unit: str
    mappings: dict[str, tuple[str, str]]  # value -> (text, colour)
    grid: tuple[int, int, int, int]  # x, y, w, h in Grafana's 24-column grid
    targets: tuple[Target, ...]

    @property
    def instant(self) -> bool:
        return all(t.instant for t in self.targets)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise DashboardError(f"{where}: not text")
    return value


def load_panels(path: Path = DASHBOARD) -> list[Panel]:
    """The panels of a Grafana dashboard JSON, in reading order (row by row)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DashboardError(f"{path}: not a dashboard JSON: {exc}") from None
    panels = []
    for i, p in enumerate(document.get("panels", []) if isinstance(document, dict) else []):
        where = f"{path}: panel {i}"
        title = _text(p.get("title"), f"{where} title")
        defaults = (p.get("fieldConfig") or {}).get("defaults") or {}
        mappings: dict[str, tuple[str, str]] = {}
        for m in defaults.get("mappings") or []:
            if m.get("type") == "value":
                for value, shown in (m.get("options") or {}).items():
                    colour = COLOURS.get(shown.get("color", ""), UNMAPPED)
                    mappings[str(value)] = (str(shown.get("text", value)), colour)
        g = p.get("gridPos") or {}
        targets = tuple(
            Target(
                ref=str(t.get("refId", "")),
                expr=_text(t.get("expr"), f"{where} ({title}) target expr"),
                legend=str(t.get("legendFormat") or ""),
                instant=bool(t.get("instant")) and not t.get("range", False),
            )
            for t in p.get("targets") or []
        )
        panels.append(
            Panel(
                id=int(p.get("id", i)),
                title=title,
                kind=str(p.get("type", "timeseries")),
                description=str(p.get("description") or ""),
                unit=str(defaults.get("unit") or ""),
                mappings=mappings,
                grid=(int(g.get("x", 0)), int(g.get("y", 0)), int(g.get("w", 24)), int(g.get("h", 8))),
                targets=targets,
            )
        )
    if not panels:
        raise DashboardError(f"{path}: no panels")
    return sorted(panels, key=lambda p: (p.grid[1], p.grid[0]))


# --------------------------------------------------------------------------- Prometheus' answers
@dataclass
class Series:
    name: str  # the legend, untrusted text
    points: list[tuple[float, float | None]]  # (time, value); None: a gap (NaN, ±Inf)


@dataclass
class PanelData:
    panel: Panel
    series: list[Series] = field(default_factory=list)
    cut: int = 0  # series left out beyond MAX_SERIES


def _value(text: object, url: str, query: str) -> float | None:
    """A sample's value as Prometheus writes it (a string): a number, or None for NaN and the
    infinities (drawn as a gap); anything else is an error."""
    if not isinstance(text, str) or len(text) > 40:
        raise DashboardError(f"Prometheus at {url}: a value that is not a number (query: {query})")
    try:
        value = float(text)
    except ValueError:
        raise DashboardError(f"Prometheus at {url}: {printable(text)!s} is not a number (query: {query})") from None
    return value if math.isfinite(value) else None


def _time(value: object, low: float, high: float, url: str, query: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise DashboardError(
            f"Prometheus at {url}: a sample time {printable(str(value)[:40])!s} outside the window (query: {query})"
        )
    return float(value)


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's ``legendFormat``: ``{{label}}`` replaced by the label's value (empty if absent);
    without a format, the series' labels as ``{a="b"}``."""
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)


def query_panel(prom: Prometheus, panel: Panel, values: Mapping[str, str], window: Window) -> PanelData:
    data = PanelData(panel)
    for target in panel.targets:
        query = substitute(target.expr, values)
        if target.instant:
            answer = prom._get("/api/v1/query", {"query": query, "time": _ts(window.end)}, query)
            kind, rows = answer.get("resultType"), answer["result"]
        else:
            params = {"query": query, "start": _ts(window.start), "end": _ts(window.end), "step": str(window.step)}
            answer = prom._get("/api/v1/query_range", params, query)
            kind, rows = answer.get("resultType"), answer["result"]
        wanted = "vector" if target.instant else "matrix"
        if kind != wanted:
            raise DashboardError(
                f"Prometheus at {prom.url}: expected a {wanted}, got {printable(kind)} (query: {query})"
            )
        for row in rows:
            if len(data.series) >= MAX_SERIES:
                data.cut += 1
                continue
            labels = _labels(row, prom.url, query)
            low, high = window.start - window.step, window.end + window.step
            if target.instant:
                pair = row.get("value")
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise DashboardError(f"Prometheus at {prom.url}: a sample is not [time, value] (query: {query})")
                points = [(_time(pair[0], low, high, prom.url, query), _value(pair[1], prom.url, query))]
            else:
                pairs = row.get("values")
                if not isinstance(pairs, list) or len(pairs) > POINTS * 2 + 2:
                    raise DashboardError(f"Prometheus at {prom.url}: a series without its values (query: {query})")
                points = []
                for pair in pairs:
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise DashboardError(f"Prometheus at {prom.url}: a point is not [time, value] (query: {query})")
                    points.append((_time(pair[0], low, high, prom.url, query), _value(pair[1], prom.url, query)))
            data.series.append(Series(legend(target.legend, labels), sorted(points, key=lambda p: p[0])))
    return data


# --------------------------------------------------------------------------- drawing
@dataclass(frozen=True)
class Window:
    end: float
    seconds: int
    step: int

    @property
    def start(self) -> float:
        # On the step's grid, as Grafana aligns a range query, so that every panel's points match.
        return math.floor((self.end - self.seconds) / self.step) * self.step


def nice_step(seconds: int, points: int = POINTS) -> int:
    """The smallest of Grafana's round steps that draws ``seconds`` in at most ``points`` points."""
    for step in NICE_STEPS:
        if seconds / step <= points:
            return step
    return math.ceil(seconds / points)


def esc(text: object) -> str:
    """Untrusted text for the page: control characters made visible, then HTML-escaped (quotes
    too: some of it goes into attributes)."""
    return html.escape(printable(text), quote=True)


def fmt_value(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    suffix = {"watt": " W", "reqps": " req/s", "h": " h", "s": " s", "bytes": " B"}.get(unit, "")
    magnitude = abs(value)
    for scale, letter in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= scale:
            return f"{value / scale:.3g}{letter}{suffix}"
    if magnitude == 0 or magnitude >= 100:
        return f"{value:.0f}{suffix}"
    return f"{value:.3g}{suffix}"


def _nice_ceiling(value: float, ticks: int = 4) -> float:
    """The smallest ``ticks`` times a round tick (1, 2 or 5 times a power of ten) at or above ``value``."""
    if value <= 0:
        return 1.0
    tick = value / ticks
    power = 10 ** math.floor(math.log10(tick))
    for m in (1, 2, 5, 10):
        if tick <= m * power * (1 + 1e-9):
            return m * power * ticks
    return 10 * power * ticks


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M")


def _time_ticks(window: Window) -> list[float]:
    span = window.end - window.start
    tick = next((s for s in (600, 1800, 3600, 7200, 10800, 21600, 43200, 86400) if span / s <= 8), 86400 * 7)
    first = math.ceil(window.start / tick) * tick
    return [float(t) for t in range(int(first), int(window.end) + 1, tick)]


# Chart geometry (SVG user units; the SVG scales to its panel's width).
LEFT, RIGHT, TOP, BOTTOM = 64, 22, 10, 24
ROW_H = 20


def _x(t: float, window: Window, width: float) -> float:
    return LEFT + (t - window.start) / (window.end - window.start) * (width - LEFT - RIGHT)


def line_chart(data: PanelData, window: Window, width: int, height: int = 220) -> str:
    values = [v for s in data.series for _, v in s.points if v is not None]
    low = min(0.0, min(values))
    high = _nice_ceiling(max(values)) if max(values) > 0 else 1.0
    if low < 0:
        low = -_nice_ceiling(-low)
    plot_h = height - TOP - BOTTOM

    def y(v: float) -> float:
        return TOP + (high - v) / (high - low) * plot_h

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{esc(data.panel.title)}">']
    for i in range(5):
        tick = low + (high - low) * i / 4
        out.append(
            f'<line class="grid" x1="{LEFT}" x2="{width - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}"/>'
            f'<text class="ytick" x="{LEFT - 6}" y="{y(tick) + 4:.1f}">{esc(fmt_value(tick, data.panel.unit))}</text>'
        )
    for t in _time_ticks(window):
        x = _x(t, window, width)
        out.append(
            f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}"/>'
            f'<text class="xtick" x="{x:.1f}" y="{height - 6}">{_clock(t)}</text>'
        )
    for i, s in enumerate(data.series):
        d: list[str] = []
        pen_down, last = False, None
        for t, v in s.points:
            if v is None or (last is not None and t - last > 1.5 * window.step):
                pen_down = False
            if v is not None:
                d.append(f"{'L' if pen_down else 'M'}{_x(t, window, width):.1f},{y(v):.1f}")
                pen_down = True
            last = t
        if d:
            out.append(f'<path class="series" stroke="{PALETTE[i % len(PALETTE)]}" d="{" ".join(d)}"/>')
    out.append("</svg>")
    return "".join(out)


def _state(value: float | None, mappings: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    if value is None:
        return None
    key = str(int(value)) if value == int(value) else repr(value)
    return mappings.get(key, (fmt_value(value, ""), UNMAPPED))


def state_timeline(data: PanelData, window: Window, width: int) -> str:
    rows = len(data.series)
    height = TOP + rows * ROW_H + BOTTOM
    label_w = 150
    left = LEFT + label_w - 40

    def x(t: float) -> float:
        return left + (t - window.start) / (window.end - window.start) * (width - left - RIGHT)

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{esc(data.panel.title)}">']
    for t in _time_ticks(window):
        out.append(
            f'<line class="grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" y2="{height - BOTTOM}"/>'
            f'<text class="xtick" x="{x(t):.1f}" y="{height - 6}">{_clock(t)}</text>'
        )
    for r, s in enumerate(data.series):
        top = TOP + r * ROW_H + 2
        out.append(f'<text class="rowlabel" x="{left - 6}" y="{top + ROW_H / 2 + 2:.1f}">{esc(s.name)}</text>')
        # Each point holds its state until the next point (at most a step and a half: a gap is a gap).
        shapes: dict[str, list[str]] = {}
        for i, (t, v) in enumerate(s.points):
            state = _state(v, data.panel.mappings)
            if state is None:
                continue
            nxt = s.points[i + 1][0] if i + 1 < len(s.points) else t + window.step
            end = min(nxt, t + window.step, window.end)
            if end <= t:
                end = t + window.step / 2
            x0, x1 = x(t), x(min(end, window.end))
            shapes.setdefault(state[1], []).append(f"M{x0:.1f},{top}H{x1 + 0.4:.1f}V{top + ROW_H - 4}H{x0:.1f}Z")
        for colour, parts in shapes.items():
            out.append(f'<path class="state" fill="{colour}" d="{"".join(parts)}"/>')
    out.append("</svg>")
    return "".join(out)


def table(data: PanelData) -> str:
    values = [v for s in data.series for _, v in s.points if v is not None]
    top = max(values, default=0.0) or 1.0
    rows = []
    for s in sorted(data.series, key=lambda s: s.name):
        v = s.points[-1][1] if s.points else None
        bar = max(0.0, min(100.0, (v or 0.0) / top * 100))
        shown = "-" if v is None else fmt_value(v, data.panel.unit)
        rows.append(
            f'<tr><td class="name">{esc(s.name)}</td><td class="num">{esc(shown)}</td>'
            f'<td class="bar"><span style="width:{bar:.1f}%"></span></td></tr>'
        )
    return '<table class="values"><tr><th>series</th><th>value</th><th></th></tr>' + "".join(rows) + "</table>"


def legend_html(data: PanelData) -> str:
    if data.panel.kind == "state-timeline":
        items = list(dict.fromkeys(data.panel.mappings.values()))
    else:
        items = [(s.name, PALETTE[i % len(PALETTE)]) for i, s in enumerate(data.series)]
    spans = "".join(
        f'<span class="item"><span class="swatch" style="background:{colour}"></span><span class="name">{esc(name)}</span></span>'
        for name, colour in items
    )
    return f'<div class="legend">{spans}</div>'


def panel_html(data: PanelData, window: Window) -> str:
    p = data.panel
    x, _, w, _ = p.grid
    width = max(200, w * 55)
    head = (
        f'<section class="panel" data-panel-id="{p.id}" data-kind="{esc(p.kind)}" '
        f'style="grid-column:{x + 1} / span {w}"><h2>{esc(p.title)}</h2>'
        f'<p class="description">{esc(p.description)}</p>'
    )
    has_data = any(v is not None for s in data.series for _, v in s.points)
    if not has_data:
        body = '<p class="nodata">no data</p>'
    elif p.instant:
        body = table(data)
    elif p.kind == "state-timeline":
        body = state_timeline(data, window, width) + legend_html(data)
    else:
        body = line_chart(data, window, width) + legend_html(data)
    if data.cut:
        body += f'<p class="cut">{data.cut} more series not shown</p>'
    return head + body + "</section>"


STYLE = """
body{margin:0;padding:16px;background:#111217;color:#ccccdc;font:13px/1.35 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
header h1{font-size:20px;margin:0 0 4px}header p{margin:0 0 12px;color:#8e8e9e}
.grid{display:grid;grid-template-columns:repeat(24,1fr);gap:10px}
.panel{background:#181b1f;border:1px solid #2c3235;border-radius:3px;padding:8px 10px;min-width:0}
.panel h2{font-size:14px;margin:0 0 2px;color:#e0e0ea}
.description{margin:0 0 6px;color:#8e8e9e;font-size:11px}
svg.chart{width:100%;height:auto;display:block}
svg line.grid{stroke:#2c3235;stroke-width:1}
svg text{fill:#9fa7b3;font-size:11px}svg text.ytick,svg text.rowlabel{text-anchor:end}svg text.xtick{text-anchor:middle}
svg path.series{fill:none;stroke-width:1.6}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin-top:4px;font-size:12px}
.swatch{display:inline-block;width:12px;height:4px;margin-right:5px;vertical-align:middle;border-radius:1px}
.nodata{color:#ff7383;font-size:16px;padding:40px 0;text-align:center;margin:0}
.cut{color:#f2cc0c;margin:4px 0 0}
table.values{width:100%;border-collapse:collapse;font-size:12px}
table.values th{text-align:left;color:#8e8e9e;font-weight:normal;border-bottom:1px solid #2c3235}
table.values td{padding:3px 6px 3px 0}td.num{text-align:right;white-space:nowrap}
td.bar{width:45%}td.bar span{display:block;height:12px;background:#56a64b;border-radius:1px}
"""


def page(title: str, panels: Sequence[PanelData], window: Window, url: str) -> str:
    def at(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    sub = f"{at(window.start)} to {at(window.end)}, step {window.step}s, from the Prometheus at {url}"
    body = "".join(panel_html(d, window) for d in panels)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>"
        f'<header><h1>{esc(title)}</h1><p class="window">{esc(sub)}</p></header>'
        f'<main class="grid">{body}</main></body></html>\n'
    )


def build_page(prom: Prometheus, window: Window, panels: Sequence[Panel], values: Mapping[str, str], title: str) -> str:
    return page(title, [query_panel(prom, p, values, window) for p in panels], window, prom.url)


# --------------------------------------------------------------------------- command line
def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="The fleet's dashboard (the panels of dashboards/freetoken.json) as one static HTML page, "
        "from the gateway's Prometheus: no Grafana needed.",
    )
    prometheus_arguments(ap, since="6h")
    ap.add_argument(
        "--host", action="append", default=[], metavar="NAME", help="only this host (repeatable; default all)"
    )
    ap.add_argument(
        "--scrape-interval",
        type=parse_duration,
        default=15,
        metavar="DURATION",
        help="the gateway Prometheus' scrape interval, for $__rate_interval (default 15s)",
    )
    ap.add_argument(
        "--dashboard", type=Path, default=DASHBOARD, metavar="JSON", help="the Grafana dashboard JSON to draw"
    )
    ap.add_argument("--out", metavar="PATH", help="write the page here (default: standard output)")
    return ap


def _write(path: str, text: str) -> None:
    """The whole page or nothing: written beside its place and renamed over it."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    for h in args.host:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", h):
            print(f"{prog}: --host {h!r}: not a host name of the inventory", file=sys.stderr)
            return 2
    end = args.until if args.until is not None else datetime.now(timezone.utc).timestamp()
    window = Window(end=end, seconds=args.since, step=nice_step(args.since))
    try:
        panels = load_panels(args.dashboard)
        title = json.loads(args.dashboard.read_text(encoding="utf-8")).get("title") or "dashboard"
        prom = Prometheus(args.prometheus, _token(args.token_file), timeout=args.timeout)
        values = variables(args.since, window.step, args.scrape_interval, args.host)
        text = build_page(prom, window, panels, values, str(title))
    except LedgerError as exc:
        print(f"dashboard: {exc}", file=sys.stderr)
        return 1
    if args.out:
        try:
            _write(args.out, text)
        except OSError as exc:
            print(f"dashboard: --out {args.out}: {exc.strerror}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
