"""The fleet's ledger: per host, what the owner gave and what it served, read from the gateway's
Prometheus (docs/ledger.md).

    python -m freetoken_infra.ledger --prometheus http://gateway:9090 [--since 7d] [--json | --csv]

Per host, over the window: hours in each agent mode (serving, starting, yielding, yielded, held),
hours the owner held the GPU by reason, hours asleep and down, hours the agent was silent;
requests and tokens served; the GPU's energy, and tokens per Wh.

What the figures are made of (the series the host agent writes into node_exporter's textfile
collector, scraped with ``host="<inventory name>"`` by the gateway's Prometheus,
``operations/gateway.py`` ``scrape_config``, job ``freetoken-guard``):

* **Hours** are counted on a fixed grid: Prometheus evaluates the state at every ``--step``
  (default 60 s) in the window (a subquery, ``count_over_time((COND)[WINDOW:STEP])``) and each
  step where the condition holds counts one step. A change of state is placed within one step
  of where it happened, whatever the scrape interval was (it may differ between jobs, change
  over time, and scrapes get missed: a per-sample count times an assumed interval would be off
  by all of that).
* A **mode** counts only where the host's node_exporter answered (``up == 1``) and the agent's
  last loop (``freetoken_agent_last_loop_timestamp_seconds``) is at most ``AGENT_SILENT_S``
  old; otherwise the textfile is a dead agent's last word, and the step counts as **silent**.
* **Asleep**: node_exporter did not answer (``up == 0``) and the agent's last mode before that
  was ``yielded`` or ``held`` (the owner had the machine: asleep, shut down, rebooting).
  **Down**: it did not answer and the last mode was anything else, or none was ever seen: a
  host that left the fleet while it should serve. Telling the two apart needs the last mode
  carried forward across the gap, which PromQL has no cheap form for: the ledger reads those
  two series at the same step with ``query_range`` and carries it forward itself.
* **Requests and tokens**: ``increase(freetoken_engine_*_total[WINDOW])`` (Prometheus corrects
  for engine restarts, which reset the counters; it extrapolates to the window's edges, so the
  figure is within about one scrape's worth at each edge).
* **Energy** (Wh): ``freetoken_gpu_power_watts`` integrated on the same grid, each step's
  reading times the step (``sum_over_time(POWER[WINDOW:STEP]) * STEP``): the same left Riemann
  sum as the hours, so Wh(serving) is the energy of exactly the steps counted as serving, and it
  needs no knowledge of the scrape interval. It is the GPU's own reading (NVML board power),
  not the wall. Tokens per Wh divide the tokens by the Wh of the serving steps.

Everything Prometheus answers is untrusted: numbers must be finite and not negative, labels
are printed escaped (``core.text.printable``), a reason outside the agent's word set is counted
as ``other``. A bearer token (a Prometheus behind the gateway's auth) comes from
``--token-file`` or ``$FREETOKEN_PROMETHEUS_TOKEN``, never from the command line.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import requests

from freetoken_infra.core.owner import HELD, MODES, YIELDED
from freetoken_infra.core.text import printable

PROG = "python -m freetoken_infra.ledger"
TOKEN_ENV = "FREETOKEN_PROMETHEUS_TOKEN"
# The scrape job of the hosts' node_exporter (operations/gateway.py scrape_config; a unit test
# holds the two equal).
GUARD_JOB = "freetoken-guard"
# The agent's loop runs about once a second and rewrites its textfile each time; a scrape
# interval of up to a minute plus a late write still reads well inside this.
AGENT_SILENT_S = 180
# The owner's reasons the agent writes (the shared metric contract); any other label value is
# counted as "other" and never printed as a column name.
REASONS = ("game", "full_screen", "app", "snoozed", "off_schedule", "reboot_pending", "gpu_memory")
OTHER_REASON = "other"
# Modes after which a silent node_exporter means the owner's machine sleeps (or is off).
OWNER_MODES = (YIELDED, HELD)
# Prometheus refuses a query_range of more than 11,000 points per series.
RANGE_POINTS = 10_000
# An answer larger than this is not a Prometheus answer we asked for.
MAX_ANSWER_BYTES = 64 * 2**20
_DURATION = re.compile(r"([0-9]+)(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class LedgerError(Exception):
    """What went wrong, naming the Prometheus URL and the query where there is one."""


def parse_duration(text: str) -> int:
    """``7d``, ``12h``, ``90m``, ``1h30m``, ``3600s`` or a plain number of seconds: whole seconds > 0."""
    text = text.strip()
    if re.fullmatch(r"[0-9]+", text):
        seconds = float(text)
    elif text and re.fullmatch(r"(?:[0-9]+(?:ms|s|m|h|d|w))+", text):
        seconds = sum(int(n) * _UNITS[u] for n, u in _DURATION.findall(text))
    else:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 7d, 12h, 90m, 3600s)")
    if seconds < 1 or seconds != int(seconds):
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of seconds of at least 1, please")
    return int(seconds)


def parse_time(text: str) -> float:
    """The window's end: unix seconds or an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        return float(text) if re.fullmatch(r"[0-9]+(\.[0-9]+)?", text) else _iso(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from None


def _iso(text: str) -> float:
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


# --------------------------------------------------------------------------- Prometheus
class Prometheus:
    """Prometheus' HTTP API (``/api/v1/query``, ``/api/v1/query_range``); every answer checked."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        if not re.fullmatch(r"https?://[^\s/?#@]+(/[^\s?#]*)?", url):
            # No user:password@ either: the URL is printed in every error; a token goes in a file.
            raise LedgerError(
                "--prometheus: an http:// or https:// URL without credentials, please (e.g. http://gateway:9090)"
            )
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy from the environment between us and the token's reader
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def _get(self, path: str, params: Mapping[str, str], query: str) -> Any:
        where = f"Prometheus at {self.url}"
        try:
            with self.session.get(
                self.url + path, params=params, timeout=self.timeout, stream=True, allow_redirects=False
            ) as r:
                body = r.raw.read(MAX_ANSWER_BYTES + 1, decode_content=True)
                status = r.status_code
        except requests.RequestException as exc:
            raise LedgerError(f"cannot reach {where}: {_first(exc)} (query: {query})") from None
        if len(body) > MAX_ANSWER_BYTES:
            raise LedgerError(f"{where} answered more than {MAX_ANSWER_BYTES} bytes (query: {query})")
        try:
            answer = json.loads(body)
        except ValueError:
            raise LedgerError(
                f"{where} answered HTTP {status} that is not Prometheus' JSON: {printable(body[:200].decode(errors='replace'))} (query: {query})"
            ) from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            error = answer.get("error") if isinstance(answer, dict) else None
            kind = answer.get("errorType") if isinstance(answer, dict) else None
            raise LedgerError(
                f"{where} refused the query (HTTP {status}, {printable(kind or 'no errorType')}): "
                f"{printable(error or 'no error text')} (query: {query})"
            )
        data = answer.get("data")
        if not isinstance(data, dict) or not isinstance(data.get("result"), list):
            raise LedgerError(f"{where} answered without data.result (query: {query})")
        return data

    def vector(self, query: str, at: float) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series."""
        data = self._get("/api/v1/query", {"query": query, "time": _ts(at)}, query)
        if data.get("resultType") != "vector":
            raise LedgerError(
                f"Prometheus at {self.url}: expected a vector, got {printable(data.get('resultType'))} (query: {query})"
            )
        return [(_labels(s, self.url, query), _number(s.get("value"), self.url, query)) for s in data["result"]]

    def matrix(
        self, query: str, start: float, end: float, step: int
    ) -> list[tuple[dict[str, str], dict[float, float]]]:
        """A range query from ``start`` to ``end`` (both on the step's grid), in pieces of at most
        RANGE_POINTS steps: (labels, {time: value}) per series, the pieces joined."""
        series: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], dict[float, float]]] = {}
        piece_start = start
        while piece_start <= end:
            piece_end = min(end, piece_start + (RANGE_POINTS - 1) * step)
            params = {"query": query, "start": _ts(piece_start), "end": _ts(piece_end), "step": str(step)}
            data = self._get("/api/v1/query_range", params, query)
            if data.get("resultType") != "matrix":
                raise LedgerError(
                    f"Prometheus at {self.url}: expected a matrix, got {printable(data.get('resultType'))} (query: {query})"
                )
            for s in data["result"]:
                labels = _labels(s, self.url, query)
                values = s.get("values")
                if not isinstance(values, list):
                    raise LedgerError(f"Prometheus at {self.url}: a series without values (query: {query})")
                points = series.setdefault(tuple(sorted(labels.items())), (labels, {}))[1]
                for pair in values:
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise LedgerError(f"Prometheus at {self.url}: a point is not [time, value] (query: {query})")
                    points[_number([0, pair[0]], self.url, query)] = _number(pair, self.url, query)
            piece_start = piece_end + step
        return list(series.values())


def _ts(t: float) -> str:
    return f"{t:.3f}"


def _first(exc: BaseException) -> str:
    return printable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _labels(sample: object, url: str, query: str) -> dict[str, str]:
    metric = sample.get("metric") if isinstance(sample, dict) else None
    if not isinstance(metric, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items()):
        raise LedgerError(f"Prometheus at {url}: a series whose labels are not text (query: {query})")
    return metric


def _number(pair: object, url: str, query: str) -> float:
    """The value of a ``[time, "value"]`` pair: finite and not negative (every figure we ask for
    is a count, an increase or an energy)."""
    text = pair[1] if isinstance(pair, list) and len(pair) == 2 else None
    try:
        value = float(text) if isinstance(text, (str, int, float)) and not isinstance(text, bool) else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise LedgerError(f"Prometheus at {url}: {printable(str(text)[:80])!s} is not a count (query: {query})")
    return value


# --------------------------------------------------------------------------- the ledger
@dataclass
class HostLedger:
    """One host's figures over the window; hours are step counts times the step."""

    host: str
    seen_h: float = 0.0  # Prometheus had a target state for it (up 0 or 1)
    modes_h: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    reasons_h: dict[str, float] = field(default_factory=dict)
    asleep_h: float = 0.0
    down_h: float = 0.0
    silent_h: float = 0.0
    requests: float | None = None
    tokens: float | None = None
    wh_serving: float | None = None
    wh_all: float | None = None
    agent_seen: bool = False

    @property
    def tokens_per_wh(self) -> float | None:
        if self.tokens is None or not self.wh_serving:
            return None
        return self.tokens / self.wh_serving

    @property
    def no_data(self) -> str | None:
        """Why the host has no figures, or None."""
        if not self.seen_h and not self.agent_seen and self.tokens is None:
            return "no data: Prometheus has no sample of this host in the window"
        if not self.agent_seen:
            return "no agent samples (freetoken_agent_mode) in the window: is the host agent installed?"
        return None


@dataclass(frozen=True)
class Window:
    end: float
    seconds: int
    step: int

    @property
    def start(self) -> float:
        return self.end - self.seconds

    def grid(self) -> tuple[float, float]:
        """The first and last step of a subquery ``[seconds:step]`` evaluated at ``end``: the
        multiples of ``step`` in (start, end], as Prometheus aligns them."""
        first = (math.floor(self.start / self.step) + 1) * self.step
        last = math.floor(self.end / self.step) * self.step
        return first, last


def _up(host_filter: str) -> str:
    return f'max by (host) (up{{job="{GUARD_JOB}"{host_filter}}})'


def queries(window: Window, host_filter: str = "") -> dict[str, str]:
    """The instant queries of the ledger, by figure (``host_filter``: a label matcher, with its
    leading comma, that narrows every series to the asked hosts)."""
    # Subqueries over (end - seconds, end]: a millisecond short of the window, so that the grid's
    # first step is the one after its start whether Prometheus' ranges include their start (2.x)
    # or not (3.x); `increase` takes the whole window.
    w, s = f"{window.seconds * 1000 - 1}ms", f"{window.step}s"
    whole = f"{window.seconds}s"
    f = host_filter
    up = _up(f)
    live = (
        f"(({up}) == 1) and on (host) "
        f"(time() - max by (host) (freetoken_agent_last_loop_timestamp_seconds{{{f[1:]}}}) <= {AGENT_SILENT_S})"
    )
    power = f"sum by (host) (freetoken_gpu_power_watts{{{f[1:]}}})"
    serving = f'max by (host) (freetoken_agent_mode{{mode="serving"{f}}}) == 1'
    return {
        "seen": f"count_over_time(({up})[{w}:{s}])",
        # max by: a host scraped twice (a relabelled target) counts each step once
        "modes": f"sum by (host, mode) (count_over_time((max by (host, mode) (freetoken_agent_mode{{{f[1:]}}}) == 1 and on (host) ({live}))[{w}:{s}]))",
        "reasons": f"sum by (host, reason) (count_over_time((max by (host, reason) (freetoken_agent_yield_reason{{{f[1:]}}}) == 1 and on (host) ({live}))[{w}:{s}]))",
        "silent": f"count_over_time(((({up}) == 1) unless on (host) ({live}))[{w}:{s}])",
        "agent": f"max by (host) (count_over_time(freetoken_agent_mode{{{f[1:]}}}[{whole}]))",
        "requests": f"sum by (host) (increase(freetoken_engine_requests_total{{{f[1:]}}}[{whole}]))",
        "tokens": f"sum by (host) (increase(freetoken_engine_generated_tokens_total{{{f[1:]}}}[{whole}]))",
        "wh_all": f"sum_over_time(({power} and on (host) (({up}) == 1))[{w}:{s}])",
        "wh_serving": f"sum_over_time(({power} and on (host) ({serving}) and on (host) ({live}))[{w}:{s}])",
    }


def _owner_mode(host_filter: str) -> str:
    owner = "|".join(OWNER_MODES)
    return f'max by (host) (freetoken_agent_mode{{mode=~"{owner}"{host_filter}}})'


def _host(labels: Mapping[str, str], url: str, query: str) -> str:
    host = labels.get("host")
    if not host:
        raise LedgerError(f"Prometheus at {url}: a series without a host label (query: {query})")
    return host


def build_ledger(prom: Prometheus, window: Window, hosts: Sequence[str] = ()) -> dict[str, HostLedger]:
    """Every host's figures (``hosts``: only these, each with a row even without data)."""
    # Host names are checked (main) to [A-Za-z0-9._-]: only the dot is special in the regex,
    # and its backslash is doubled inside PromQL's double-quoted string.
    host_filter = ', host=~"' + "|".join(h.replace(".", "\\\\.") for h in hosts) + '"' if hosts else ""
    step_h = window.step / 3600
    out: dict[str, HostLedger] = {h: HostLedger(h) for h in hosts}

    def row(labels: Mapping[str, str], query: str) -> HostLedger:
        name = _host(labels, prom.url, query)
        return out.setdefault(name, HostLedger(name))

    q = queries(window, host_filter)
    for labels, v in prom.vector(q["seen"], window.end):
        row(labels, q["seen"]).seen_h = v * step_h
    for labels, v in prom.vector(q["agent"], window.end):
        row(labels, q["agent"]).agent_seen = v > 0
    for labels, v in prom.vector(q["modes"], window.end):
        mode = labels.get("mode", "")
        if mode in MODES:
            row(labels, q["modes"]).modes_h[mode] += v * step_h
    for labels, v in prom.vector(q["reasons"], window.end):
        reason = labels.get("reason", "")
        key = reason if reason in REASONS else OTHER_REASON
        reasons = row(labels, q["reasons"]).reasons_h
        reasons[key] = reasons.get(key, 0.0) + v * step_h
    for labels, v in prom.vector(q["silent"], window.end):
        row(labels, q["silent"]).silent_h = v * step_h
    for name in ("requests", "tokens"):
        for labels, v in prom.vector(q[name], window.end):
            setattr(row(labels, q[name]), name, v)
    for name in ("wh_all", "wh_serving"):
        for labels, v in prom.vector(q[name], window.end):
            setattr(row(labels, q[name]), name, v * step_h)
    for host, (asleep, down) in _sleep_and_down(prom, window, host_filter).items():
        r = out.setdefault(host, HostLedger(host))
        r.asleep_h, r.down_h = asleep * step_h, down * step_h
    for r in out.values():  # a host with power samples but no serving step served with 0 Wh
        if r.wh_all is not None and r.wh_serving is None:
            r.wh_serving = 0.0
    return dict(sorted(out.items()))


def _sleep_and_down(prom: Prometheus, window: Window, host_filter: str) -> dict[str, tuple[int, int]]:
    """Steps on the ledger's grid where node_exporter did not answer, split by the agent's last
    mode before them: (asleep, down) per host."""
    first, last = window.grid()
    up_q, owner_q = _up(host_filter), _owner_mode(host_filter)
    # The last mode before the window (a host asleep since before it), a week back at most.
    before_q = (
        f'max by (host) (last_over_time(freetoken_agent_mode{{mode=~"{"|".join(OWNER_MODES)}"{host_filter}}}[7d]))'
    )
    owner_before = {_host(lb, prom.url, before_q): v for lb, v in prom.vector(before_q, first - window.step)}
    owner_at = {_host(lb, prom.url, owner_q): pts for lb, pts in prom.matrix(owner_q, first, last, window.step)}
    out: dict[str, tuple[int, int]] = {}
    for labels, points in prom.matrix(up_q, first, last, window.step):
        host = _host(labels, prom.url, up_q)
        owner = owner_before.get(host)
        owned = owner_at.get(host, {})
        asleep = down = 0
        for t in sorted(points):
            if t in owned:
                owner = owned[t]
            if points[t] == 0:
                if owner == 1:
                    asleep += 1
                else:
                    down += 1
        out[host] = (asleep, down)
    return out


# --------------------------------------------------------------------------- output
TIME_COLUMNS = ("seen", *MODES, "asleep", "down", "silent")


def _hours(value: float) -> str:
    return f"{value:.2f}"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned like report.py's tables: the first column left, the figures right."""
    shown = [tuple(printable(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in [tuple(header), *shown]) for i in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        cells = [f"{r[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(r[1:], widths[1:], strict=True)]
        return "  ".join(cells).rstrip()

    return [title, fmt(header), "-" * (sum(widths) + 2 * (len(widths) - 1)), *(fmt(r) for r in shown)]


def _window_text(window: Window) -> str:
    def at(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    return f"{at(window.start)} to {at(window.end)}, step {window.step}s"


def format_table(ledger: Mapping[str, HostLedger], window: Window) -> str:
    with_data = {h: r for h, r in ledger.items() if r.no_data is None}
    lines = _table(
        f"== ledger: hours per host, {_window_text(window)} ==",
        ("host", *TIME_COLUMNS),
        [
            (
                h,
                _hours(r.seen_h),
                *(_hours(r.modes_h[m]) for m in MODES),
                _hours(r.asleep_h),
                _hours(r.down_h),
                _hours(r.silent_h),
            )
            for h, r in with_data.items()
        ],
    )
    reasons = [x for x in (*REASONS, OTHER_REASON) if any(r.reasons_h.get(x) for r in with_data.values())]
    lines.append("")
    if reasons:
        lines += _table(
            "== hours the owner held the GPU, by reason ==",
            ("host", *reasons),
            [(h, *(_hours(r.reasons_h.get(x, 0.0)) for x in reasons)) for h, r in with_data.items()],
        )
    else:
        lines.append("== hours the owner held the GPU, by reason ==\nno host was held by its owner in the window")
    lines.append("")
    lines += _table(
        "== served ==",
        ("host", "requests", "tokens", "GPU Wh serving", "GPU Wh all", "tokens/Wh"),
        [
            (
                h,
                _opt(r.requests, ".0f"),
                _opt(r.tokens, ".0f"),
                _opt(r.wh_serving, ".1f"),
                _opt(r.wh_all, ".1f"),
                _opt(r.tokens_per_wh, ".1f"),
            )
            for h, r in with_data.items()
        ],
    )
    for h, r in ledger.items():
        if r.no_data is not None:
            lines.append(f"{printable(h)}: {r.no_data}")
    if not ledger:
        lines.append(f"no host has data in the window (job {GUARD_JOB!r} in this Prometheus?)")
    return "\n".join(lines)


def _record(r: HostLedger) -> dict[str, Any]:
    return {
        "seen_h": r.seen_h,
        "modes_h": dict(r.modes_h),
        "reasons_h": dict(sorted(r.reasons_h.items())),
        "asleep_h": r.asleep_h,
        "down_h": r.down_h,
        "silent_h": r.silent_h,
        "requests": r.requests,
        "tokens": r.tokens,
        "wh_serving": r.wh_serving,
        "wh_all": r.wh_all,
        "tokens_per_wh": r.tokens_per_wh,
        "no_data": r.no_data,
    }


def format_json(ledger: Mapping[str, HostLedger], window: Window, url: str) -> str:
    document = {
        "prometheus": url,
        "window": {"start": window.start, "end": window.end, "seconds": window.seconds, "step_s": window.step},
        "hosts": {h: _record(r) for h, r in ledger.items()},
    }
    return json.dumps(document, indent=2, sort_keys=False)


CSV_COLUMNS = (
    "host",
    "seen_h",
    *(f"{m}_h" for m in MODES),
    "asleep_h",
    "down_h",
    "silent_h",
    *(f"reason_{x}_h" for x in (*REASONS, OTHER_REASON)),
    "requests",
    "tokens",
    "wh_serving",
    "wh_all",
    "tokens_per_wh",
    "no_data",
)


def _cell(value: object) -> str:
    """A CSV cell: empty for none; host text escaped and kept from reading as a spreadsheet formula."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    text = printable(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def format_csv(ledger: Mapping[str, HostLedger]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for h, r in ledger.items():
        rec = _record(r)
        values: list[object] = [h, rec["seen_h"], *(r.modes_h[m] for m in MODES), r.asleep_h, r.down_h, r.silent_h]
        values += [r.reasons_h.get(x, 0.0) for x in (*REASONS, OTHER_REASON)]
        values += [r.requests, r.tokens, r.wh_serving, r.wh_all, r.tokens_per_wh, r.no_data]
        writer.writerow([_cell(v) for v in values])
    return buf.getvalue()


# --------------------------------------------------------------------------- command line
def prometheus_arguments(ap: argparse.ArgumentParser, since: str) -> None:
    """The options every reader of the gateway's Prometheus takes (the ledger, the dashboard page):
    where it is, the window, the bearer token (from a file or the environment, never argv)."""
    ap.add_argument("--prometheus", required=True, metavar="URL", help="the Prometheus that scrapes the fleet")
    ap.add_argument(
        "--since",
        type=parse_duration,
        default=parse_duration(since),
        metavar="DURATION",
        help=f"the window (default {since})",
    )
    ap.add_argument(
        "--until", type=parse_time, metavar="TIME", help="the window's end: unix seconds or ISO 8601 (default now)"
    )
    ap.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"a bearer token for Prometheus, read from this file (or ${TOKEN_ENV}); never give it on the command line",
    )
    ap.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds per query (default 30)")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Per host: hours serving, yielded (by reason), asleep and down; requests, tokens and GPU energy, "
        "from the gateway's Prometheus.",
    )
    prometheus_arguments(ap, since="7d")
    ap.add_argument(
        "--step",
        type=parse_duration,
        default=60,
        metavar="DURATION",
        help="the grid hours and energy are counted on (default 60s); each change of state is placed within one step",
    )
    ap.add_argument(
        "--host", action="append", default=[], metavar="NAME", help="only this host (repeatable); each gets a row"
    )
    form = ap.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON document")
    form.add_argument("--csv", action="store_true", help="one CSV row per host")
    return ap


def _token(path: str | None) -> str | None:
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read(4096).strip()
        except OSError as exc:
            raise LedgerError(f"--token-file {path}: {exc.strerror}") from None
        if not text:
            raise LedgerError(f"--token-file {path}: the file is empty")
        return text
    return os.environ.get(TOKEN_ENV) or None


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.step > args.since:
        print(f"{prog}: --step ({args.step}s) is longer than --since ({args.since}s)", file=sys.stderr)
        return 2
    for h in args.host:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", h):
            print(f"{prog}: --host {h!r}: not a host name of the inventory", file=sys.stderr)
            return 2
    end = args.until if args.until is not None else datetime.now(timezone.utc).timestamp()
    window = Window(end=end, seconds=args.since, step=args.step)
    try:
        prom = Prometheus(args.prometheus, _token(args.token_file), timeout=args.timeout)
        ledger = build_ledger(prom, window, args.host)
    except LedgerError as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(format_json(ledger, window, prom.url))
    elif args.csv:
        sys.stdout.write(format_csv(ledger))
    else:
        print(format_table(ledger, window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
